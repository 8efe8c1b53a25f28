"""Grounding shards through grain: record round trip, deterministic order, exact resume, two
processes without overlap; the renderer's targets lie inside the named element; a demo is the
agent's own first-turn prompt plus a click that lands in the target."""

from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image, ImageDraw

from cua_jax import actions as A
from cua_jax.data.processor import QwenVLProcessor
from cua_jax.demos.grounding import (
    COLORS,
    HELDOUT_SEED,
    KINDS,
    LABELS,
    TABS,
    _font,
    render_sample,
)
from cua_jax.demos.pipeline import batch_iterator, sft_dataset
from cua_jax.demos.shards import (
    GroundingDemos,
    GroundingShards,
    decode,
    encode,
    grounding_accuracy,
    grounding_dataset,
    write_shards,
)
from cua_jax.rl.rollout import AgentLoop, RolloutSettings, _TurnRecord, render_transcript

N = 40


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ground") / "train")
    write_shards((render_sample(i) for i in range(N)), out, per_shard=16)  # 3 shard files
    return out


def _seeds(it, n):
    return [next(it).seed for _ in range(n)]


def test_round_trip_and_index(shard_dir):
    s = render_sample(7)
    r = decode(encode(s))
    np.testing.assert_array_equal(r.screen, s.screen)
    assert (r.instruction, r.box, r.kind, r.seed) == (s.instruction, s.box, s.kind, s.seed)
    shards = GroundingShards(shard_dir)
    assert len(shards) == N and [shards[i].seed for i in (0, 15, 16, 39)] == [0, 15, 16, 39]
    with pytest.raises(FileNotFoundError, match="make_grounding_data"):
        GroundingShards(shard_dir + "/nope")
    with pytest.raises(ValueError, match="magic"):
        decode(b"PNG?" + b"\0" * 8)


