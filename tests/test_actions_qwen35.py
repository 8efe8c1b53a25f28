"""Qwen3.5's tool-call format ("qwen35"): XML calls as its chat template writes them, read back
by our parser and by transformers' own response parser for the family; its grammar; its chat
rendering's thinking-off assistant header."""

import pytest

from cua_jax.actions import get_format
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
from cua_jax.data.chat import QWEN35_ASSISTANT_HEADER as HEADER
from cua_jax.data.chat import ChatRenderer
from cua_jax.data.tokenizer import load_default_tokenizer
from cua_jax.sampler.grammar import action_automaton

SPACE = CoordinateSpace.relative(1280, 720)
ACTIONS = [
    Click(640, 360),
    Click(0, 0, "right"),
    Click(1279, 719, "left", 2),
    Click(10, 20, "left", 3),
    Move(100, 200),
    Drag(300, 400),
    Drag(300, 400, 10, 20),
    TypeText('say "hi" {ok}, then\nüñí 中文'),
    Key(("ctrl", "c")),
    Key(('"',)),
    Scroll(None, None, 0.0, -300.0),
    Scroll(50, 60, 120.0, 0.0),
    Wait(2.5),
    Wait(1),
    Done(),
    Fail(),
    Answer("42"),
    RunShell("ls -la ~"),
]
FMT = get_format("qwen35")


def test_every_action_round_trips_and_prose_before_the_call_is_allowed():
    for a in ACTIONS:
        text = FMT.format(a, SPACE)
        assert text.startswith("<tool_call>\n<function=") and text.endswith("</tool_call>")
        got = FMT.parse("The button is at the top. I will act.\n\n" + text, SPACE)
        assert got == FMT.parse(text, SPACE) and len(got) == 1, (a, got)
        assert FMT.format(got[0], SPACE) == text
    both = FMT.parse(FMT.format(Scroll(10, 10, 5.0, -3.0), SPACE), SPACE)
    assert [(s.dx, s.dy) for s in both] == [(0.0, -3.0), (5.0, 0.0)]


def test_what_the_template_writes_and_near_misses():
    text = FMT.format(Click(640, 360), SPACE)
    assert text == (
        "<tool_call>\n<function=computer_use>\n<parameter=action>\nleft_click\n</parameter>\n"
        "<parameter=coordinate>\n[500, 500]\n</parameter>\n</function>\n</tool_call>"
    )
    # a missing </parameter> before the next one, and no closing tags at the end, still parse
    loose = (
        "<tool_call><function=computer_use><parameter=action>left_click"
        "<parameter=coordinate>[500, 500]"
    )
    assert FMT.parse(loose, SPACE) == [Click(640, 360)]
    for bad, why in [
        ('{"name": "computer_use", "arguments": {"action": "left_click"}}', "no <tool_call>"),
        (text.replace("left_click", "left_clik"), "unknown action"),
        (text.replace("[500, 500]", "[500, 1500]"), "coordinate"),
        (text.replace("computer_use", "browser"), "unknown tool"),
    ]:
        (act,) = FMT.parse(bad, SPACE)
        assert isinstance(act, InvalidAction) and why in act.reason, (bad, act)


def test_transformers_response_parser_reads_our_calls():
    """transformers' response template for model types qwen3_5 / qwen3_5_moe (the reference
    reader of the family's output) gives each call's `arguments` exactly."""
    pytest.importorskip("transformers")
    from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS

    from tests.data.hf_local import build_hf_tokenizer

    template = next(v for k, v in _RESPONSE_TEMPLATE_FALLBACKS.items() if "qwen3_5" in k)
    hf = build_hf_tokenizer()
    tools = [FMT.tool_schema(SPACE)]
    for a in ACTIONS:
        if isinstance(a, TypeText | RunShell):
            continue  # the reference strips a value's edge whitespace
        if isinstance(a, Drag) and a.start_x is not None:
            continue  # start_coordinate is ours, not in the tool's schema (the reference: text)
        ids = hf.encode(FMT.format(a, SPACE) + "<|im_end|>", add_special_tokens=False)
        got = hf.parse_response(ids, template, prefix="<|im_start|>" + HEADER, tools=tools)
        (call,) = got["tool_calls"]
        assert call["function"] == {"name": "computer_use", "arguments": FMT.arguments(a, SPACE)}


def test_the_grammar_accepts_every_call_and_no_near_miss():
    sp = load_default_tokenizer()
    g = action_automaton(sp, FMT, ("run_shell",))
    for a in ACTIONS:
        if isinstance(a, TypeText):  # a '<' or an edge newline is outside the grammar's text
            a = TypeText("say hi, then go")
        text = FMT.format(a, SPACE)
        assert g.accepts(sp.encode(text)), text
    good = FMT.format(Click(640, 360), SPACE)
    for bad in (good.replace("left_click", "left_clik"), good[:-5], good + "\n" + good):
        assert not g.accepts(sp.encode(bad))


def test_chat_rendering_opens_every_assistant_turn_with_the_empty_thinking_block():
    sp = load_default_tokenizer()
    chat = ChatRenderer(sp, style="qwen3_5")
    call = {"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [5, 7]}}
    msgs = [
        {"role": "system", "content": FMT.system_prompt(SPACE)},
        {"role": "user", "content": "Click OK."},
        {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
        {"role": "user", "content": "Again."},
    ]
    whole = chat.render(msgs, add_generation_prompt=True)
    assert whole.text.endswith("<|im_start|>" + HEADER)
    # the rendered tool call is the format's own, and it is what is trained
    xml = FMT.format_call("computer_use", call["arguments"])
    assert f"<|im_start|>{HEADER}{xml}<|im_end|>" in whole.text
    trained = sp.decode(whole.input_ids[whole.loss_mask])
    assert trained == xml + "<|im_end|>"
    # append-only: rendering turn by turn gives the same ids
    first = chat.render(msgs[:2], add_generation_prompt=True)
    step = chat.extend(first, msgs[2:], add_generation_prompt=True)
    assert (step.input_ids == whole.input_ids).all()
