"""Grain pipelines for supervised fine-tuning (behaviour cloning) on the learner's data layout.

Sources:
  * trajectory directories written by `TrajectoryStore(persist_dir=...)` (the agent's own
    successful episodes by default), read through `cua_jax.rl.store.TrajectoryReader`;
  * JSONL demonstrations, one episode per line, in the same token-level layout:
        {"task_id": "...", "turns": [{"prompt_ids": [...], "generated_ids": [...],
                                      "extends_previous": false}, ...]}
    (token ids exactly as the model should see them; rendering chat text to ids is the job of
    `cua_jax.data.chat`).

  * grounding shard directories (`cua_jax.demos.shards.GroundingDemos`): synthetic screens
    stored as uint8 PNG with an instruction and a target box, rendered into the agent's
    one-turn click episode as they are read.

Each episode becomes training samples with `trajectory_to_samples` (loss on every generated
token, observations masked), and `batch_size` episodes are packed into one `PackedBatch` that
`Learner.sft_step` consumes. Hosts read disjoint shards: episode indices are split by
`jax.process_index()` after the (seeded, identical on every host) shuffle.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import grain
import jax
import numpy as np

from cua_jax.rl.packing import PackedBatch
from cua_jax.rl.store import TrajectoryReader
from cua_jax.rl.trajectory import PositionFn, Sample, Trajectory, Turn, text_position_ids
from cua_jax.rl.trajectory import trajectory_to_samples as _to_samples


def _screens(rows: Any) -> np.ndarray | None:
    """A JSONL turn's screens in their own form: integer rows are screens as bytes (uint8, as
    `data.image.patch_bytes` makes them), real ones pixel_values (f32); the learner refuses the
    form its model does not take, with a line naming both."""
    if rows is None:
        return None
    a = np.asarray(rows)
    if a.dtype.kind in "iu":
        if a.size and (a.min() < 0 or a.max() > 255):
            raise ValueError(f"integer screen rows must be bytes 0..255; got {a.min()}..{a.max()}")
        return a.astype(np.uint8)
    return a.astype(np.float32)


class JsonlDemonstrations:
    """Random-access demonstrations from a JSONL file (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lines: list[dict[str, Any]] = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n} is not valid JSON: {e}") from e
                if not rec.get("turns"):
                    raise ValueError(
                        f"{path}:{n} has no 'turns'; each line needs turns=[{{'prompt_ids': [...], "
                        "'generated_ids': [...]}]"
                    )
                self._lines.append(rec)

    def __len__(self) -> int:
        return len(self._lines)

    def __getitem__(self, i: int) -> Trajectory:
        rec = self._lines[i]
        turns = []
        for t in rec["turns"]:
            gen = np.asarray(t["generated_ids"], np.int32)
            turns.append(
                Turn(
                    prompt_ids=t["prompt_ids"],
                    generated_ids=gen,
                    logprobs=np.zeros(gen.size, np.float32),  # unused by the SFT loss
                    pixel_values=_screens(t.get("pixel_values")),
                    image_grid_thw=t.get("image_grid_thw"),
                    extends_previous=bool(t.get("extends_previous", False)),
                )
            )
        return Trajectory(
            task_id=str(rec.get("task_id", i)),
            group_id=str(rec.get("group_id", i)),
            turns=turns,
            reward=float(rec.get("reward", 1.0)),
            success=bool(rec.get("success", True)),
        )


def sft_dataset(
    source: Sequence[Trajectory],
    pack_fn: Callable[[list[Sample]], PackedBatch],
    *,
    batch_size: int,
    position_fn: PositionFn = text_position_ids,
    successful_only: bool = True,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = 1,
    shard_index: int | None = None,
    shard_count: int | None = None,
) -> grain.MapDataset:
    """A grain MapDataset of packed SFT batches (``batch_size`` episodes each).

    ``pack_fn`` is usually ``learner.pack`` (its length buckets and row multiple);
    ``position_fn`` is ``learner.position_fn()`` when episodes carry images. Shards default to
    (jax.process_index(), jax.process_count()). ``num_epochs=None`` repeats forever.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(source, TrajectoryReader) and successful_only:
        # The index holds the outcome, so unsuccessful episodes are skipped without reading them.
        indices = [i for i in range(len(source)) if source.metadata(i)["success"]]
    elif not successful_only or getattr(source, "all_successful", False):
        # nothing to filter (e.g. `cua_jax.demos.shards.GroundingDemos`): nothing is read here,
        # so a source of any size streams from disk one batch at a time
        indices = list(range(len(source)))
    else:
        indices = [i for i in range(len(source)) if source[i].success]
    if not indices:
        raise ValueError("the SFT source has no (successful) episodes")
    shard_index = jax.process_index() if shard_index is None else shard_index
    shard_count = jax.process_count() if shard_count is None else shard_count
    ds = grain.MapDataset.source(indices)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds[shard_index::shard_count]
    ds = ds.repeat(num_epochs)

    def to_samples(i: int) -> list[Sample]:
        return _to_samples(source[i], advantage=1.0, position_fn=position_fn)

    def batch_fn(items: Sequence[list[Sample]]) -> PackedBatch:
        return pack_fn([s for samples in items for s in samples])

    return ds.map(to_samples).batch(batch_size, drop_remainder=True, batch_fn=batch_fn)


def batch_iterator(
    ds: grain.MapDataset, *, threads: int = 2, prefetch: int = 2
) -> grain.DatasetIterator:
    """`ds`'s iterator with a bounded read-ahead (`prefetch` batches, read by `threads`
    threads); `get_state` / `set_state` resume it exactly. Plain `iter(ds)` takes grain's
    defaults, 16 threads and 500 elements ahead: 500 packed batches of f32 screens, about 40 MB
    each for 16 smoke screens, which is how an SFT from disk reached 12-18 GB of RSS."""
    options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch)
    return iter(ds.to_iter_dataset(options))
