"""Decoding constrained to the action format: the automaton accepts exactly the calls the
format writes, and a random policy constrained by it writes only valid actions."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cua_jax.actions.api import RunShell
from cua_jax.actions.core import (
    Answer,
    Click,
    CoordinateSpace,
    Done,
    Drag,
    Fail,
    InvalidAction,
    Key,
    Move,
    Scroll,
    TypeText,
    Wait,
)
from cua_jax.actions.qwen import QwenComputerUse
from cua_jax.data.tokenizer import load_default_tokenizer
from cua_jax.sampler.grammar import TokenAutomaton, action_automaton

SPACE3 = CoordinateSpace.relative(1280, 720)
ACTIONS = [
    Click(640, 360),
    Click(0, 0, "right"),
    Click(1279, 719, "left", 2),
    Click(10, 20, "left", 3),
    Click(5, 5, "middle"),
    Move(100, 200),
    Drag(300, 400),
    Drag(300, 400, 10, 20),
    TypeText('say "hi"\n\tüñí 中文 \\ /'),
    TypeText(""),
    Key(("ctrl", "c")),
    Key(("enter",)),
    Key(("ctrl", "shift", "+")),
    Key(('"',)),
    Scroll(None, None, 0.0, -300.0),
    Scroll(50, 60, 120.0, 0.0),
    Wait(2.5),
    Wait(1),
    Done(),
    Fail(),
    Answer("42"),
]


@pytest.fixture(scope="module")
def sp():
    return load_default_tokenizer()


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    from cua_jax.data.tokenizer import HFTokenizer
    from tests.data.hf_local import build_hf_tokenizer

    return HFTokenizer(build_hf_tokenizer())


@pytest.fixture(scope="module")
def v3(sp):
    return action_automaton(sp, QwenComputerUse("3"), ("run_shell",))


@pytest.mark.parametrize("which", ["sp", "hf"])
def test_token_bytes_spell_the_decoded_text(which, request):
    tok = request.getfixturevalue(which)
    tb = tok.token_bytes()
    assert len(tb) == tok.vocab_size
    assert tb[tok.im_end_id] is None and tb[tok.image_pad_id] is None  # control tokens
    assert tb[tok.tool_call_start_id] == b"<tool_call>"
    for text in ("click [312, 84] now", ' "a": {"b": [1, 2]}\n', "üñí 中文 ~ \\ \t", "x  y"):
        ids = tok.encode(text)
        assert b"".join(tb[i] for i in ids) == tok.decode(ids).encode() == text.encode()


def test_every_action_the_format_writes_is_accepted_and_nothing_else(sp, v3):
    fmt = QwenComputerUse("3")
    for a in [*ACTIONS, RunShell("ls -la ~")]:
        text = fmt.format(a, SPACE3)
        if "\n<tool_call>" in text:  # a two-axis scroll is two calls: one at a time
            continue
        assert v3.accepts(sp.encode(text)), text
        end = v3.walk(sp.encode(text))
        assert v3.step(end, sp.im_end_id) >= 0 and v3.step(end, sp.endoftext_id) >= 0
    good = fmt.format(Click(640, 360), SPACE3)
    bad = [
        good.replace('"left_click"', '"left_clik"'),  # unknown action
        good.replace("[500, 500]", "[500, 1001]"),  # past the 0..1000 range
        good.replace("[500, 500]", "[500, 05]"),  # a leading zero
        good.replace('"coordinate"', "'coordinate'"),  # not JSON
        good.replace("}}", "}"),  # a brace short
        good + "\n" + good,  # two calls
        good[:-3],  # cut short
        "I will click.\n" + good,  # prose first
        fmt.format(Key(("ctrl",)), SPACE3).replace('"ctrl"', '"ctrlx"'),  # no such key
    ]
    assert "[500, 500]" in good
    for text in bad:
        assert not v3.accepts(sp.encode(text)), text
    # an API tool is in the language only when the grammar was built with it
    plain = action_automaton(sp, fmt)
    assert not plain.accepts(sp.encode(fmt.format(RunShell("ls"), SPACE3)))
    # a stop token only where the call is whole
    assert v3.step(v3.walk(sp.encode(good[:20])), sp.im_end_id) == -1


def test_pixel_coordinates_of_qwen25(sp):
    fmt = QwenComputerUse("2.5")
    a = action_automaton(sp, fmt)
    space = CoordinateSpace.resized(1920, 1080, 1932, 1092)
    for act in (Click(1919, 1079), Click(0, 0), Scroll(10, 10, 0.0, 5.0)):
        assert a.accepts(sp.encode(fmt.format(act, space)))
    assert not a.accepts(sp.encode(fmt.format(Answer("x"), SPACE3)))  # not a 2.5 action


def test_tables_are_consistent_and_every_state_can_go_on(sp, v3):
    V = sp.vocab_size
    assert v3.token_class.shape == (V,) and v3.allow.shape == v3.next_state.shape
    np.testing.assert_array_equal(v3.allow, v3.next_state >= 0)
    assert not v3.allow[:, 0].any()  # class 0: allowed nowhere
    assert v3.allow.any(axis=1).all()
    # control tokens are allowed nowhere; the rest (most of it may sit in a JSON string) fall
    # in few classes
    assert v3.token_class[sp.image_pad_id] == v3.token_class[sp.im_start_id] == 0
    assert v3.allow.shape[1] < V // 4


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 1535), max_size=40))
def test_walk_is_step_by_step_and_dead_tokens_stay_dead(v3, tokens):
    s = v3.initial
    for t in tokens:
        nxt = v3.step(s, t)
        assert nxt == (-1 if s < 0 else int(v3.next_state[s, v3.token_class[t]]))
        if s >= 0:
            assert (nxt >= 0) == bool(v3.allowed(s)[t])
        s = nxt
    assert v3.walk(tokens) == s


def test_a_missing_character_is_refused_at_build():
    tb = [b"<", b"tool_call>", b"a"]
    with pytest.raises(ValueError, match="this vocabulary cannot write"):
        TokenAutomaton.build("<tool_call>b", tb, stop_ids=[2])


def test_a_random_policy_constrained_writes_only_valid_actions(sp, v3):
    """A random-init tiny model: unconstrained, its replies are garbage; constrained, every
    reply at temperature 1 that stops is one valid action (and every reply a prefix of one),
    greedy is the masked argmax step by step, and its log-probs are the unmasked policy's."""
    from cua_jax.models import qwen_vl
    from cua_jax.sampler import Engine, SamplingParams

    cfg = qwen_vl.tiny("qwen3_vl", vocab_size=sp.vocab_size, **sp.vision_token_ids())
    model = qwen_vl.init_random(cfg, seed=0)
    engine = Engine(
        model,
        max_slots=4,
        page_size=16,
        num_pages=256,
        max_seq_len=256,
        decode_chunk=8,
        grammar=v3,
    )
    prompt = sp.encode("<|im_start|>user\nClick the red button.<|im_end|>\n<|im_start|>assistant\n")
    fmt = QwenComputerUse("3")

    def params(seed, constrained, temperature=1.0):
        return SamplingParams(
            temperature=temperature,
            seed=seed,
            max_new_tokens=160,
            stop_token_ids=sp.stop_ids,
            constrained=constrained,
            banned_token_ids=(sp.image_pad_id, sp.video_pad_id),
        )

    reqs = [dict(prompt_ids=prompt, params=params(s, True)) for s in range(6)]
    reqs += [dict(prompt_ids=prompt, params=params(s, False)) for s in range(2)]
    reqs += [dict(prompt_ids=prompt, params=params(0, True, temperature=0.0))]
    outs = engine.generate_batch(reqs)
    free = [fmt.parse(sp.decode(o.tokens[:-1]), SPACE3) for o in outs[6:8]]
    assert all(isinstance(a[0], InvalidAction) for a in free)
    stopped = [o for o in outs[:6] + outs[8:] if o.finish_reason == "stop"]
    # a random policy may ramble in a `type` text past the token cap: still a prefix
    assert all(v3.walk(o.tokens) >= 0 for o in outs[:6] + outs[8:])
    assert len(stopped) >= 4, [o.finish_reason for o in outs]
    for o in stopped:
        assert o.tokens[-1] in sp.stop_ids and v3.accepts(o.tokens[:-1])
        acts = fmt.parse(sp.decode(o.tokens[:-1]), SPACE3)
        assert len(acts) == 1 and not isinstance(acts[0], InvalidAction), acts
    # teacher-forced: the unmasked log-probs of the greedy reply, and its masked argmax
    import jax
    import jax.numpy as jnp

    g = outs[8]
    seq = np.asarray(prompt + g.tokens, np.int32)
    logits = np.array(model(jnp.asarray(seq[None])), np.float32)[0]
    logits[:, [sp.image_pad_id, sp.video_pad_id]] = -np.inf
    steps = logits[len(prompt) - 1 : len(seq) - 1]
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(steps), axis=-1))
    np.testing.assert_allclose(
        g.model_logprobs, logp[np.arange(len(g.tokens)), g.tokens], atol=2e-4
    )
    state = v3.initial
    for i, t in enumerate(g.tokens):
        allowed = v3.allowed(state)
        assert t == int(np.argmax(np.where(allowed, steps[i], -np.inf)))
        state = v3.step(state, t)
