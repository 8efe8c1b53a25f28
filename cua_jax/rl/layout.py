"""Where a packed batch goes on the learner's mesh (`BatchLayout`): its token rows over the
batch axes (the mesh axes the rules' logical "batch" names: data x fsdp by default, data x fsdp
x expert when a MoE preset splits its rows over the expert devices too), a micro-batch's rows
kept on their device; its screens either grouped by (micro-batch, device) and sharded
(`cua_jax.rl.image_groups`: a shape-set batch whose screens are of one size, the set's or, for a
token-budget chunk of screens of another size, the chunk's own: `BatchLayout.batch_grid`) or the
flat layout, replicated (a sample whose own screens are of several sizes; multi-host batches
that are not token-budget chunks, or whose screens are of several sizes). Multi-host: each
process gives its own rows and screen groups (`jax.make_array_from_process_local_data`).

The learner (`cua_jax.rl.learner`) and the programs that read its batches (SDPO's teacher pass,
Entropulse, `tools/plan.py`) share one layout: `learner.layout`.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cua_jax import multihost
from cua_jax import sharding as shd
from cua_jax.models.qwen_vl.text import jdtype
from cua_jax.models.qwen_vl.vision import vision_metadata
from cua_jax.rl import distill, image_groups
from cua_jax.rl import shapes as shapes_lib
from cua_jax.rl.image_groups import ImageGroups
from cua_jax.rl.packing import PackedBatch

# The token-aligned arrays of a step's batch, rows sharded over the batch axes
TEXT_KEYS = (
    "input_ids",
    "segment_ids",
    "loss_mask",
    "behaviour_logprobs",
    "advantages",
    "loss_weights",
)


class BatchLayout:
    """The device layout of a learner's batches on `mesh`.

    config: the model's `QwenVLConfig` (screen sizes, the image token, MoE routes).
    rules: the logical-axis rules; the rows shard over the mesh axes of their "batch" entry.
    shapes: the run's shape set (`cua_jax.rl.shapes`), set by the trainer's warm-up; None:
    rounded buckets, flat screens. group_images: False forces the flat, replicated screen
    layout (tests compare the two). bucket_shapes: flat screens are padded to a power-of-two
    patch count (`pad_images_to_bucket`), so few compiled shapes serve many batches.
    """

    def __init__(
        self,
        config: Any,
        mesh: Mesh,
        num_substeps: int,
        *,
        bucket_shapes: bool = True,
        rules: shd.Rules = shd.DEFAULT_RULES,
    ) -> None:
        self.config = config
        self.mesh = mesh
        self.num_substeps = num_substeps
        self.bucket_shapes = bucket_shapes
        self.shapes: shapes_lib.ShapeSet | None = None
        self.group_images = True
        self.repl = NamedSharding(mesh, P())
        named = tuple(a for a in shd.batch_axes(rules) if a in mesh.axis_names)
        batch_axes = tuple(a for a in named if mesh.shape[a] > 1) or None
        self.batch_parallel = int(np.prod([mesh.shape[a] for a in named]))
        # Multi-host: each process packs its own rows (`BatchPacker.pack`), and they become its
        # devices' blocks of the global batch, so every process must own whole row blocks.
        self.processes = jax.process_count()
        problem = process_rows_problem(mesh, rules, self.processes)
        if problem:
            raise ValueError(problem)
        # Rows shard over the batch axes. Micro-batch s holds rows i * S + s, so splitting
        # [R] -> [mb, S] -> [S, mb] keeps each device's rows on that device.
        self.row_sh = NamedSharding(mesh, P(batch_axes, None))
        self.pos_sh = NamedSharding(mesh, P(None, batch_axes, None))
        self.route_sh = NamedSharding(mesh, P(batch_axes, None, None, None))
        t = config.text
        self.moe = t.is_moe
        self.route_shape = (
            (sum(t.is_sparse_layer(i) for i in range(t.num_hidden_layers)), t.num_experts_per_tok)
            if self.moe
            else None
        )

    @property
    def row_multiple(self) -> int:
        """Packed row counts must be multiples of this (num_substeps x the batch axes)."""
        return self.num_substeps * self.batch_parallel

    def device_batch(self, batch: PackedBatch, substeps: int, extra=None):
        rows, length = batch.shape
        shares = self.processes  # multi-host: `batch` is this process's rows (`_pack_share`)
        if rows * shares % (substeps * self.batch_parallel):
            raise ValueError(
                f"batch has {rows * shares} rows, not a multiple of num_substeps x batch axes = "
                f"{substeps * self.batch_parallel}; pack with row_multiple=learner.row_multiple"
            )
        arrs = batch.arrays()
        if shares == 1:
            xs = {k: jax.device_put(arrs[k], self.row_sh) for k in TEXT_KEYS}
            xs["position_ids"] = jax.device_put(batch.position_ids, self.pos_sh)
        else:
            xs = {
                k: jax.make_array_from_process_local_data(
                    self.row_sh, arrs[k], (rows * shares, length)
                )
                for k in TEXT_KEYS
            }
            xs["position_ids"] = jax.make_array_from_process_local_data(
                self.pos_sh, batch.position_ids, (3, rows * shares, length)
            )
        if self.moe:  # every MoE batch has routes (-1: unrecorded), so one compiled step
            routes = batch.routes
            want = (rows, length, *self.route_shape)
            if routes is None:
                routes = np.full(want, -1, np.int32)
            elif routes.shape != want:
                raise ValueError(
                    f"batch routes have shape {routes.shape} but this model needs {want} "
                    "(rows, row length, sparse layers, experts per token)"
                )
            if shares == 1:
                xs["routes"] = jax.device_put(routes, self.route_sh)
            else:
                xs["routes"] = jax.make_array_from_process_local_data(
                    self.route_sh, routes, (rows * shares, *want[1:])
                )
        for k, v in (extra or {}).items():  # SDPO targets: [R, L, ...] like the rows
            sh = self.rows_sharding(v.ndim)
            if shares == 1:
                xs[k] = jax.device_put(v, sh)
            else:
                xs[k] = jax.make_array_from_process_local_data(sh, v, (rows * shares, *v.shape[1:]))
        images = self.grouped_images(batch, substeps)
        if images is not None:
            return xs, images
        if batch.patch_budget:  # the shape set's fixed patch budget, padded with blank screens
            v = self.config.vision
            pv, grid = shapes_lib.pad_images(
                batch.pixel_values,
                batch.image_grid_thw,
                batch.patch_budget,
                self.shapes.grid,
                v.spatial_merge_size,
                self.config.pixel_width,
                self.pixel_dtype(),
            )
            self.check_screens(pv)
            meta = vision_metadata(self.config, grid)
            images = jax.device_put((jnp.asarray(pv), meta), self.repl)
        elif batch.pixel_values is not None:
            pv, grid = batch.pixel_values, batch.image_grid_thw
            self.check_screens(pv)
            if self.bucket_shapes:
                pv, grid = pad_images_to_bucket(pv, grid, self.config.vision.spatial_merge_size)
            meta = vision_metadata(self.config, grid)
            images = jax.device_put((jnp.asarray(pv), meta), self.repl)
        return xs, images

    def balance_screens(self, batch: PackedBatch) -> PackedBatch:
        """A shape-set batch with its rows permuted so its screens spread evenly over the
        (micro-batch, device) groups of the step (`image_groups.balance_rows`)."""
        groups = self.num_substeps * self.batch_parallel
        if batch.pixel_values is None or not self.groupable(batch) or batch.shape[0] % groups:
            return batch
        groups_R = image_groups.row_groups(batch.shape[0], self.num_substeps, self.batch_parallel)
        return image_groups.balance_rows(batch, groups_R, self.screens_per_row(batch))

    def screen_tokens(self, grid=None) -> int:
        """Merged tokens of one screen of `grid` (default: the shape set's)."""
        grid = grid or self.shapes.grid
        return int(np.prod(grid)) // self.config.vision.spatial_merge_size**2

    def screens_per_row(self, batch: PackedBatch) -> np.ndarray:
        """Screens each row of `batch` holds (0 without images), of its size (`batch_grid`)."""
        if batch.pixel_values is None:
            return np.zeros(batch.shape[0], np.int64)
        tokens = self.screen_tokens(self.batch_grid(batch))
        return image_groups.screens_per_row(batch, self.config.image_token_id, tokens)

    def batch_grid(self, batch: PackedBatch) -> tuple[int, int, int] | None:
        """The screen grid `batch`'s groups are laid out in: a chunk's own size when the
        packer bucketed screens of several sizes, else the shape set's."""
        if batch.chunk_grids and batch.chunks == 1:
            return batch.chunk_grids[0]  # None: a chunk of samples whose screens are mixed
        return self.shapes.grid if self.shapes is not None else None

    def groupable(self, batch: PackedBatch) -> bool:
        """Whether `batch`'s screens can be grouped by micro-batch and device (`image_groups`):
        one process, a shape-set batch, and every image one screen of the shape set's size."""
        if not batch.patch_budget or self.shapes is None:
            return False
        if self.processes > 1 and not batch.group_screens:  # multi-host: token-budget batches
            return False
        grid = self.batch_grid(batch)
        if grid is None or not self.group_images:
            return False
        return batch.pixel_values is None or image_groups.uniform_screens(batch, grid)

    def screen_layout(
        self, length: int, budget: int, substeps: int, grid=None, per_group: int = 0
    ) -> tuple[int, int, Any]:
        """(screens a group holds, patches of a screen, the host `VisionMeta` of one group) of
        a shape-set shape of rows of `length` tokens and a patch `budget` of `grid` screens
        (default: the shape set's), split into `substeps` x batch-parallel groups; a
        token-budget shape's `per_group` (its `group_screens`) when given."""
        grid = grid or self.shapes.grid
        unit = int(np.prod(grid))
        per_row = length // self.screen_tokens(grid)
        groups = substeps * self.batch_parallel
        if not per_group:
            per_group = image_groups.group_budget(budget // unit, groups, per_row)
        meta = vision_metadata(self.config, np.tile(np.asarray(grid, np.int32), (per_group, 1)))
        return per_group, unit, meta

    def pixel_dtype(self) -> Any:
        """Screens as bytes travel as bytes (the model lifts them); float screens travel in the
        model's compute dtype (its patch embedding casts to it first)."""
        if self.config.pixel_dtype == "uint8":
            return jnp.dtype(jnp.uint8)
        return jnp.dtype(jdtype(self.config.dtype))

    def check_screens(self, pixel_values: np.ndarray) -> None:
        """Raises naming the mismatch when a batch's screens are not in the form the programs
        were built for (`config.pixel_dtype`): bytes taken for floats would train on garbage."""
        want = self.config.pixel_dtype
        got = "uint8" if pixel_values.dtype == np.uint8 else "float32"
        if got != want or pixel_values.shape[-1] != self.config.pixel_width:
            raise ValueError(
                f"the batch's screens are {pixel_values.dtype}[..., {pixel_values.shape[-1]}] but "
                f"the learner takes {want} rows of {self.config.pixel_width} "
                "(model.pixel_dtype); trajectories or demonstrations stored in the other form "
                "cannot join this run"
            )

    def pixel_sharding(self, ndim: int) -> NamedSharding:
        """Grouped screens [S, B, P_g, C] ([B, P_g, C]): the groups' B axis over the batch axes."""
        lead = (None,) * (ndim - 3)
        return NamedSharding(self.mesh, P(*lead, self.row_sh.spec[0], None, None))

    def grouped_images(self, batch: PackedBatch, substeps: int) -> ImageGroups | None:
        """`batch`'s screens as `ImageGroups` on the mesh, or None (the flat layout) when they
        cannot be grouped or a group has more screens than its budget (logged)."""
        if not self.groupable(batch):
            return None
        # a token-budget chunk's groups hold group_screens each at the step's micro-batching;
        # fewer micro-batches (a log-prob pass: one) merge num_substeps / substeps of them
        grid = self.batch_grid(batch)
        # a chunk of another screen size than the shape set's: its group holds the patches of
        # group_screens of the set's screens, as that many of its own as they make
        own = batch.group_screens * int(np.prod(self.shapes.grid)) // int(np.prod(grid))
        per_group = own * self.num_substeps // substeps
        per_group, unit, meta = self.screen_layout(
            batch.shape[1], batch.patch_budget, substeps, grid=grid, per_group=per_group
        )
        n = self.processes  # multi-host: this process's rows, on its block of the devices
        devices = self.batch_parallel // n
        groups_R = image_groups.row_groups(batch.shape[0], substeps, devices)
        flat = batch.pixel_values
        if flat is None:
            flat = np.zeros((0, self.config.pixel_width), self.pixel_dtype())
        self.check_screens(flat)
        pv = image_groups.group_pixels(
            flat,
            self.screens_per_row(batch),
            groups_R,
            substeps,
            devices,
            per_group,
            unit,
        )
        if pv is None:
            logging.warning(
                "a batch's screens do not fit %d per (micro-batch, device) group (%d groups): "
                "replicated flat layout instead, a new compile",
                per_group,
                substeps * self.batch_parallel,
            )
            return None
        pv = pv.astype(self.pixel_dtype())
        if n == 1:
            pv = jax.device_put(pv, self.pixel_sharding(4))
        else:  # each process gives its own devices' groups
            glob = (pv.shape[0], self.batch_parallel, *pv.shape[2:])
            pv = jax.make_array_from_process_local_data(self.pixel_sharding(4), pv, glob)
        return ImageGroups(pv, jax.device_put(jax.tree.map(jnp.asarray, meta), self.repl))

    def images_sharding(self, grouped: bool) -> Any:
        """A step's image input sharding: grouped screens (`ImageGroups`) sharded over the batch
        axes, or the flat layout replicated."""
        if grouped:
            return ImageGroups(self.pixel_sharding(4), self.repl)
        return self.repl

    def xs_shardings(self, mode: str) -> dict[str, NamedSharding]:
        """The shardings of a step's token-aligned inputs (`_device_batch`'s xs) in `mode`."""
        xs_sh = {k: self.row_sh for k in TEXT_KEYS}
        xs_sh["position_ids"] = self.pos_sh
        if distill.parse_mode(mode) is not None:
            for k in distill.TARGET_KEYS:
                xs_sh[k] = self.rows_sharding(3 if k in distill.TOPK_KEYS else 2)
        if self.moe:
            xs_sh["routes"] = self.route_sh
        return xs_sh

    def rows_sharding(self, ndim: int) -> NamedSharding:
        """Arrays with a leading row axis shard their rows like the batch's."""
        return NamedSharding(self.mesh, P(*self.row_sh.spec[:1], *([None] * (ndim - 1))))


def process_rows_problem(mesh: Mesh, rules: shd.Rules, processes: int) -> str | None:
    """Why `processes` processes cannot each give their own rows of a batch on `mesh` (the batch
    axes the rules name do not split into one block a process), or None."""
    named = tuple(a for a in shd.batch_axes(rules) if a in mesh.axis_names)
    batch_parallel = int(np.prod([mesh.shape[a] for a in named]))
    if batch_parallel % processes == 0:
        return None
    return (
        f"mesh {' x '.join(named) or 'batch axes'} = {batch_parallel} must be a multiple of the "
        f"{processes} processes (each process contributes its own batch rows); shard the batch "
        "over more devices (mesh.fsdp or mesh.data)"
    )


def gather_images(
    pixel_values: np.ndarray | None, grid: np.ndarray | None
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Every process's patches and image grids, concatenated in process order (multi-host)."""
    dim = int(
        multihost.allgather_ints([0 if pixel_values is None else pixel_values.shape[1]]).max()
    )
    if dim == 0:
        return None, None
    # the screens' dtype: uint8 (bytes) when any process has bytes, else float32
    as_bytes = multihost.allgather_ints(
        [int(pixel_values is not None and pixel_values.dtype == np.uint8)]
    ).max()
    dtype = np.uint8 if as_bytes else np.float32
    pv = np.zeros((0, dim), dtype) if pixel_values is None else pixel_values
    g = np.zeros((0, 3), np.int32) if grid is None else np.asarray(grid, np.int32)
    pvs = multihost.allgather_arrays(np.asarray(pv, dtype))
    grids = multihost.allgather_arrays(g)
    return np.concatenate(pvs), np.concatenate(grids)


def pad_images_to_bucket(
    pixel_values: np.ndarray, image_grid_thw: np.ndarray, merge: int
) -> tuple[np.ndarray, np.ndarray]:
    """Pads the flat patches with one blank image so their count is m² x a power of two
    (`shape_bucket`; m = spatial merge).

    The blank image (grid (1, m, k)) attends only to itself in the vision tower, and its merged
    features come after every real one, so no image-pad token takes them: outputs are unchanged.
    """
    P, unit = pixel_values.shape[0], merge * merge
    extra = shape_bucket(-(-P // unit)) * unit - P
    if extra == 0:
        return pixel_values, image_grid_thw
    blank = np.zeros((extra, pixel_values.shape[1]), pixel_values.dtype)
    grid = np.concatenate([np.asarray(image_grid_thw), [[1, merge, extra // merge]]])
    return np.concatenate([pixel_values, blank]), grid.astype(np.asarray(image_grid_thw).dtype)


def shape_bucket(n: int) -> int:
    """The power of two >= n. Every distinct batch shape is a compile (tens of seconds on a
    2-core CPU, minutes for a large model on TPU), so few shapes beat tight padding."""
    return 1 << max(0, int(n) - 1).bit_length()
