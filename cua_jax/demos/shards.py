"""Grounding samples on disk: sharded ArrayRecord files read through grain.

    with ShardWriter(out_dir, per_shard=2000) as w:      # tools/make_grounding_data.py
        for s in samples: w.write(s)                     # a GroundingSample
    shards = GroundingShards(out_dir)                    # grain RandomAccessDataSource
    shards[i]                                            # -> GroundingSample (screen u8)
    ds = grounding_dataset(shards, seed=0)               # grain MapDataset, this process's share
    it = iter(ds); it.get_state() / it.set_state(s)      # resume exactly where it stopped
    demos = GroundingDemos(shards, agent)                # Sequence[Trajectory], rendered lazily

A record holds the screen as PNG (the synthetic screens compress 30-60x, and PNG decode is
about a millisecond) and a JSON header: the instruction, the target box, the kind and the seed.
Nothing is held in RAM beyond the records grain is reading: a demonstration's f32 pixels exist
only while its batch is being packed, so SFT over any number of demonstrations stays within the
memory of one batch (BENCHMARKS.md, "the mid-training ladder").

`GroundingDemos` turns a sample into the one-turn episode the agent would play on that screen
(`AgentLoop`'s system prompt, coordinate space and action format; the oracle's click at the
target's centre) and plugs into `cua_jax.demos.pipeline.sft_dataset` like any trajectory source.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import grain
import imagecodecs
import jax
import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from cua_jax import actions as A
from cua_jax.demos.grounding import GroundingSample
from cua_jax.rl.trajectory import Trajectory, Turn
from cua_jax.sampler.params import SamplingParams

INDEX = "index.json"
_MAGIC = b"CUAG"


def encode(s: GroundingSample) -> bytes:
    """A record: magic, header length, JSON header, PNG screen."""
    head = json.dumps(
        {"instruction": s.instruction, "box": list(s.box), "kind": s.kind, "seed": s.seed}
    ).encode()
    png = imagecodecs.png_encode(np.ascontiguousarray(s.screen, np.uint8), level=1)
    return _MAGIC + struct.pack("<I", len(head)) + head + bytes(png)


def decode(rec: bytes) -> GroundingSample:
    if rec[:4] != _MAGIC:
        raise ValueError("not a grounding record (bad magic); write shards with ShardWriter")
    (n,) = struct.unpack("<I", rec[4:8])
    head = json.loads(rec[8 : 8 + n])
    screen = imagecodecs.png_decode(rec[8 + n :])
    return GroundingSample(
        screen, head["instruction"], tuple(head["box"]), head["kind"], int(head["seed"])
    )


class ShardWriter:
    """Writes samples into OUT_DIR/shard-NNNNN.array_record, `per_shard` records each, and an
    index.json (shard files and counts) on close. Refuses a directory that already has one."""

    def __init__(self, out_dir: str, per_shard: int = 2000) -> None:
        if per_shard < 1:
            raise ValueError(f"per_shard must be >= 1, got {per_shard}")
        if os.path.exists(os.path.join(out_dir, INDEX)):
            raise FileExistsError(f"{out_dir} already holds shards ({INDEX}); pick another dir")
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.per_shard = out_dir, per_shard
        self.shards: list[dict[str, Any]] = []
        self._w: ArrayRecordWriter | None = None

    def write(self, s: GroundingSample) -> None:
        if self._w is None or self.shards[-1]["count"] == self.per_shard:
            self._roll()
        self._w.write(encode(s))
        self.shards[-1]["count"] += 1

    def _roll(self) -> None:
        if self._w is not None:
            self._w.close()
        name = f"shard-{len(self.shards):05d}.array_record"
        # group_size:1: every record is its own chunk, so random access reads one record
        self._w = ArrayRecordWriter(os.path.join(self.out_dir, name), "group_size:1")
        self.shards.append({"file": name, "count": 0})

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None
        with open(os.path.join(self.out_dir, INDEX), "w") as f:
            json.dump({"format": "cua_jax.grounding/1", "shards": self.shards}, f, indent=1)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_shards(samples: Iterable[GroundingSample], out_dir: str, per_shard: int = 2000) -> int:
    """Writes `samples` as shards (see `ShardWriter`); returns how many."""
    n = 0
    with ShardWriter(out_dir, per_shard) as w:
        for s in samples:
            w.write(s)
            n += 1
    return n


def is_shard_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, INDEX))


class GroundingShards(grain.sources.RandomAccessDataSource):
    """Random access to a shard directory's samples (grain's ArrayRecord source underneath)."""

    def __init__(self, path: str) -> None:
        if not is_shard_dir(path):
            raise FileNotFoundError(
                f"{path} is not a grounding shard directory (no {INDEX}); write one with "
                "tools/make_grounding_data.py"
            )
        with open(os.path.join(path, INDEX)) as f:
            index = json.load(f)
        self.path = path
        files = [os.path.join(path, s["file"]) for s in index["shards"] if s["count"]]
        self._source = grain.sources.ArrayRecordDataSource(files)

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, i: int) -> GroundingSample:
        return decode(self._source[i])

    def __repr__(self) -> str:
        return f"GroundingShards({self.path!r}, {len(self)} samples)"


def grounding_dataset(
    source: Any,
    *,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = 1,
    shard_index: int | None = None,
    shard_count: int | None = None,
) -> grain.MapDataset:
    """A grain MapDataset of this process's samples: shuffled with `seed` (the same order on
    every process), then every `shard_count`-th from `shard_index` (default: jax's process
    index and count), repeated `num_epochs` times (None: forever, reshuffled each epoch).
    `iter(ds)` is a grain iterator with `get_state` / `set_state`."""
    shard_index = jax.process_index() if shard_index is None else shard_index
    shard_count = jax.process_count() if shard_count is None else shard_count
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index {shard_index} is not in [0, {shard_count})")
    ds = grain.MapDataset.source(source)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    return ds[shard_index::shard_count].repeat(num_epochs)


class GroundingDemos:
    """A grounding shard directory as one-turn oracle demonstrations (`Sequence[Trajectory]`),
    rendered on access: `agent` (an `AgentLoop`) gives the system prompt, the coordinate space
    of the screen, the action format and the processor, so a demo's tokens are exactly those of
    the agent's first turn on that screen followed by the oracle's click at the target."""

    all_successful = True  # oracle clicks: `sft_dataset` need not read them to filter

    def __init__(self, source: Any, agent: Any) -> None:
        self.source, self.agent = source, agent

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> Trajectory:
        return grounding_demo(self.source[i], self.agent)


def grounding_prompt(s: GroundingSample, agent: Any) -> tuple[Any, dict[str, np.ndarray], Any]:
    """(rendered first-turn prompt, preprocessed images, coordinate space) of `s` for `agent`."""
    images = agent.processor.preprocess_images([s.screen])
    space = agent.space_for(s.screen)
    msgs = [
        {"role": "system", "content": agent.system_prompt(space)},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": s.instruction}]},
    ]
    rendered = agent.chat.render(msgs, images["image_grid_thw"], add_generation_prompt=True)
    return rendered, images, space


def grounding_demo(s: GroundingSample, agent: Any) -> Trajectory:
    """The one-turn oracle episode of `s` (see `GroundingDemos`)."""
    rendered, images, space = grounding_prompt(s, agent)
    text = agent.fmt.format(A.Click(*s.target), space)
    ids = np.asarray([*agent.tokenizer.encode(text), agent.tokenizer.im_end_id], np.int32)
    turn = Turn(
        prompt_ids=rendered.input_ids,
        generated_ids=ids,
        logprobs=np.zeros(ids.size, np.float32),
        pixel_values=images["pixel_values"],
        image_grid_thw=images["image_grid_thw"],
    )
    tid = f"grounding-{s.kind}-{s.seed}"
    return Trajectory(task_id=tid, group_id=tid, turns=[turn], reward=1.0, success=True)


def grounding_accuracy(engine: Any, agent: Any, samples: Sequence[GroundingSample]) -> dict:
    """Greedy first-turn clicks of the policy in `engine` on `samples`: the share that land
    inside the target box (overall and per kind) and the share that are not a valid click.
    The prompts are the agent's (`grounding_prompt`), decoded with its stop and banned ids."""
    st = agent.settings
    params = SamplingParams(
        temperature=0.0,
        max_new_tokens=st.max_new_tokens,
        stop_token_ids=tuple(agent.tokenizer.stop_ids),
        banned_token_ids=tuple(st.banned_token_ids),
    )
    reqs, spaces = [], []
    for s in samples:
        rendered, images, space = grounding_prompt(s, agent)
        reqs.append(
            {
                "prompt_ids": rendered.input_ids,
                "pixel_values": images["pixel_values"],
                "image_grid_thw": images["image_grid_thw"],
                "params": params,
            }
        )
        spaces.append(space)
    outs = engine.generate_batch(reqs)
    hits: dict[str, list[float]] = {}
    invalid = 0
    for s, out, space in zip(samples, outs, spaces, strict=True):
        acts = agent.fmt.parse(agent.tokenizer.decode(list(out.tokens)), space)
        a = acts[0] if acts else None
        ok = isinstance(a, A.Click) and a.x is not None and s.contains(a.x, a.y)
        invalid += not isinstance(a, A.Click)
        hits.setdefault(s.kind, []).append(float(ok))
    n = max(len(samples), 1)
    out = {"grounding/accuracy": sum(sum(v) for v in hits.values()) / n}
    out |= {f"grounding/{k}": float(np.mean(v)) for k, v in sorted(hits.items())}
    out["grounding/invalid"] = invalid / n
    return out


__all__ = [
    "GroundingDemos",
    "GroundingShards",
    "ShardWriter",
    "decode",
    "encode",
    "grounding_accuracy",
    "grounding_dataset",
    "grounding_demo",
    "grounding_prompt",
    "is_shard_dir",
    "write_shards",
]
