"""From episodes to packed batches on the host (`BatchPacker`): GRPO advantages and samples
(`prepare_batch`), then rows of one of the run's shapes (`pack`): the shape set's smallest
shape that holds them, a token budget's chunks (`cua_jax.rl.batching`), or rounded buckets.
Multi-host: each process packs its own samples into its share of one agreed shape, its loss
weights scaled to its share of the job (`multihost.allgather_ints` agrees the numbers).

No device arrays here: `cua_jax.rl.layout` puts a packed batch on the mesh.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from cua_jax import multihost
from cua_jax.rl import batching
from cua_jax.rl import shapes as shapes_lib
from cua_jax.rl.advantages import group_advantages
from cua_jax.rl.layout import BatchLayout, gather_images, shape_bucket
from cua_jax.rl.packing import PackedBatch, pack, pick_bucket
from cua_jax.rl.trajectory import (
    MIN_LIVE_EPISODES,
    Sample,
    Trajectory,
    live_episodes,
    rope_position_fn,
    trajectory_to_samples,
)


class BatchPacker:
    """Packs a learner's batches: `config` the model's, `loss_config` / `advantage_config` the
    learner's (aggregation mode and normalisation; GRPO advantages), rows in multiples of the
    `layout`'s row multiple and of the shape set it holds."""

    def __init__(
        self,
        config: Any,
        layout: BatchLayout,
        loss_config: Any,
        advantage_config: Any,
        seq_len_buckets: Sequence[int],
    ) -> None:
        self.config = config
        self.layout = layout
        self.loss_config = loss_config
        self.advantage_config = advantage_config
        self.seq_len_buckets = tuple(seq_len_buckets)

    @property
    def shapes(self) -> shapes_lib.ShapeSet | None:
        """The run's shape set (the layout's)."""
        return self.layout.shapes

    def pack(
        self, samples, num_rows: int | None = None, *, mode: Literal["rl", "sft", "teacher"] = "sft"
    ) -> PackedBatch:
        """`packing.pack` with this learner's buckets, row multiple and aggregation mode; without
        `num_rows`, the row count is rounded up to a shape bucket (see `bucket_shapes`).

        With a shape set (`self.shapes`) and no `num_rows`, the batch takes the smallest shape of
        `mode` that holds it (its images padded to the shape's patch budget in the step); a
        batch no shape holds is an error with `shapes.strict`, else it is packed into buckets as
        without a shape set (a new compile, logged and counted by `cua_jax.job.compile_stats`).

        With a token-budget shape set (`shapes.budgeted`, `rl.tokens_per_chip`) the batch is as
        many chunks of one shape as the samples need (`_pack_chunks`); `train_step` runs one
        gradient call a chunk and one update.

        Multi-host (more than one process): `samples` are this process's, and the batch is its
        share of the global one (`pack_share`, `pack_chunks_share`); every process must call
        `pack` together."""
        budgeted = self.shapes is not None and num_rows is None and self.shapes.budgeted
        if self.layout.processes > 1 and not budgeted:
            return self.pack_share(samples, num_rows, mode)
        kw = dict(
            seq_len_buckets=self.seq_len_buckets,
            row_multiple=self.layout.row_multiple,
            agg_mode=self.loss_config.agg_mode,
            loss_norm=self.loss_config.loss_norm,
            pad_id=int(self.config.text.pad_token_id or 0),
        )
        if budgeted:
            return self.pack_chunks(samples, mode, kw)
        if self.shapes is not None and num_rows is None:
            shape = self.shapes.pick(mode, samples)
            if shape is not None:
                kw["seq_len_buckets"] = (shape.length,)
                batch = pack(samples, num_rows=shape.rows, **kw)
                batch.patch_budget = shape.patches
                return self.layout.balance_screens(batch)
            message = self.shapes.miss_message(mode, samples)
            if self.shapes.strict:
                raise shapes_lib.ShapeError(message + " (rl.strict_shapes)")
            logging.warning("%s: packed into buckets instead, a new compile", message)
        batch = pack(samples, num_rows=num_rows, **kw)
        if num_rows is None and self.layout.bucket_shapes:
            rows, k = batch.shape[0], self.layout.row_multiple
            target = shape_bucket(-(-rows // k)) * k
            if target != rows:
                batch = pack(samples, num_rows=target, **kw)
        return batch

    def pack_chunks(self, samples, mode: str, kw: dict) -> PackedBatch:
        """A token-budget batch (`shapes.budgeted`): the samples first-fit into as many chunks
        of the chosen shape's rows as they need, then the rows placed in the chunks' (micro-
        batch, device) groups so no group holds more screens than the shape's
        `group_screens` (one chunk more while they do not fit)."""
        n = self.layout.processes
        if n > 1:
            return self.pack_chunks_share(samples, mode, kw)
        shape, k = self.shapes.chunks_for(mode, samples)
        return self.chunks_of(samples, shape, k, kw, self.layout.batch_parallel)

    def chunks_of(self, samples, shape, k: int, kw: dict, devices: int) -> PackedBatch:
        """`batching.pack_chunks` of `samples` into at least `k` chunks of `shape` (this
        process's share of it: its rows over its `devices`); an empty share is all padding."""
        if not samples:  # a process with nothing to train on this step packs padding rows
            # (blank_batch packs a process's share of a global shape's rows)
            rows = shape.rows * k * self.layout.processes
            blank = self.blank_batch(dataclasses.replace(shape, rows=rows))
            blank.chunks = k
            return blank
        chunk_kw = dict(
            image_token_id=self.config.image_token_id,
            merge=self.config.vision.spatial_merge_size,
            substeps=self.layout.num_substeps,
            devices=devices,
            screen_patches=int(np.prod(self.shapes.grid)) if self.shapes.grid else 1,
            **kw,
        )
        # screens of several sizes: one size a chunk (one process; multi-host shares take the
        # flat layout for them)
        buckets = batching.screen_buckets(samples, self.shapes.grid)
        try:
            if len(buckets) > 1 and self.layout.processes == 1:
                return batching.pack_chunks_by_screen(
                    buckets, shape, units=self.loss_units, **chunk_kw
                )
            return batching.pack_chunks(samples, shape, k, **chunk_kw)
        except batching.ChunkError as e:
            raise shapes_lib.ShapeError(str(e)) from None

    def pack_chunks_share(self, samples, mode: str, kw: dict) -> PackedBatch:
        """This process's share of a token-budget batch (multi-host): every process packs its
        own samples into the same shape and chunk count (the shape whose largest per-process
        need is cheapest; chunks added while any process's screens need them), each chunk's
        rows on its own devices (its block of the batch axes), its loss weights scaled to its
        share of the job's units; its screens stay its own (`_grouped_images`)."""
        n = self.layout.processes
        shapes = self.shapes.of(mode)
        for i, smp in enumerate(samples):
            self.shapes.check_sample(smp, i)
        lengths = [smp.length for smp in samples]
        need = []
        for sh in shapes:  # chunks of this process's rows each shape needs (-1: too short)
            if lengths and max(lengths) > sh.length:
                need.append(-1)
            else:
                rows = shapes_lib.first_fit_rows(lengths, sh.length) if lengths else 0
                need.append(max(1, -(-rows // (sh.rows // n))))
        agreed = multihost.allgather_ints(need)
        best = None
        for i, sh in enumerate(shapes):
            if (agreed[:, i] < 0).any():
                continue
            k = int(agreed[:, i].max())
            cost = (k * sh.rows * sh.length, sh.length)
            if best is None or cost < best[0]:
                best = (cost, i, k)
        if best is None:
            raise shapes_lib.ShapeError(f"no {mode} shape holds every process's longest sample")
        _, i, k = best
        share = dataclasses.replace(
            shapes[i], rows=shapes[i].rows // n, patches=shapes[i].patches // n
        )
        devices = self.layout.batch_parallel // n
        grids = self.agreed_grids(samples)
        if len(grids) > 1:  # screens of several sizes: one size a chunk, on every process
            batch = self.share_by_screen(samples, grids, share, kw, devices)
            batch.patch_budget = shapes[i].patches
            return batch
        error = None
        try:
            batch = self.chunks_of(samples, share, k, kw, devices)
        except shapes_lib.ShapeError as e:  # every process raises, none is left waiting
            error, batch = e, None
        chunks = multihost.allgather_ints([-1 if batch is None else batch.chunks])[:, 0]
        if (chunks < 0).any():
            bad = int(np.argmax(chunks < 0))
            raise error or shapes_lib.ShapeError(f"process {bad}'s {mode} samples fit no chunk")
        if chunks.max() > batch.chunks:  # another process's screens needed more chunks
            batch = self.chunks_of(samples, share, int(chunks.max()), kw, devices)
        units = multihost.allgather_ints([self.loss_units(samples)])[:, 0]
        self.scale_to_share(batch, units)
        batch.patch_budget = shapes[i].patches
        return batch

    def agreed_grids(self, samples) -> list[tuple[int, int, int] | None]:
        """The screen sizes of every process's samples (multi-host), the run's first, then in
        sorted order, the same list on every process; a sample whose own screens are of
        several sizes on any process is a ShapeError on all of them."""
        mine = [g for g, _ in batching.screen_buckets(samples, self.shapes.grid)]
        count = int(multihost.allgather_ints([len(mine)]).max())
        flat = [v for g in mine for v in (g or (0, 0, 0))] + [-1] * 3 * (count - len(mine))
        every = multihost.allgather_ints(flat).reshape(-1, 3)
        found = {tuple(int(v) for v in g) for g in every if g[0] >= 0}
        if (0, 0, 0) in found:
            raise shapes_lib.ShapeError(
                "a sample's own screens are of several sizes: a multi-host token-budget batch "
                "takes screens of one size a sample"
            )
        main = tuple(self.shapes.grid) if self.shapes.grid is not None else None
        return sorted(found, key=lambda g: (g != main, g))

    def share_by_screen(self, samples, grids, share, kw: dict, devices: int) -> PackedBatch:
        """This process's share of a batch of screens of several sizes (multi-host): for each
        of the agreed `grids`, its samples of that size in as many chunks of `share` as the
        neediest process's take (blank chunks where it has none), so chunk c is of one size
        on every process; loss weights scaled to each part's share of the job's units."""
        by = {g: smp for g, smp in batching.screen_buckets(samples, self.shapes.grid)}
        buckets = [(g, by.get(g, [])) for g in grids]
        need = [batching.chunks_for(smp, share) for _, smp in buckets]
        ks = multihost.allgather_ints(need).max(axis=0)
        total = float(multihost.allgather_ints([self.loss_units(samples)]).sum())

        def pack_all(ks):
            out, error = [], None
            for (_, smp), k in zip(buckets, ks, strict=True):
                try:
                    out.append(self.chunks_of(smp, share, max(int(k), 1), kw, devices))
                except shapes_lib.ShapeError as e:  # every process raises, none is left waiting
                    error = e
                    out.append(None)
            got = [-1 if p is None else p.chunks for p in out]
            return out, error, multihost.allgather_ints(got)

        parts, error, got = pack_all(np.maximum(ks, 1))
        if (got < 0).any():
            raise error or shapes_lib.ShapeError("another process's screens fit no chunk")
        if (got.max(axis=0) > got[multihost.process_index()]).any():  # another needed more
            parts, error, got = pack_all(got.max(axis=0))
        return batching.join_screen_parts(parts, buckets, self.loss_units, total, share)

    def agreed_shape(self, samples, mode: str) -> shapes_lib.Shape | None:
        """The shape-set shape every process packs its share into (multi-host): the largest of
        the processes' smallest shapes whose 1/n share holds their samples. None (a logged
        recompile, or ShapeError with `shapes.strict`) when some share fits none; a sample no
        shape can ever hold is a ShapeError on every process (none is left waiting)."""
        n = self.layout.processes
        error = None
        try:
            mine = self.shapes.pick_index(mode, samples, parts=n)
        except shapes_lib.ShapeError as e:
            mine, error = -2, e
        picks = multihost.allgather_ints([mine])[:, 0]
        if (picks == -2).any():
            bad = int(np.argmax(picks == -2))
            raise error or shapes_lib.ShapeError(f"process {bad} holds a sample no shape fits")
        if (picks < 0).any():
            message = (
                f"process {int(np.argmax(picks < 0))}'s share of a {mode} batch fits none of "
                f"the run's {mode} shapes {', '.join(map(str, self.shapes.of(mode)))} split "
                f"over {n} processes; raise rl.learner_rows / rl.images_per_row"
            )
            if self.shapes.strict:
                raise shapes_lib.ShapeError(message + " (rl.strict_shapes)")
            logging.warning("%s: packed into buckets instead, a new compile", message)
            return None
        return self.shapes.by_size(mode)[int(picks.max())]

    def pack_share(self, samples, num_rows: int | None, mode: str = "sft") -> PackedBatch:
        """This process's rows of the global batch (multi-host): every process packs its own
        samples into rows of one agreed length and count (with a shape set, its 1/n share of
        the agreed shape, `_agreed_shape`; else the longest sample's bucket and the largest row
        count), its loss weights scaled so the global batch's add up as one batch's would, and
        the images of every process gathered (the vision tower runs on all of them,
        replicated, in process order: the order of the rows)."""
        n = self.layout.processes
        shape = None
        if self.shapes is not None and num_rows is None:
            shape = self.agreed_shape(samples, mode)
        lc = self.loss_config
        pad_id = int(self.config.text.pad_token_id or 0)
        longest = max((s.length for s in samples), default=0)
        agreed = multihost.allgather_ints([longest, self.loss_units(samples)])
        if shape is not None:
            seq_len = shape.length
        else:
            seq_len = pick_bucket(int(agreed[:, 0].max()), self.seq_len_buckets)
        multiple = self.layout.row_multiple // math.gcd(self.layout.row_multiple, n)
        kw = dict(
            seq_len_buckets=(seq_len,),
            row_multiple=multiple,
            agg_mode=lc.agg_mode,
            loss_norm=lc.loss_norm,
            pad_id=pad_id,
        )
        local = pack(samples, **kw) if samples else None
        rows = int(multihost.allgather_ints([multiple if local is None else local.shape[0]]).max())
        if shape is not None:
            rows = shape.rows // n
        elif num_rows is not None:
            if num_rows % n:
                raise ValueError(f"num_rows={num_rows} is not a multiple of {n} processes")
            rows = num_rows // n
        elif self.layout.bucket_shapes:
            rows = shape_bucket(-(-rows // multiple)) * multiple
        if local is None:
            batch = PackedBatch(
                input_ids=np.full((rows, seq_len), pad_id, np.int32),
                segment_ids=np.zeros((rows, seq_len), np.int32),
                position_ids=np.zeros((3, rows, seq_len), np.int32),
                loss_mask=np.zeros((rows, seq_len), bool),
                behaviour_logprobs=np.zeros((rows, seq_len), np.float32),
                advantages=np.zeros((rows, seq_len), np.float32),
                loss_weights=np.zeros((rows, seq_len), np.float32),
            )
        elif local.shape[0] != rows:
            batch = pack(samples, num_rows=rows, **kw)
        else:
            batch = local
        self.scale_to_share(batch, agreed[:, 1])
        mine = 0 if batch.pixel_values is None else int(batch.pixel_values.shape[0])
        before = multihost.allgather_ints([mine])[: multihost.process_index(), 0]
        batch.patch_offset = int(before.sum())
        batch.pixel_values, batch.image_grid_thw = gather_images(
            batch.pixel_values, batch.image_grid_thw
        )
        if shape is not None:
            batch.patch_budget = shape.patches
        return batch

    def loss_units(self, samples) -> int:
        """This process's units of the loss aggregation (multi-host shares): its trained tokens
        (token-mean), else its episodes with a trained token."""
        if self.loss_config.agg_mode == "token-mean":
            return sum(int(np.sum(s.loss_mask)) for s in samples)
        return len(
            {
                s.episode if s.episode >= 0 else -1 - i
                for i, s in enumerate(samples)
                if s.loss_mask.any()
            }
        )

    def scale_to_share(self, batch: PackedBatch, units: np.ndarray) -> None:
        """Scales this process's loss weights so every process's share (`units`: each one's
        `_loss_units`) sums as its part of the whole batch."""
        if units.sum() > 0:
            batch.scale_loss_weights(float(units[multihost.process_index()]) / float(units.sum()))

    def blank_batch(self, shape: shapes_lib.Shape) -> PackedBatch:
        """An all-padding batch of `shape` (rows x length + patch budget), packed as real ones
        are (multi-host: this process's 1/n share of the rows): what the warm-up compiles a
        program of that shape from."""
        blank = Sample(
            input_ids=np.zeros(1, np.int32),
            loss_mask=np.zeros(1, bool),
            behaviour_logprobs=np.zeros(1, np.float32),
            position_ids=np.zeros((3, 1), np.int32),
            advantage=0.0,
        )
        batch = pack(
            [blank],
            seq_len_buckets=(shape.length,),
            row_multiple=1,
            num_rows=shape.rows // self.layout.processes,  # multi-host: this process's share
            agg_mode=self.loss_config.agg_mode,
            loss_norm=self.loss_config.loss_norm,
            pad_id=int(self.config.text.pad_token_id or 0),
        )
        batch.patch_budget, batch.group_screens = shape.patches, shape.group_screens
        return batch

    def prepare_batch(
        self, groups: Sequence[Sequence[Trajectory]], num_rows: int | None = None
    ) -> tuple[PackedBatch | None, dict[str, float]]:
        """GRPO advantages per group, zero-variance filtering, samples, packing.

        Episodes ended by an infrastructure fault (`Trajectory.infra_fault`: env, sampler or
        checker errors) are left out: they neither get samples nor enter their group's reward
        statistics, and a group left with fewer than two episodes is dropped.

        Returns (batch or None when every group was filtered, info dict for logging).
        """
        sizes = {len(g) for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"groups must all have the same size, got sizes {sorted(sizes)}")
        rewards = np.array([[t.reward for t in g] for g in groups], np.float32)
        ac = self.advantage_config
        pos_fn = rope_position_fn(self.config)
        samples = []
        filtered = too_few = 0
        for g in groups:
            live = live_episodes(g)
            if len(live) < MIN_LIVE_EPISODES:
                too_few += 1
                continue
            (a_g,), (k,) = group_advantages(
                np.array([[t.reward for t in live]], np.float32),
                normalize_std=ac.normalize_std,
                leave_one_out=ac.leave_one_out,
                eps=ac.eps,
                zero_variance=ac.zero_variance,
            )
            filtered += not k
            if k:
                for traj, a in zip(live, a_g, strict=True):
                    samples += trajectory_to_samples(traj, float(a), pos_fn)
        info = {
            "reward_mean": float(rewards.mean()),
            "success_rate": float(np.mean([t.success for g in groups for t in g])),
            "groups": float(len(groups)),
            "groups_filtered_zero_variance": float(filtered),
            "episodes_infra_fault": float(sum(t.infra_fault for g in groups for t in g)),
            "groups_dropped_infra_fault": float(too_few),
            "samples": float(len(samples)),
        }
        if self.layout.processes > 1:  # every process packs (with empty rows) if any has samples
            if not multihost.allgather_ints([len(samples)]).sum():
                return None, info
        elif not samples:
            return None, info
        batch = self.pack(samples, num_rows, mode="rl")
        info["padding_share"] = batch.padding_share
        info["chunks"] = float(batch.chunks)
        info["rows"], info["row_len"] = map(float, batch.shape)
        return batch, info
