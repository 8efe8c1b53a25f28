"""Pack variable-length samples into fixed-length rows (host numpy).

Samples go first-fit-decreasing into rows of one bucket length L (the smallest of a few fixed
lengths that holds the longest sample), tagged with segment ids (1, 2, ... per row; 0 =
padding) so attention stays within a sample, and per-segment M-RoPE positions. The number of
rows is rounded up to ``row_multiple`` x (1, 2, 3, 4, 6, 8, 12, 16, ...) so a run sees only a
handful of shapes (each shape
is one compile of the train step). Images follow their tokens' row-major order, which is the
order the model scatters image features into placeholder tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from cua_jax.rl.losses import AggMode, loss_weights
from cua_jax.rl.trajectory import Sample

DEFAULT_BUCKETS = (256, 512, 1024, 2048, 4096, 8192)


@dataclasses.dataclass
class PackedBatch:
    """A batch of packed rows; every array is token-aligned ([R, L] unless noted)."""

    input_ids: np.ndarray  # i32[R, L]
    segment_ids: np.ndarray  # i32[R, L] 1.. per sample within a row, 0 = padding
    position_ids: np.ndarray  # i32[3, R, L]
    loss_mask: np.ndarray  # bool[R, L] token t is a trained (generated) token
    behaviour_logprobs: np.ndarray  # f32[R, L]
    advantages: np.ndarray  # f32[R, L] the sample's advantage on each of its tokens
    loss_weights: np.ndarray  # f32[R, L] aggregation weights (losses.loss_weights)
    pixel_values: np.ndarray | None = None  # f[N_patches, D]
    image_grid_thw: np.ndarray | None = None  # i32[I, 3]
    num_samples: int = 0
    # MoE: i32[R, L, layers, K] the sampler's experts per token (-1: unrecorded); None: dense
    routes: np.ndarray | None = None
    # > 0: the learner's shape set fixed this batch's shape; its patches are padded to this
    # many in the step (blank screens), so every batch of the shape has one vision input shape
    patch_budget: int = 0
    # Multi-host: `pixel_values` are every process's patches in process order, and this batch's
    # own rows' patches start at this one (0 on one process)
    patch_offset: int = 0
    # A token-budget shape set (`rl.tokens_per_chip`): the rows are this many chunks of the
    # shape's rows, each one call of the gradient program; one optimizer update for all
    # (`Learner._chunked_step`). `patch_budget` and `group_screens` are a chunk's.
    chunks: int = 1
    group_screens: int = 0  # > 0: screens of one (micro-batch, device) group of a chunk
    # Screens of mixed sizes (`cua_jax.rl.batching.pack_chunks_by_screen`): each chunk's one
    # screen grid (t, h, w), None for a chunk whose screens are not of one size; () when every
    # chunk's screens are the shape set's size
    chunk_grids: tuple = ()

    @property
    def shape(self) -> tuple[int, int]:
        return self.input_ids.shape

    def scale_loss_weights(self, share: float) -> None:
        """Scales the loss weights by `share` (f32): a part packed on its own (a process's, a
        screen size's) weighted as its share of the whole batch."""
        self.loss_weights = (self.loss_weights * np.float32(share)).astype(np.float32)

    @property
    def padding_share(self) -> float:
        """Fraction of the R·L token slots that hold no sample token."""
        return float((self.segment_ids == 0).mean())

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays the train step consumes (images only when present)."""
        out = {
            "input_ids": self.input_ids,
            "segment_ids": self.segment_ids,
            "position_ids": self.position_ids,
            "loss_mask": self.loss_mask,
            "behaviour_logprobs": self.behaviour_logprobs,
            "advantages": self.advantages,
            "loss_weights": self.loss_weights,
        }
        if self.pixel_values is not None:
            out["pixel_values"] = self.pixel_values
            out["image_grid_thw"] = self.image_grid_thw
        if self.routes is not None:
            out["routes"] = self.routes
        return out


def row_patches(batch: PackedBatch, image_token_id: int, merge: int) -> np.ndarray:
    """i64[R]: the image patches each row of `batch` holds (its images follow the rows'
    row-major token order, each image's merged tokens t x h x w / merge² of its grid)."""
    R = batch.shape[0]
    out = np.zeros(R, np.int64)
    if batch.pixel_values is None:
        return out
    grid = np.asarray(batch.image_grid_thw, np.int64).reshape(-1, 3)
    sizes = grid.prod(axis=1)
    tokens = sizes // merge**2
    per_row = np.sum(batch.input_ids == image_token_id, axis=1)
    ends = np.cumsum(tokens)
    i = 0
    seen = 0
    for r in range(R):
        seen += int(per_row[r])
        while i < len(ends) and ends[i] <= seen:
            out[r] += sizes[i]
            i += 1
    if i < len(sizes) and ends[-1] <= seen:  # pragma: no cover - every image is consumed above
        raise AssertionError("images left over")
    return out


def split_chunks(batch: PackedBatch, row_patches_R: np.ndarray) -> list[PackedBatch]:
    """`batch`'s `chunks` consecutive row blocks as batches of their own, each with its rows'
    image patches (`row_patches_R`, from `row_patches`); loss weights stay the whole batch's,
    so the chunks' summed gradients are the batch's."""
    k = batch.chunks
    R = batch.shape[0]
    if R % k:
        raise ValueError(f"{R} rows do not split into {k} chunks")
    n = R // k
    start = np.concatenate([[0], np.cumsum(row_patches_R)])
    if batch.image_grid_thw is not None:
        grid = np.asarray(batch.image_grid_thw, np.int64).reshape(-1, 3)
        img_start = np.concatenate([[0], np.cumsum(grid.prod(axis=1))])
    out = []
    for c in range(k):
        rows = slice(c * n, (c + 1) * n)
        pv = grid_c = None
        if batch.pixel_values is not None:
            a, b = int(start[c * n]), int(start[(c + 1) * n])
            if b > a:
                pv = batch.pixel_values[a:b]
                i0, i1 = np.searchsorted(img_start, [a, b])
                grid_c = np.asarray(batch.image_grid_thw)[i0:i1]
        out.append(
            dataclasses.replace(
                batch,
                input_ids=batch.input_ids[rows],
                segment_ids=batch.segment_ids[rows],
                position_ids=batch.position_ids[:, rows],
                loss_mask=batch.loss_mask[rows],
                behaviour_logprobs=batch.behaviour_logprobs[rows],
                advantages=batch.advantages[rows],
                loss_weights=batch.loss_weights[rows],
                pixel_values=pv,
                image_grid_thw=grid_c,
                routes=None if batch.routes is None else batch.routes[rows],
                chunks=1,
                chunk_grids=batch.chunk_grids[c : c + 1],
            )
        )
    return out


def concat_rows(parts: Sequence[PackedBatch]) -> PackedBatch:
    """The batches' rows one after the other (one row length), their images in row order and
    their chunks added up; loss weights as they are (the caller scales them to the whole)."""
    lengths = {p.shape[1] for p in parts}
    if len(lengths) != 1:
        raise ValueError(f"batches of row lengths {sorted(lengths)} cannot be concatenated")

    def cat(name: str, axis: int = 0):
        arrs = [getattr(p, name) for p in parts]
        if all(a is None for a in arrs):
            return None
        return np.concatenate([a for a in arrs if a is not None], axis=axis)

    routes = [p.routes for p in parts]
    if any(r is None for r in routes) and not all(r is None for r in routes):
        raise ValueError("batches with and without routes cannot be concatenated")
    return dataclasses.replace(
        parts[0],
        input_ids=cat("input_ids"),
        segment_ids=cat("segment_ids"),
        position_ids=cat("position_ids", axis=1),
        loss_mask=cat("loss_mask"),
        behaviour_logprobs=cat("behaviour_logprobs"),
        advantages=cat("advantages"),
        loss_weights=cat("loss_weights"),
        pixel_values=cat("pixel_values"),
        image_grid_thw=cat("image_grid_thw"),
        num_samples=sum(p.num_samples for p in parts),
        routes=cat("routes"),
        chunks=sum(p.chunks for p in parts),
        chunk_grids=tuple(g for p in parts for g in (p.chunk_grids or (None,) * p.chunks)),
    )


def pick_bucket(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= length; raises naming the fix when none is long enough."""
    for b in sorted(buckets):
        if b >= length:
            return b
    raise ValueError(
        f"a sample has {length} tokens, longer than the largest length bucket {max(buckets)}; "
        "add a longer bucket (seq_len_buckets) or cut the history window / max_new_tokens"
    )


def _round_rows(n: int, row_multiple: int) -> int:
    """Round up to row_multiple x (1, 2, 3, 4, 6, 8, 12, 16, 24, ...): few shapes, <= 1/3 pad."""
    units = -(-max(n, 1) // row_multiple)
    size = 1
    while size < units:
        size = size * 3 // 2 if size & (size - 1) == 0 and size >= 2 else size * 4 // 3
        size = max(size, 2)
    return row_multiple * size


def route_shape(samples: Sequence[Sample]) -> tuple[int, int] | None:
    """(layers, K) of the samples' recorded MoE routes; None when none has routes."""
    shapes = {tuple(s.routes.shape[1:]) for s in samples if s.routes is not None}
    if len(shapes) > 1:
        raise ValueError(f"the samples' routes have different [layers, K] shapes: {sorted(shapes)}")
    return shapes.pop() if shapes else None


def _episode_key(sample: Sample, index: int) -> int:
    """The loss-aggregation sequence of `sample`: its episode, or itself (a negative key)."""
    return sample.episode if sample.episode >= 0 else -1 - index


def pack(
    samples: Sequence[Sample],
    *,
    seq_len_buckets: Sequence[int] = DEFAULT_BUCKETS,
    row_multiple: int = 1,
    num_rows: int | None = None,
    agg_mode: AggMode = "token-mean",
    loss_norm: float | None = None,
    pad_id: int = 0,
) -> PackedBatch:
    """Pack samples into rows; ``num_rows`` fixes the row count (else rounded as module doc)."""
    if not samples:
        raise ValueError("pack() got no samples")
    seq_len = pick_bucket(max(s.length for s in samples), seq_len_buckets)
    # First-fit decreasing (stable on ties so results are deterministic).
    order = sorted(range(len(samples)), key=lambda i: -samples[i].length)
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = samples[i].length
        for r, f in enumerate(free):
            if f >= n:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(seq_len - n)
    if num_rows is None:
        num_rows = _round_rows(len(rows), row_multiple)
    elif len(rows) > num_rows:
        raise ValueError(
            f"{len(samples)} samples need {len(rows)} rows of {seq_len} tokens but num_rows="
            f"{num_rows}; train on fewer groups per step or allow more rows"
        )
    elif num_rows % row_multiple:
        raise ValueError(f"num_rows={num_rows} must be a multiple of row_multiple={row_multiple}")
    # Keep samples within a row in their original order (stable, easier to inspect).
    rows = [sorted(r) for r in rows]
    ids = np.full((num_rows, seq_len), pad_id, np.int32)
    seg = np.zeros((num_rows, seq_len), np.int32)
    pos = np.zeros((3, num_rows, seq_len), np.int32)
    mask = np.zeros((num_rows, seq_len), bool)
    blp = np.zeros((num_rows, seq_len), np.float32)
    adv = np.zeros((num_rows, seq_len), np.float32)
    episodes = np.zeros((num_rows, seq_len), np.int64)
    rshape = route_shape(samples)
    routes = None if rshape is None else np.full((num_rows, seq_len, *rshape), -1, np.int32)
    pvs, grids = [], []
    for r, members in enumerate(rows):
        o = 0
        for k, i in enumerate(members):
            s = samples[i]
            n = s.length
            ids[r, o : o + n] = s.input_ids
            seg[r, o : o + n] = k + 1
            pos[:, r, o : o + n] = s.position_ids
            mask[r, o : o + n] = s.loss_mask
            blp[r, o : o + n] = s.behaviour_logprobs
            adv[r, o : o + n] = s.advantage
            episodes[r, o : o + n] = _episode_key(s, i)
            if routes is not None and s.routes is not None:
                if s.routes.shape[0] != n:
                    raise ValueError(
                        f"a sample has {n} tokens but routes for {s.routes.shape[0]}; "
                        "Sample.routes is token-aligned i32[T, layers, K]"
                    )
                routes[r, o : o + n] = s.routes
            if s.pixel_values is not None:
                pvs.append(np.asarray(s.pixel_values))
                grids.append(np.asarray(s.image_grid_thw, np.int32))
            o += n
    weights = loss_weights(mask, seg, agg_mode, loss_norm, sequence_ids_BT=episodes)
    return PackedBatch(
        input_ids=ids,
        segment_ids=seg,
        position_ids=pos,
        loss_mask=mask,
        behaviour_logprobs=blp,
        advantages=adv,
        loss_weights=weights,
        pixel_values=np.concatenate(pvs) if pvs else None,
        image_grid_thw=np.concatenate(grids) if grids else None,
        num_samples=len(samples),
        routes=routes,
    )


def unpacked(samples: Sequence[Sample], **kwargs) -> PackedBatch:
    """One sample per row (the reference layout packing is tested against)."""
    seq_len = max(s.length for s in samples)
    kwargs.setdefault("seq_len_buckets", (seq_len,))
    # Each row fits exactly one sample when every bucket row holds only one: force it.
    batches = [pack([s], **{**kwargs, "num_rows": 1}) for s in samples]
    length = max(b.shape[1] for b in batches)

    def cat(name, axis=0):
        arrs = []
        for b in batches:
            a = getattr(b, name)
            pad = [(0, 0)] * a.ndim
            pad[-1] = (0, length - a.shape[-1])
            arrs.append(np.pad(a, pad))
        return np.concatenate(arrs, axis=axis)

    mask = cat("loss_mask")
    seg = cat("segment_ids")
    rshape = route_shape(samples)
    routes = None
    if rshape is not None:
        routes = np.full((len(samples), length, *rshape), -1, np.int32)
        for i, b in enumerate(batches):
            if b.routes is not None:
                routes[i, : b.shape[1]] = b.routes[0]
    pvs = [b.pixel_values for b in batches if b.pixel_values is not None]
    grids = [b.image_grid_thw for b in batches if b.image_grid_thw is not None]
    return PackedBatch(
        input_ids=cat("input_ids"),
        segment_ids=seg,
        position_ids=cat("position_ids", axis=1),
        loss_mask=mask,
        behaviour_logprobs=cat("behaviour_logprobs"),
        advantages=cat("advantages"),
        loss_weights=loss_weights(
            mask,
            seg,
            kwargs.get("agg_mode", "token-mean"),
            kwargs.get("loss_norm"),
            sequence_ids_BT=np.broadcast_to(
                np.asarray([_episode_key(s, i) for i, s in enumerate(samples)])[:, None],
                mask.shape,
            ),
        ),
        pixel_values=np.concatenate(pvs) if pvs else None,
        image_grid_thw=np.concatenate(grids) if grids else None,
        num_samples=len(samples),
        routes=routes,
    )
