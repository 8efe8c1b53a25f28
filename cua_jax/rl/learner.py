"""The sharded GRPO / SFT learner: an NNX model + optax state as pure pytrees, jitted steps.

    learner = Learner(model, mesh=make_mesh(1, 4, 2), optimizer=OptimizerConfig(...),
                      loss=LossConfig(...), num_substeps=2, lora=LoraConfig(rank=8))
    batch, info = learner.prepare_batch(store.get_groups(n))  # advantages, samples, packing
    metrics = learner.train_step(batch)                      # version += 1
    params = learner.params_for_sampler()                    # live arrays, no copy

Four rooms: `cua_jax.rl.packer` (`learner.packer`) turns episodes into packed batches on the
host (advantages, samples, shapes, token-budget chunks, multi-host shares);
`cua_jax.rl.layout` (`learner.layout`) puts a packed batch on the mesh (rows, screens, routes);
`cua_jax.rl.step` holds the losses, gradients and the guarded update as plain functions of a
`StepSpec` (`learner.spec`) and the parameter trees; this module holds the parameters and the
optimizer state, jits those functions with their shardings and runs them. Its settings
(`OptimizerConfig`, `LossConfig`, `AdvantageConfig`, `LoraConfig`) live in
`cua_jax.rl.settings` and are re-exported here.

The train step (one `jax.jit` per mode, compiled once per batch shape; the length buckets of
`packing.pack` bound the shapes) takes the trainable parameters and the optimizer state as
donated arguments with explicit shardings from the params' logical axes (`cua_jax.sharding`).
Gradient accumulation over ``num_substeps`` micro-batches and the two screen layouts (grouped
per micro-batch and device, or flat and replicated) are `cua_jax.rl.step`'s.

Token-budget batches (`rl.tokens_per_chip`, `cua_jax.rl.batching`): a batch is `chunks` blocks
of a shape's rows; each chunk is one call of the gradient program (`grads_program`: its grads
added to a donated accumulator), then one optimizer update (`APPLY_PROGRAM`), so memory is one
chunk's however many samples a step has. Every update (fused or not) is guarded: one that is not
finite or exceeds `OptimizerConfig.max_update_ratio` x the params' norm is not applied.

Reference policy for the KL penalty (only when ``kl_coef > 0``): the policy the learner starts
from, as a frozen copy of the trainable params (with LoRA only the adapters, so the base weights
are shared). A learner built after the SFT warm-up therefore keeps the SFT policy as its
reference; the copy is part of `state_dict`, so a resumed run keeps it.

MoE (Qwen3-VL-MoE; dense models are untouched: no routes array, the same compiled step): the
batch carries the sampler's recorded experts (`PackedBatch.routes`, -1 unrecorded). With
``LossConfig.routing_replay`` every forward of the step (policy, KL reference, `token_logprobs`)
routes each recorded token through those experts (their weights still from the learner's
router, so it keeps its gradient), so the learner scores exactly the computation the sampler
ran. Either way the step reports ``routing_mismatch``: the share of recorded (token, sparse
layer) pairs whose expert set the learner's own router would choose differently. With
``router_aux_coef`` > 0 the loss adds coef x the load-balancing loss
(`qwen_vl.load_balancing_loss`) over each micro-batch's trained tokens, weighted by its share
of the batch's trained tokens (= the whole batch's loss with one micro-batch), logged as
``router_aux_loss``.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cua_jax import multihost
from cua_jax import sharding as shd
from cua_jax.models import lora as lora_lib
from cua_jax.rl import shapes as shapes_lib
from cua_jax.rl import step
from cua_jax.rl.image_groups import ImageGroups
from cua_jax.rl.layout import (  # noqa: F401  (re-exported: the learner's public helpers)
    TEXT_KEYS,
    BatchLayout,
    pad_images_to_bucket,
    shape_bucket,
)
from cua_jax.rl.micro import (  # noqa: F401  (re-exported)
    FINITE_METRICS,
    NonFiniteError,
    check_finite,
    combine_micro_metrics,
    compile_each,
    split_micro,
    split_micro_inputs,
    unsplit_micro,
)
from cua_jax.rl.packer import BatchPacker
from cua_jax.rl.packing import DEFAULT_BUCKETS, PackedBatch, row_patches, split_chunks
from cua_jax.rl.settings import (  # noqa: F401  (re-exported: the learner's settings)
    AdvantageConfig,
    LoraConfig,
    LossConfig,
    OptimizerConfig,
)
from cua_jax.rl.trajectory import PositionFn, Trajectory, rope_position_fn

if TYPE_CHECKING:
    from cua_jax.rl.sdpo import TeacherTargets

# The optimizer update of a token-budget batch, after its chunks' gradient programs
APPLY_PROGRAM = "apply_update"


class Learner:
    """Holds model params + optimizer state on a mesh and runs jitted GRPO / SFT steps.

    donate: the step donates the trainable params' buffers (updated in place, no second copy).
    Turn it off when a sampler may still be reading those arrays while the step runs (async RL
    sharing devices with the engine): the step then writes new buffers and the old ones live
    until the engine takes the new version. The optimizer state is donated either way.
    banned_token_ids: ids the sampler never samples (`SamplingParams.banned_token_ids`); their
    logits are masked in every log-prob and entropy here too, so π is the sampler's policy.
    bucket_shapes: `pack` rounds the row count up to a `shape_bucket` (x the row multiple) and
    the step pads the patches likewise (`pad_images_to_bucket`), so batches with different
    numbers of episodes and screenshots reuse a few compiled steps instead of compiling one per
    row count and patch count.
    logits_chunk: log-probs and entropies are computed this many positions at a time, with the
    chunk's logits rematerialised in the backward pass, so no f32[rows, L, V] array exists (0:
    all positions at once; fine for small vocabularies and rows). See
    `losses.chunked_token_stats`.

    The model: the learner takes ownership of `model` and changes it in place: LoRA adapters
    are added (when `lora` is given and it has none), its parameters are sharded on `mesh`, and
    its config gets the `remat` policy. `learner.model` is that object; a sampler that decodes
    this policy must be built from `learner.model` (`cua_jax.job.builders.build_engine`), and every
    train step writes the new parameters back into it.
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        mesh: Mesh | None = None,
        rules: shd.Rules = shd.DEFAULT_RULES,
        optimizer: OptimizerConfig = OptimizerConfig(),
        loss: LossConfig = LossConfig(),
        advantages: AdvantageConfig = AdvantageConfig(),
        lora: LoraConfig | None = None,
        num_substeps: int = 1,
        freeze_vision: bool = False,
        remat: Literal["none", "full", "dots", "ordered"] | None = None,
        seq_len_buckets: Sequence[int] = DEFAULT_BUCKETS,
        donate: bool = True,
        banned_token_ids: Sequence[int] = (),
        bucket_shapes: bool = True,
        logits_chunk: int = 0,
    ) -> None:
        if num_substeps < 1:
            raise ValueError(f"num_substeps must be >= 1, got {num_substeps}")
        self.mesh = mesh or shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
        self.rules = rules
        self.optimizer_config = optimizer
        self.loss_config = loss
        self.advantage_config = advantages
        self.num_substeps = num_substeps
        self.seq_len_buckets = tuple(seq_len_buckets)
        self.version = 0
        self.model = model
        self.config = model.config
        if remat is not None and remat != model.config.remat:
            # The decoder reads cfg.remat at trace time; both references get the new policy.
            self.config = model.config.replace(remat=remat)
            model.config = self.config
            model.model.language_model.cfg = self.config
        if lora is not None and not lora_lib.has_lora(model):
            lora_lib.apply_lora(
                model, lora.rank, lora.alpha, lora.target_modules, rngs=nnx.Rngs(lora.seed)
            )
        self.use_lora = lora_lib.has_lora(model)
        if self.use_lora:
            trainable_filter: Any = nnx.LoRAParam
        elif freeze_vision:
            trainable_filter = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("visual")))
        else:
            trainable_filter = nnx.Param
        shd.shard_model(model, self.mesh, rules)
        self._graphdef, trainable, frozen, rest = nnx.split(model, trainable_filter, nnx.Param, ...)
        self._trainable_filter = trainable_filter
        self._tx = optimizer.build()
        self._repl = NamedSharding(self.mesh, P())
        self._trainable_sh = shd.param_shardings(trainable, self.mesh, rules)
        self._frozen_sh = shd.param_shardings(frozen, self.mesh, rules)
        self._rest_sh = jax.tree.map(lambda _: self._repl, rest)
        self._trainable = trainable
        self._frozen = frozen
        self._rest = jax.device_put(rest, self._rest_sh)
        opt_state = self._tx.init(trainable)
        self._opt_sh = jax.tree.map(self._leaf_sharding, opt_state)
        self._opt_state = jax.device_put(opt_state, self._opt_sh)
        # With a KL term, the reference policy is the one this learner starts from: a frozen copy
        # of the trainable params (LoRA: only the small adapters; full: all of them). A learner
        # built after an SFT warm-up so keeps the SFT policy as its reference (the base model,
        # "adapters off", would pull RL back to before SFT). `state_dict` saves it, so a resumed
        # run keeps the same reference rather than its freshly initialised weights.
        self._ref = None
        if loss.kl_coef > 0:
            self._ref = jax.tree.map(jnp.copy, trainable)
        # where batches go on the mesh (rows, screens, routes) and how episodes become them
        self.layout = BatchLayout(
            self.config, self.mesh, num_substeps, bucket_shapes=bucket_shapes, rules=rules
        )
        self.packer = BatchPacker(self.config, self.layout, loss, advantages, seq_len_buckets)
        self._jit: dict[str, Callable] = {}
        self._donate = donate
        self._banned = tuple(int(t) for t in banned_token_ids)
        self.logits_chunk = int(logits_chunk)
        self.compiled_shapes: set[tuple] = set()
        self._warm: set[str] = set()  # shape-independent programs the warm-up compiled
        self.spec = step.StepSpec(
            graphdef=self._graphdef,
            mesh=self.mesh,
            rules=rules,
            loss=loss,
            tx=self._tx,
            max_update_ratio=optimizer.max_update_ratio,
            num_substeps=num_substeps,
            banned=self._banned,
            logits_chunk=self.logits_chunk,
            moe=self.layout.moe,
        )
        if not self.layout.moe and (loss.routing_replay or loss.router_aux_coef > 0):
            raise ValueError(
                "routing_replay / router_aux_coef need a MoE model (text.num_experts > 0); "
                f"this one is dense (routing_replay={loss.routing_replay}, "
                f"router_aux_coef={loss.router_aux_coef})"
            )

    # --------------------------------------------------------------------------- public API

    @property
    def shapes(self) -> shapes_lib.ShapeSet | None:
        """The run's fixed shape set (`cua_jax.rl.shapes`): `pack` puts every batch into
        one of its shapes and `warmup` compiles them ahead. None: rounded buckets."""
        return self.layout.shapes

    @shapes.setter
    def shapes(self, value: shapes_lib.ShapeSet | None) -> None:
        self.layout.shapes = value

    @property
    def group_images(self) -> bool:
        """Shape-set batches of one screen size lay their screens out per micro-batch and
        device (`image_groups`): sharded, encoded a micro-batch at a time. False: the flat,
        replicated layout of every screen (tests compare the two)."""
        return self.layout.group_images

    @group_images.setter
    def group_images(self, value: bool) -> None:
        self.layout.group_images = value

    @property
    def route_shape(self) -> tuple[int, int] | None:
        """MoE: (sparse layers, experts per token) of the batch's ``routes`` i32[R, L, *this]
        (every MoE step takes one; `tools/plan.py` builds it abstractly); None: dense."""
        return self.layout.route_shape

    @property
    def route_sharding(self) -> NamedSharding:
        """The sharding of the batch's ``routes`` (rows over the batch axes, like the tokens)."""
        return self.layout.route_sh

    @property
    def trainable(self) -> nnx.State:
        """The trainable parameters (LoRA adapters, or every weight not frozen), on the mesh;
        replaced (with donation, deleted) by each step: take them again after it."""
        return self._trainable

    @property
    def frozen(self) -> nnx.State:
        """The parameters that do not train (the base weights under LoRA, a frozen tower)."""
        return self._frozen

    @property
    def rest(self) -> nnx.State:
        """The model's non-parameter state (replicated)."""
        return self._rest

    @property
    def reference(self) -> nnx.State | None:
        """The KL reference's trainable params (a copy of the start's), or None without KL."""
        return self._ref

    @property
    def opt_state(self) -> Any:
        """The optimizer state of `trainable`."""
        return self._opt_state

    @property
    def trainable_sharding(self) -> Any:
        """The shardings of `trainable` (and of the KL reference, and of its gradients)."""
        return self._trainable_sh

    @property
    def frozen_sharding(self) -> Any:
        return self._frozen_sh

    @property
    def replicated(self) -> NamedSharding:
        """The mesh's replicated sharding (scalars, metrics, `rest`)."""
        return self._repl

    @property
    def opt_sharding(self) -> Any:
        """The shardings of `opt_state`, as the programs built after this take it."""
        return self._opt_sh

    @opt_sharding.setter
    def opt_sharding(self, value: Any) -> None:
        # `cua_jax.plan` builds the learner over abstract arrays, whose optimizer state has no
        # sharding to read; it sets the ones a real run reads off its concrete state
        self._opt_sh = value

    def reset_optimizer(self) -> None:
        """A fresh optimizer state for the current parameters (its moments and schedule from
        zero; Entropulse's next RL phase)."""
        self._opt_state = jax.device_put(self._tx.init(self._trainable), self._opt_sh)

    @property
    def row_multiple(self) -> int:
        """Packed row counts must be multiples of this (num_substeps x the batch axes)."""
        return self.layout.row_multiple

    def pack(
        self, samples, num_rows: int | None = None, *, mode: Literal["rl", "sft", "teacher"] = "sft"
    ) -> PackedBatch:
        """`BatchPacker.pack`: the samples in one of the run's shapes (its docstring)."""
        return self.packer.pack(samples, num_rows, mode=mode)

    def prepare_batch(
        self, groups: Sequence[Sequence[Trajectory]], num_rows: int | None = None
    ) -> tuple[PackedBatch | None, dict[str, float]]:
        """`BatchPacker.prepare_batch`: GRPO advantages per group, zero-variance filtering,
        samples, packing. Returns (batch or None when every group was filtered, info)."""
        return self.packer.prepare_batch(groups, num_rows)

    def blank_batch(self, shape: shapes_lib.Shape) -> PackedBatch:
        """`BatchPacker.blank_batch`: an all-padding batch of `shape`."""
        return self.packer.blank_batch(shape)

    def position_fn(self) -> PositionFn:
        return rope_position_fn(self.config)

    def train_step(
        self, batch: PackedBatch, teacher: TeacherTargets | None = None
    ) -> dict[str, float]:
        """One GRPO optimizer step on a packed batch; bumps `version`. With SDPO's `teacher`
        targets the loss is (1 - λ) GRPO + λ self-distillation (`cua_jax.rl.sdpo`)."""
        if teacher is None:
            return self._step("rl", batch)
        return self._step(teacher.mode, batch, teacher.arrays())

    def sft_step(self, batch: PackedBatch) -> dict[str, float]:
        """One cross-entropy step on the loss-masked tokens of a packed batch."""
        return self._step("sft", batch)

    def token_logprobs(self, batch: PackedBatch, reference: bool = False) -> np.ndarray:
        """log π(token t | tokens < t) f32[R, L] (0 at t = 0) of the policy at
        `loss.temperature`; the reference policy if asked."""
        fn = self._jit.get("logprobs")
        if fn is None:
            fn = jax.jit(functools.partial(step.token_logprobs, self.spec))
            self._jit["logprobs"] = fn
        if reference and self._ref is None:
            raise ValueError("no reference policy: build the learner with LossConfig(kl_coef > 0)")
        params = self._ref if reference else self._trainable
        out = []
        for part, _ in self.chunks(batch):  # a token-budget batch: one call a chunk
            xs, images = self.layout.device_batch(part, substeps=1)
            lp = fn(params, self._frozen, self._rest, xs, images)
            out.append(np.asarray(lp).reshape(part.shape))
        return np.concatenate(out)

    def lower_step(self, batch: PackedBatch, mode: str = "rl", extra=None) -> Any:
        """The jitted step of `mode` ("rl", "sft", or an SDPO mode with its target arrays in
        `extra`) for `batch`, lowered but not run (`jax.stages.Lowered`):
        `.compile().memory_analysis()` is its XLA buffer assignment (tools/bench_*)."""
        if self._chunked(batch):  # a chunk's gradient program (`lower_apply`: the update)
            part, ex = self.chunks(batch, extra)[0]
            xs, images = self.layout.device_batch(part, self.num_substeps, ex)
            n_total = np.float32(1.0)
            fn = self.grads_program(mode, isinstance(images, ImageGroups))
            acc = self._trainable  # the accumulator has the trainable params' shapes
            return fn.lower(
                self._trainable, self._frozen, self._rest, self._ref, xs, images, n_total, acc
            )
        args = self._step_args(batch, extra)
        return self.step_program(mode, isinstance(args[-1], ImageGroups)).lower(*args)

    def lower_apply(self) -> Any:
        """The optimizer update of a token-budget batch (`APPLY_PROGRAM`), lowered."""
        return self.apply_program().lower(self._trainable, self._opt_state, self._trainable)

    def warmup(
        self, mode: Literal["rl", "sft"] = "rl", stop: threading.Event | None = None
    ) -> dict[str, float]:
        """Compiles the train step of `mode` for every shape of the shape set (`self.shapes`)
        ahead of time, from a blank batch of each shape packed as real ones are; a later step
        of that shape runs the compiled program. Returns {program and shape: seconds}. A set
        `stop` ends it before the next program (`compile_each`)."""
        if self.shapes is None:
            raise ValueError("warmup needs a shape set: learner.shapes = ShapeSet.build(...)")
        name = self.program_names(mode)[0]
        times = compile_each(
            self.shapes.of(mode), name, lambda s: self.lower_step(self.blank_batch(s), mode), stop
        )
        if self.shapes.budgeted and not (stop is not None and stop.is_set()):
            times.update(self.warmup_apply())
        return times

    def warmup_apply(self) -> dict[str, float]:
        """Compiles the token-budget update (`APPLY_PROGRAM`) once; {name: seconds}."""
        if APPLY_PROGRAM in self._warm:
            return {}
        t0 = time.perf_counter()
        self.lower_apply().compile()
        self._zero_grads_fn().lower(self._trainable).compile()
        self._warm.add(APPLY_PROGRAM)
        return {APPLY_PROGRAM: time.perf_counter() - t0}

    def loss_and_grads(
        self, batch: PackedBatch, mode: Literal["rl", "sft"] = "rl"
    ) -> tuple[dict[str, float], nnx.State]:
        """Metrics and gradients of one batch without updating anything (tests, debugging)."""
        if self._chunked(batch):
            grads, metrics = self._accumulate(mode, batch)
            metrics["grad_norm"] = optax.tree.norm(grads)
            return {k: float(v) for k, v in jax.device_get(metrics).items()}, grads
        key = f"grads_{mode}"
        if key not in self._jit:
            self._jit[key] = jax.jit(functools.partial(step.grads_and_metrics, self.spec, mode))
        xs, images = self.layout.device_batch(batch, self.num_substeps)
        grads, metrics = self._jit[key](
            self._trainable, self._frozen, self._rest, self._ref, xs, images
        )
        return {k: float(v) for k, v in jax.device_get(metrics).items()}, grads

    @property
    def donates(self) -> bool:
        """Whether a step donates (deletes) the trainable params' old buffers (`donate`)."""
        return self._donate

    def params_for_sampler(self) -> nnx.State:
        """The live parameter arrays (trainable + frozen, adapters included); no copy.

        The arrays are replaced (and, with donation, deleted) by the next train step: take them
        again after each step. `learner.model` always holds the current ones.
        """
        return nnx.state(self.model, nnx.Param)

    def state_dict(self) -> dict[str, Any]:
        """Pytree for `Checkpointer.save`: trainable params, optimizer state, version, and the
        KL reference params when the loss has a KL term."""
        out = {
            "params": self._trainable.to_pure_dict(),
            "opt_state": self._opt_state,
            # a replicated array of the mesh (not a host-local scalar: multi-host saves need
            # every array to be global)
            "version": jax.device_put(np.asarray(self.version, np.int32), self._repl),
        }
        if self._ref is not None:
            out["reference"] = self._ref.to_pure_dict()
        return out

    def abstract_state(self) -> dict[str, Any]:
        """Shapes, dtypes and shardings of `state_dict()` (the restore target)."""
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            self.state_dict(),
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainable = nnx.State(self._trainable)
        nnx.replace_by_pure_dict(trainable, state["params"])
        self._trainable = jax.device_put(trainable, self._trainable_sh)
        self._opt_state = jax.device_put(state["opt_state"], self._opt_sh)
        self.version = int(state["version"])
        nnx.update(self.model, self._trainable)
        if self._ref is not None and "reference" in state:
            ref = nnx.State(self._ref)
            nnx.replace_by_pure_dict(ref, state["reference"])
            self._ref = jax.device_put(ref, self._trainable_sh)

    # ----------------------------------------------------------------------------- internals

    def _leaf_sharding(self, x: Any) -> NamedSharding:
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and s.mesh == self.mesh:
            return s
        return self._repl

    def step_program(self, mode: str, grouped: bool = False) -> Callable:
        """The jitted step of `mode`; `grouped`: for `ImageGroups` screens (sharded pixels)."""
        key = (mode, "grouped") if grouped else mode
        fn = self._jit.get(key)
        if fn is None:
            images_sh = self.layout.images_sharding(grouped)
            ref_sh = None if self._ref is None else self._trainable_sh
            xs_sh = self.layout.xs_shardings(mode)

            def train_step(*a):
                return step.train_step(self.spec, mode, *a)

            train_step.__name__ = f"{mode}_step"  # the program's name in compile_stats' counts
            fn = jax.jit(
                train_step,
                in_shardings=(
                    self._trainable_sh,
                    self._opt_sh,
                    self._frozen_sh,
                    self._rest_sh,
                    ref_sh,
                    xs_sh,
                    images_sh,
                ),
                out_shardings=(self._trainable_sh, self._opt_sh, self._repl),
                donate_argnums=(0, 1) if self._donate else (1,),
            )
            self._jit[key] = fn
        return fn

    # ------------------------------------------------------------- token-budget chunks

    def _chunked(self, batch: PackedBatch) -> bool:
        """Whether `batch` takes the chunked step: a token-budget shape set's batch."""
        return batch.chunks > 1 or (self.shapes is not None and self.shapes.budgeted)

    def program_names(self, mode: str) -> tuple[str, ...]:
        """The programs a step of `mode` compiles (compile_stats' names): the one-call step,
        or with a token-budget shape set the chunk's gradient program and the update."""
        if self.shapes is not None and self.shapes.budgeted:
            return (f"{mode}_grads", APPLY_PROGRAM)
        return (f"{mode}_step",)

    def chunks(self, batch: PackedBatch, extra=None) -> list[tuple[PackedBatch, dict | None]]:
        """`batch`'s chunks (`packing.split_chunks`) with their rows of `extra`."""
        if batch.chunks == 1:
            return [(batch, extra)]
        merge = self.config.vision.spatial_merge_size
        patches_R = row_patches(batch, self.config.image_token_id, merge)
        parts = split_chunks(batch, patches_R)
        return list(zip(parts, _split_extra(extra, batch.chunks), strict=True))

    def grads_program(self, mode: str, grouped: bool) -> Callable:
        """The jitted gradient program of one chunk: (trainable, frozen, rest, ref, xs,
        images, n_total, grads so far) -> (grads so far + the chunk's, its micro-batches'
        metrics); the accumulator is donated."""
        key = (mode, "grads", grouped)
        fn = self._jit.get(key)
        if fn is None:
            images_sh = self.layout.images_sharding(grouped)
            ref_sh = None if self._ref is None else self._trainable_sh

            def grads(*a):
                return step.chunk_grads(self.spec, mode, *a)

            grads.__name__ = f"{mode}_grads"
            fn = jax.jit(
                grads,
                in_shardings=(
                    self._trainable_sh,
                    self._frozen_sh,
                    self._rest_sh,
                    ref_sh,
                    self.layout.xs_shardings(mode),
                    images_sh,
                    self._repl,
                    self._trainable_sh,
                ),
                out_shardings=(self._trainable_sh, self._repl),
                donate_argnums=(7,),
            )
            self._jit[key] = fn
        return fn

    def apply_program(self) -> Callable:
        """The jitted optimizer update from accumulated gradients (`APPLY_PROGRAM`)."""
        fn = self._jit.get(APPLY_PROGRAM)
        if fn is None:

            def apply_update(*a):
                return step.apply_update(self.spec, *a)

            fn = jax.jit(
                apply_update,
                in_shardings=(self._trainable_sh, self._opt_sh, self._trainable_sh),
                out_shardings=(self._trainable_sh, self._opt_sh, self._repl),
                donate_argnums=(0, 1) if self._donate else (1,),
            )
            self._jit[APPLY_PROGRAM] = fn
        return fn

    def _zero_grads_fn(self) -> Callable:
        """The jitted all-zero gradient accumulator (the trainable params' shapes)."""
        fn = self._jit.get("zero_grads")
        if fn is None:
            fn = jax.jit(step.zero_grads, out_shardings=self._trainable_sh)
            self._jit["zero_grads"] = fn
        return fn

    def _zero_grads(self) -> nnx.State:
        return self._zero_grads_fn()(self._trainable)

    def _accumulate(self, mode: str, batch: PackedBatch, extra=None):
        """(the batch's summed gradients, its metrics without the norms): one gradient
        program call per chunk."""
        n_total = np.float32(batch.loss_mask.sum())
        if self.layout.processes > 1:  # the job's trained tokens
            n_total = np.float32(multihost.allgather_ints([int(batch.loss_mask.sum())]).sum())
        grads = self._zero_grads()
        raw = []
        for part, ex in self.chunks(batch, extra):
            xs, images = self.layout.device_batch(part, self.num_substeps, ex)
            grouped = isinstance(images, ImageGroups)
            pix = None if images is None else (images.pixel_values if grouped else images[0])
            self.compiled_shapes.add((f"{mode}_grads", part.shape, getattr(pix, "shape", None)))
            fn = self.grads_program(mode, grouped)
            grads, metrics = fn(
                self._trainable, self._frozen, self._rest, self._ref, xs, images, n_total, grads
            )
            raw.append(metrics)
        host = jax.device_get(raw)
        stacked = {k: np.concatenate([np.atleast_1d(m[k]) for m in host]) for k in host[0]}
        return grads, combine_micro_metrics(stacked, np)

    def _chunked_step(self, mode: str, batch: PackedBatch, extra=None) -> dict[str, float]:
        """One optimizer update from a token-budget batch: its chunks' gradients summed (the
        loss weights are the whole batch's, so the sum is the batch's gradient), then the
        update; a chunk's activations and screens are all a chip holds at once."""
        grads, metrics = self._accumulate(mode, batch, extra)
        trainable, opt_state, norms = self.apply_program()(self._trainable, self._opt_state, grads)
        self._trainable, self._opt_state = trainable, opt_state
        nnx.update(self.model, trainable)
        self.version += 1
        out = {k: float(v) for k, v in metrics.items()}
        out.update({k: float(v) for k, v in jax.device_get(norms).items()})
        out["chunks"] = float(batch.chunks)
        out["version"] = float(self.version)
        return out

    def _step_args(self, batch: PackedBatch, extra=None) -> tuple:
        xs, images = self.layout.device_batch(batch, self.num_substeps, extra)
        return (self._trainable, self._opt_state, self._frozen, self._rest, self._ref, xs, images)

    def _step(self, mode: str, batch: PackedBatch, extra=None) -> dict[str, float]:
        if self._chunked(batch):
            return self._chunked_step(mode, batch, extra)
        args = self._step_args(batch, extra)
        images = args[-1]
        grouped = isinstance(images, ImageGroups)
        pix_shape = (
            None if images is None else (images.pixel_values if grouped else images[0]).shape
        )
        self.compiled_shapes.add((mode, batch.shape, pix_shape))
        trainable, opt_state, metrics = self.step_program(mode, grouped)(*args)
        self._trainable, self._opt_state = trainable, opt_state
        nnx.update(self.model, trainable)
        self.version += 1
        out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        out["version"] = float(self.version)
        return out


def _split_extra(extra: dict[str, np.ndarray] | None, chunks: int) -> list[dict | None]:
    """Per-row extra arrays (SDPO's targets [R, L, ...]) cut into `chunks` row blocks."""
    if not extra:
        return [None] * chunks
    parts = {k: np.split(np.asarray(v), chunks) for k, v in extra.items()}
    return [{k: parts[k][c] for k in parts} for c in range(chunks)]
