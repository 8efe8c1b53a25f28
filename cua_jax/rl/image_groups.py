"""Screens laid out by micro-batch and device: the learner's image input on a mesh.

The vision tower reads all images of a batch as one flat sequence of patches (`qwen_vl.vision`).
Given to the train step as it is, that sequence is replicated on every chip: for a real preset's
largest RL shape (960 turn-rows with three screens each) that is tens of GiB of pixels a chip,
and the tower's activations over all of them, before the first decoder layer.

This module cuts the flat sequence into one group per (micro-batch, batch-parallel device): the
screens of the rows that micro-batch `j` keeps on device `d` (`BatchLayout.device_batch` puts row
`r` on device `r // (R / B)` and in micro-batch `r % S`, see `learner.split_micro`). Each group
is padded with blank screens to one patch budget, so every group has the same layout: one
`VisionMeta`, shared. The pixels become f[S, B, P_g, C], sharded over the batch axes on `B`;
`embed_groups` runs the tower and the image scatter under `vmap` over the groups, so each
device encodes only its own rows' screens, and the train step does it one micro-batch at a
time inside its scan (the tower's activations are one micro-batch's).

`balance_rows` permutes a packed batch's rows so its screens spread over the groups, at most one
row's screens apart; a group's budget (`group_budget`) is the shape's screens over S x B plus
the screens one row of the shape can hold, so every batch the shape accepts fits. A token-budget
chunk of screens of another size than the set's (the packer buckets sizes, one a chunk:
`cua_jax.rl.batching.pack_chunks_by_screen`) is grouped the same way at its own size. A batch
whose groups still overflow (rows not balanced by `Learner.pack`), or whose screens are not of
one size, takes the flat replicated layout instead (`group_pixels` returns None;
`BatchLayout.device_batch` logs it: a new compile).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import struct

from cua_jax.rl.batching import permute_rows, row_groups
from cua_jax.rl.micro import split_micro, unsplit_micro
from cua_jax.rl.packing import PackedBatch


@struct.dataclass
class ImageGroups:
    """Grouped screens: f[S, B, P_g, C] (or f[B, P_g, C], one micro-batch's) and the layout of
    one group, the same for all (`VisionMeta`)."""

    pixel_values: jax.Array
    meta: Any


def screens_per_row(batch: PackedBatch, image_token_id: int, tokens_per_screen: int) -> np.ndarray:
    """i64[R]: screens each row holds (its image-pad tokens / a screen's merged tokens)."""
    n = np.sum(batch.input_ids == image_token_id, axis=1)
    if np.any(n % tokens_per_screen):
        raise ValueError(
            f"a row holds {int(n[np.argmax(n % tokens_per_screen)])} image tokens, not a multiple "
            f"of one screen's {tokens_per_screen}"
        )
    return n // tokens_per_screen


def uniform_screens(batch: PackedBatch, grid: tuple[int, int, int] | None) -> bool:
    """Whether every image of `batch` is one screen of `grid` (what grouping needs)."""
    if grid is None or batch.image_grid_thw is None or not len(batch.image_grid_thw):
        return False
    return bool(np.all(np.asarray(batch.image_grid_thw) == np.asarray(grid)[None]))


def group_budget(screens: int, groups: int, row_screens: int) -> int:
    """Screens a group holds so that any batch of at most `screens` screens, no row holding
    more than `row_screens`, fits after `balance_rows`: its round-robin leaves groups at most
    one row's screens apart, so the fullest holds at most screens // groups + row_screens."""
    return min(screens, screens // groups + row_screens)


def balance_rows(batch: PackedBatch, groups_R: np.ndarray, screens_R: np.ndarray) -> PackedBatch:
    """`batch` with its rows permuted so the groups' screen counts are at most one row's screens
    apart: rows by screens, most first, dealt round-robin to groups 0, 1, ..., G-1, 0, ...
    (group g's load then never falls below group g+1's, and group 0 leads the last by at most
    the first row's screens; the per-device unions of `row_groups(R, 1, B)` too). Pixels move
    with their rows. Rows are independent (their own segments; loss weights are per token), so
    the loss and its gradient are those of the unpermuted batch."""
    G = int(groups_R.max()) + 1
    slots = [list(np.flatnonzero(groups_R == g)) for g in range(G)]
    perm = np.empty(len(groups_R), np.int64)
    order = sorted(range(len(screens_R)), key=lambda i: (-int(screens_R[i]), i))
    for k, r in enumerate(order):
        perm[slots[k % G].pop(0)] = r
    unit = (
        0
        if batch.pixel_values is None
        else batch.pixel_values.shape[0] // max(int(screens_R.sum()), 1)
    )
    return permute_rows(batch, perm, np.asarray(screens_R) * unit)


def group_pixels(
    pixel_values: np.ndarray,
    screens_R: np.ndarray,
    groups_R: np.ndarray,
    substeps: int,
    devices: int,
    per_group: int,
    unit: int,
) -> np.ndarray | None:
    """f[S, B, per_group x unit, C]: each group's screens in row order, then blank screens; None
    when a group has more than `per_group` screens."""
    G = substeps * devices
    load = np.bincount(groups_R, weights=screens_R, minlength=G)
    if load.max() > per_group:
        return None
    C = pixel_values.shape[1]
    out = np.zeros((G, per_group * unit, C), pixel_values.dtype)
    start = np.concatenate([[0], np.cumsum(screens_R)]) * unit
    fill = np.zeros(G, np.int64)
    for r in range(len(screens_R)):  # rows in order: a group's rows keep their order
        n = int(screens_R[r]) * unit
        if n:
            g = int(groups_R[r])
            out[g, fill[g] : fill[g] + n] = pixel_values[start[r] : start[r + 1]]
            fill[g] += n
    return out.reshape(substeps, devices, per_group * unit, C)


def embed_groups(model: Any, ids_RL: jax.Array, images: ImageGroups):
    """`model.embed` of rows [R, L] with grouped screens: (embeddings, deepstack) and the
    visual mask, as the flat layout gives them. Pixels [S, B, P_g, C] cover all R rows (S
    micro-batches, rows strided as `split_micro`); [B, P_g, C] cover one micro-batch's rows."""

    pv, meta = images.pixel_values, images.meta

    def one(ids, p):
        return model.embed(ids, p, vision_meta=meta)

    if pv.ndim == 4:
        S, B = pv.shape[:2]
        ids = split_micro(ids_RL, S)
        ids = ids.reshape(S, B, ids.shape[1] // B, ids.shape[-1])
        emb, vmask, ds = jax.vmap(jax.vmap(one))(ids, pv)

        def back(x):
            return None if x is None else unsplit_micro(x.reshape(S, -1, *x.shape[3:]))

    else:
        B = pv.shape[0]
        ids = ids_RL.reshape(B, ids_RL.shape[0] // B, ids_RL.shape[-1])
        emb, vmask, ds = jax.vmap(one)(ids, pv)

        def back(x):
            return None if x is None else x.reshape(-1, *x.shape[2:])

    ds = None if ds is None else [back(d) for d in ds]
    return (back(emb), ds), back(vmask)


__all__ = [
    "ImageGroups",
    "balance_rows",
    "embed_groups",
    "group_budget",
    "group_pixels",
    "row_groups",
    "screens_per_row",
    "uniform_screens",
]
