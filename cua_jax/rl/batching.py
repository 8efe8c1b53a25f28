"""Host-side batching of a token-budget shape set (`rl.tokens_per_chip`), numpy only (no device
arrays, no program): a batch's samples packed into as many chunks of a shape's rows as they
need, and the rows placed in the chunks' (micro-batch, device) groups so no group holds more
screens than its budget.

    batch = pack_chunks(samples, shape, chunks, image_token_id=..., merge=2, substeps=1,
                        devices=4, screen_patches=unit, **pack_kwargs)

Screens of several sizes in one batch (envs at other resolutions than the run's viewport) are
bucketed, not replicated: `screen_buckets` sorts the samples by their screens' grid and
`pack_chunks_by_screen` packs each size into chunks of its own (`PackedBatch.chunk_grids`), so
every chunk's screens are of one size and its (micro-batch, device) groups are laid out and
sharded as the run's own size's are; a size other than the run's is another compile.

The learner (`Learner.pack`) and the plan (`cua_jax.plan`, padding share of a preset's batch)
both pack this way. A chunk is one call of the learner's gradient program; its rows are laid out
as `row_groups` says (micro-batch j = r % S, device d = r // (R / B)).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np

from cua_jax.rl.packing import PackedBatch, concat_rows, pack, row_patches
from cua_jax.rl.shapes import first_fit_rows
from cua_jax.rl.trajectory import Sample


class ChunkError(ValueError):
    """A packed row holds more screens than any group of its shape can."""


def row_groups(rows: int, substeps: int, devices: int) -> np.ndarray:
    """i32[R]: the group j x B + d of each row (micro-batch j = r % S, device d = r // (R / B))."""
    if rows % (substeps * devices):
        raise ValueError(f"{rows} rows are not a multiple of {substeps} x {devices} groups")
    r = np.arange(rows)
    return (r % substeps) * devices + r // (rows // devices)


def chunk_groups(rows: int, chunks: int, substeps: int, devices: int) -> np.ndarray:
    """i32[R]: the group of each row of a batch of `chunks` consecutive row blocks, each laid out
    as `row_groups`: chunk c's groups are c x S x B + (its `row_groups`)."""
    n = rows // chunks
    one = row_groups(n, substeps, devices)
    return np.concatenate([one + c * substeps * devices for c in range(chunks)])


def fill_groups(groups_R: np.ndarray, load_R: np.ndarray, budget: int) -> np.ndarray | None:
    """A row permutation (position -> source row) that puts every row in a group of
    `groups_R` (each group has as many positions as rows it takes) with no group's load above
    `budget`, or None when this greedy finds none: rows by load, most first, each to the least
    loaded group that still has a free position (longest-processing-time first: within one
    row's load of the best balance)."""
    G = int(groups_R.max()) + 1
    slots = [list(np.flatnonzero(groups_R == g)) for g in range(G)]
    heap = [(0, g) for g in range(G)]
    perm = np.empty(len(groups_R), np.int64)
    order = sorted(range(len(load_R)), key=lambda i: (-int(load_R[i]), i))
    for r in order:
        load, g = heapq.heappop(heap)
        load += int(load_R[r])
        if load > budget:
            return None
        perm[slots[g].pop(0)] = r
        if slots[g]:
            heapq.heappush(heap, (load, g))
    return perm


def permute_rows(batch: PackedBatch, perm: np.ndarray, patches_R: np.ndarray) -> PackedBatch:
    """`batch` with row `perm[i]` at position i, each row's image patches (`patches_R`) and
    grids moving with it. Rows are independent (their own segments; loss weights are per
    token), so the loss and its gradient are those of the unpermuted batch."""
    if np.array_equal(perm, np.arange(len(perm))):
        return batch
    out = dataclasses.replace(
        batch,
        input_ids=batch.input_ids[perm],
        segment_ids=batch.segment_ids[perm],
        position_ids=batch.position_ids[:, perm],
        loss_mask=batch.loss_mask[perm],
        behaviour_logprobs=batch.behaviour_logprobs[perm],
        advantages=batch.advantages[perm],
        loss_weights=batch.loss_weights[perm],
        routes=None if batch.routes is None else batch.routes[perm],
    )
    if batch.pixel_values is not None:
        start = np.concatenate([[0], np.cumsum(patches_R)])
        grid = np.asarray(batch.image_grid_thw, np.int64).reshape(-1, 3)
        img_start = np.concatenate([[0], np.cumsum(grid.prod(axis=1))])
        first = np.searchsorted(img_start, start)  # each row's first image
        out.pixel_values = np.concatenate(
            [batch.pixel_values[start[r] : start[r + 1]] for r in perm]
        )
        out.image_grid_thw = np.concatenate(
            [np.asarray(batch.image_grid_thw)[first[r] : first[r + 1]] for r in perm]
        ).astype(np.asarray(batch.image_grid_thw).dtype)
    return out


def pack_chunks(
    samples: Sequence[Sample],
    shape: Any,
    chunks: int,
    *,
    image_token_id: int,
    merge: int,
    substeps: int,
    devices: int,
    screen_patches: int,
    **pack_kwargs: Any,
) -> PackedBatch:
    """`samples` first-fit into `chunks` (or, while their screens do not fit, more) chunks of
    `shape`'s rows (`shape.rows` rows of `shape.length`, `shape.group_screens` screens of
    `screen_patches` patches a group), rows placed by `fill_groups`; the batch says its
    `chunks`, and its `patch_budget` and `group_screens` are a chunk's."""
    budget = shape.group_screens * screen_patches
    k = chunks
    kw = {**pack_kwargs, "seq_len_buckets": (shape.length,), "row_multiple": 1}
    while True:
        batch = pack(samples, num_rows=k * shape.rows, **kw)
        patches_R = row_patches(batch, image_token_id, merge)
        if patches_R.max(initial=0) > budget:  # no chunk count helps
            raise ChunkError(
                f"a packed row of {shape.length} tokens holds {patches_R.max() // screen_patches} "
                f"screens, more than a group's {shape.group_screens} (the shape {shape}); "
                "raise rl.screens_per_chip"
            )
        groups_R = chunk_groups(batch.shape[0], k, substeps, devices)
        perm = fill_groups(groups_R, patches_R, budget)
        if perm is not None:
            break
        k += 1
    batch = permute_rows(batch, perm, patches_R)
    batch.patch_budget, batch.chunks = shape.patches, k
    batch.group_screens = shape.group_screens
    return batch


def sample_grid(s: Sample) -> tuple[int, int, int] | None | str:
    """The one screen grid of a sample's images, None for a text-only sample, "mixed" when its
    images are of several sizes."""
    if s.image_grid_thw is None or not len(s.image_grid_thw):
        return None
    grids = {tuple(int(v) for v in g) for g in np.asarray(s.image_grid_thw).reshape(-1, 3)}
    return grids.pop() if len(grids) == 1 else "mixed"


def screen_buckets(
    samples: Sequence[Sample], grid: tuple[int, int, int] | None
) -> list[tuple[tuple[int, int, int] | None, list[Sample]]]:
    """`samples` by the size of their screens: (grid, samples) pairs, the run's `grid` first
    (text-only samples join it, or the first bucket), then other sizes by first appearance; a
    sample whose own screens are of several sizes goes to a bucket of grid None (laid out flat).
    One pair when every screen is of one size."""
    by: dict = {}
    text = []
    for s in samples:
        g = sample_grid(s)
        if g is None:
            text.append(s)
        else:
            by.setdefault(None if g == "mixed" else g, []).append(s)
    if len(by) <= 1:
        return [(next(iter(by), grid), list(samples))]
    keys = sorted(by, key=lambda g: g != grid)  # stable: the run's grid first
    by[keys[0]].extend(text)
    return [(g, by[g]) for g in keys]


def pack_chunks_by_screen(
    buckets: Sequence[tuple[tuple[int, int, int] | None, Sequence[Sample]]],
    shape: Any,
    *,
    units: Any,
    **chunk_kwargs: Any,
) -> PackedBatch:
    """A batch of screens of several sizes (`screen_buckets`): each bucket's samples in chunks
    of `shape` of their own (`pack_chunks`, at least as many as their rows need; a group's
    budget is the shape's in patches, so a larger screen fits fewer a group), one after the
    other, each chunk's grid in `chunk_grids`. `units(samples)` is the loss aggregation's count
    of them (`BatchPacker.loss_units`): each bucket's loss weights, normalised over its own
    samples by `pack`, are scaled to its share, so the batch's weights are the whole batch's."""
    parts = [
        pack_chunks(smp, shape, max(1, chunks_for(smp, shape)), **chunk_kwargs)
        for _, smp in buckets
    ]
    total = sum(units(smp) for _, smp in buckets)
    batch = join_screen_parts(parts, buckets, units, total, shape)
    batch.patch_budget = shape.patches
    return batch


def chunks_for(samples: Sequence[Sample], shape: Any) -> int:
    """Chunks of `shape` that `samples`' rows take, first fit (0 for none)."""
    if not samples:
        return 0
    return -(-first_fit_rows([s.length for s in samples], shape.length) // shape.rows)


def join_screen_parts(
    parts: Sequence[PackedBatch],
    buckets: Sequence[tuple[tuple[int, int, int] | None, Sequence[Sample]]],
    units: Any,
    total: float,
    shape: Any,
) -> PackedBatch:
    """One batch from each screen size's part (`parts[i]` packs `buckets[i]`), one after the
    other: each part's loss weights scaled to its samples' share of `total` units (the whole
    batch's, or the whole job's on several processes), each chunk's grid in `chunk_grids`."""
    for part, (grid, smp) in zip(parts, buckets, strict=True):
        if total:
            part.scale_loss_weights(units(smp) / total)
        part.chunk_grids = (grid,) * part.chunks
    batch = concat_rows(parts)
    batch.group_screens = shape.group_screens
    return batch