def test_deterministic_resumable_and_sharded(shard_dir):
    src = GroundingShards(shard_dir)
    one = lambda **kw: grounding_dataset(src, shard_index=0, shard_count=1, **kw)  # noqa: E731
    a = _seeds(iter(one(seed=3, num_epochs=None)), 2 * N)
    assert a == _seeds(iter(one(seed=3, num_epochs=None)), 2 * N)  # same seed, same order
    assert a != _seeds(iter(one(seed=4, num_epochs=None)), 2 * N)
    assert sorted(a[:N]) == list(range(N)) == sorted(a[N:])  # each epoch is a permutation
    assert a[:N] != a[N:]  # reshuffled per epoch

    # resume: stop after 13 (mid-epoch), restore the state into a fresh iterator
    it = iter(one(seed=3, num_epochs=None))
    _seeds(it, 13)
    state = it.get_state()
    expect = _seeds(it, N)  # crosses the epoch boundary
    fresh = iter(one(seed=3, num_epochs=None))
    fresh.set_state(state)
    assert _seeds(fresh, N) == expect == a[13 : 13 + N]

    # two processes: disjoint shares that together are the whole set, each resumable alone
    shares = [
        _seeds(iter(grounding_dataset(src, seed=3, shard_index=p, shard_count=2)), N // 2)
        for p in range(2)
    ]
    assert not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == list(range(N))
    it1 = iter(grounding_dataset(src, seed=3, shard_index=1, shard_count=2))
    _seeds(it1, 5)
    st = it1.get_state()
    again = iter(grounding_dataset(src, seed=3, shard_index=1, shard_count=2))
    again.set_state(st)
    assert _seeds(again, N // 2 - 5) == shares[1][5:]
    with pytest.raises(ValueError, match="shard_index"):
        grounding_dataset(src, shard_index=2, shard_count=2)


def _label_of(instruction):
    return instruction.split('"')[1]


@pytest.mark.parametrize("kind", KINDS)
def test_target_lies_in_the_named_element(kind):
    """Independent of the renderer's bookkeeping: the named color is the pixel under the
    target; the named label's glyphs are already drawn there (drawing them again at the box
    centre changes almost nothing, while another label's would)."""
    for seed in range(25):
        s = render_sample(seed + (HELDOUT_SEED if seed % 2 else 0), kind=kind)
        x, y = (int(v) for v in s.target)
        assert s.contains(*s.target)
        if kind == "color":
            name = s.instruction.split()[2]
            want = np.array([int(COLORS[name][i : i + 2], 16) for i in (1, 3, 5)])
            np.testing.assert_array_equal(s.screen[y, x], want)
            continue
        label, size = _label_of(s.instruction), 16 if kind == "tab" else 18
        other = next(w for w in (TABS if kind == "tab" else LABELS) if w != label)
        assert _redraw_changes(s, label, size) <= 3, (seed, s.instruction)
        assert _redraw_changes(s, other, size) > 20, (seed, s.instruction, other)


def _redraw_changes(s, text, size):
    """Pixels that change when `text` is drawn again, dark, at the target box's centre."""
    redrawn = Image.fromarray(s.screen.copy())
    ImageDraw.Draw(redrawn).text(s.target, text, fill="#111111", font=_font(size), anchor="mm")
    return int((np.abs(np.asarray(redrawn, int) - s.screen).max(-1) > 60).sum())


@pytest.fixture(scope="module")
def agent():
    proc = QwenVLProcessor.default("qwen3_vl", max_pixels=384 * 288, min_pixels=32 * 32)
    return AgentLoop(None, proc, RolloutSettings(system_prompt="compact"))


def test_demo_is_the_agents_first_turn_and_clicks_the_target(shard_dir, agent):
    demos = GroundingDemos(GroundingShards(shard_dir), agent)
    for i in (0, 5, 21):
        s, d = GroundingShards(shard_dir)[i], demos[i]
        (turn,) = d.turns
        images = agent.processor.preprocess_images([s.screen])
        space = agent.space_for(s.screen)
        rec = _TurnRecord("", images["pixel_values"], images["image_grid_thw"])
        rendered, pv, grid = render_transcript(
            agent.chat, s.instruction, agent.system_prompt(space), [rec], 1
        )
        np.testing.assert_array_equal(turn.prompt_ids, rendered.input_ids)
        np.testing.assert_array_equal(turn.pixel_values, pv)
        assert turn.generated_ids[-1] == agent.tokenizer.im_end_id
        (act,) = agent.fmt.parse(agent.tokenizer.decode(list(turn.generated_ids)), space)
        assert isinstance(act, A.Click) and s.contains(act.x, act.y), (act, s.box)


def test_sft_batches_from_shards_resume_through_the_bounded_read_ahead(shard_dir, agent):
    """The trainer's path: GroundingDemos -> sft_dataset -> batch_iterator (2 threads, 2 ahead);
    its state, taken mid-stream, resumes the same batches in a fresh iterator."""
    demos = GroundingDemos(GroundingShards(shard_dir), agent)
    ds = sft_dataset(
        demos,
        lambda ss: [s.task_id for s in ss],
        batch_size=3,
        position_fn=lambda ids, grid: np.zeros((3, len(ids)), np.int32),  # not under test here
        seed=5,
        num_epochs=None,
        shard_index=0,
        shard_count=1,
    )
    it = batch_iterator(ds)
    first = [next(it) for _ in range(4)]
    state = it.get_state()
    rest = [next(it) for _ in range(15)]  # 57 samples: into the second epoch of 40
    fresh = batch_iterator(ds)
    fresh.set_state(state)
    assert [next(fresh) for _ in range(15)] == rest
    seen = [t for b in first + rest for t in b]
    assert len(set(seen[:39])) == 39  # no repeats within an epoch (13 whole batches)
    assert all(t.startswith("grounding-") for t in seen)


class _ScriptedEngine:
    """Answers each request with the click the test chose for its screen (by prompt order)."""

    def __init__(self, agent, samples, where):
        self.agent, self.samples, self.where = agent, samples, where
        self.requests = []

    def generate_batch(self, reqs):
        self.requests += reqs
        outs = []
        assert len(reqs) == len(self.samples)
        for s, kind in zip(self.samples, self.where, strict=True):
            space = self.agent.space_for(s.screen)
            if kind == "bad":
                text = "click somewhere nice"
            else:
                x0, y0, x1, y1 = s.box
                x, y = s.target if kind == "hit" else (x1 + 3 if x1 + 3 < 384 else x0 - 3, y0)
                text = self.agent.fmt.format(A.Click(x, y), space)
            outs.append(SimpleNamespace(tokens=self.agent.tokenizer.encode(text)))
        return outs


def test_grounding_accuracy_scores_clicks_in_the_box(agent):
    samples = [render_sample(HELDOUT_SEED + i, kind=KINDS[i % 4]) for i in range(8)]
    where = ["hit", "hit", "miss", "bad", "hit", "miss", "hit", "hit"]
    eng = _ScriptedEngine(agent, samples, where)
    m = grounding_accuracy(eng, agent, samples)
    assert m["grounding/accuracy"] == 5 / 8 and m["grounding/invalid"] == 1 / 8
    assert m["grounding/label"] == 1.0 and m["grounding/color"] == 0.5  # seeds 1, 5: hit, miss
    assert all(r["params"].temperature == 0.0 for r in eng.requests)  # greedy
