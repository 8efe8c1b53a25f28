"""The sharded GRPO / SFT learner: an NNX model + optax state as pure pytrees, one jitted step.

    learner = Learner(model, mesh=make_mesh(1, 4, 2), optimizer=OptimizerConfig(...),
                      loss=LossConfig(...), num_substeps=2, lora=LoraConfig(rank=8))
    batch, info = learner.prepare_batch(store.get_groups(n))  # advantages, samples, packing
    metrics = learner.train_step(batch)                      # version += 1
    params = learner.params_for_sampler()                    # live arrays, no copy

Three rooms: `cua_jax.rl.packer` (`learner.packer`) turns episodes into packed batches on the
host (advantages, samples, shapes, token-budget chunks, multi-host shares);
`cua_jax.rl.layout` (`learner.layout`) puts a packed batch on the mesh (rows, screens, routes);
this module holds the parameters and optimizer state and builds and runs the jitted programs
(`cua_jax.rl.micro`: the micro-batch helpers they share with SDPO and the image groups).

The train step (one `jax.jit` per mode, compiled once per batch shape; the length buckets of
`packing.pack` bound the shapes) takes the trainable parameters and the optimizer state as
donated arguments with explicit shardings from the params' logical axes (`cua_jax.sharding`).

Token-budget batches (`rl.tokens_per_chip`, `cua_jax.rl.batching`): a batch is `chunks` blocks
of a shape's rows; each chunk is one call of the gradient program (`_get_grads`: its grads added
to a donated accumulator), then one optimizer update (`APPLY_PROGRAM`), so memory is one chunk's
however many samples a step has. Every update (fused or not) is guarded: one that is not finite
or exceeds `OptimizerConfig.max_update_ratio` x the params' norm is not applied.

Gradient accumulation: the packed rows are split into ``num_substeps`` micro-batches scanned
with `jax.lax.scan`; loss weights are normalised over the whole batch on the host
(`losses.loss_weights`), so the summed micro-batch gradients are exactly the full-batch
gradient. Screens of a shape-set batch (one screen size, one process) are grouped by
micro-batch and device (`cua_jax.rl.image_groups`): sharded over the batch axes, and each
micro-batch embeds its own rows (token embeddings + the vision tower + image scatter) inside the
scan's gradient, so a device encodes only its rows' screens and the tower's activations are one
micro-batch's. Other image batches (the flat layout: replicated, e.g. screens of mixed sizes,
multi-host) run the embedding stage once for the whole batch outside the scan through
`jax.vjp`; the scan returns the cotangents of the embeddings, which are pulled back through the
vision tower once at the end. Either way the vision tower sees each screen once per step.

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

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

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
from cua_jax.models.qwen_vl.moe import load_balancing_loss
from cua_jax.rl import image_groups, losses, sdpo
from cua_jax.rl import shapes as shapes_lib
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
from cua_jax.rl.trajectory import PositionFn, Trajectory, rope_position_fn

# The optimizer update of a token-budget batch, after its chunks' gradient programs
APPLY_PROGRAM = "apply_update"


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup, then constant or cosine decay, and global-norm clipping."""

    learning_rate: float = 1e-6
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    decay_steps: int = 0  # cosine: steps after warmup to reach end_lr_ratio * learning_rate
    end_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    # An update whose norm is more than this times the parameters' norm, or not finite, is not
    # applied (the step reports `update_rejected` and the run stops: `check_finite`); 0: off
    max_update_ratio: float = 1.0

    def schedule_fn(self) -> optax.Schedule:
        lr = self.learning_rate
        if self.schedule == "constant":
            after = optax.constant_schedule(lr)
        elif self.schedule == "cosine":
            if self.decay_steps <= 0:
                raise ValueError("schedule='cosine' needs decay_steps > 0 (steps after warmup)")
            after = optax.cosine_decay_schedule(lr, self.decay_steps, alpha=self.end_lr_ratio)
        else:
            raise ValueError(f"unknown schedule {self.schedule!r}; use 'constant' or 'cosine'")
        if self.warmup_steps <= 0:
            return after
        warm = optax.linear_schedule(0.0, lr, self.warmup_steps)
        return optax.join_schedules([warm, after], [self.warmup_steps])

    def build(self) -> optax.GradientTransformation:
        parts = []
        if self.max_grad_norm is not None:
            parts.append(optax.clip_by_global_norm(self.max_grad_norm))
        parts.append(
            optax.adamw(
                self.schedule_fn(),
                b1=self.b1,
                b2=self.b2,
                eps=self.eps,
                weight_decay=self.weight_decay,
            )
        )
        return optax.chain(*parts)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy-loss options (see `cua_jax.rl.losses` for the symbols).

    old_logprobs: "behaviour" anchors the PPO ratio at the sampler's log-probs μ (r = π_θ/μ,
      clipping bounds staleness); "learner" anchors it at the learner's own log-probs at the
      start of the step (r = 1 there) and, with ``tis_cap``, corrects the sampler/learner
      mismatch with truncated importance weights min(π_old/μ, C).
    temperature: the sampling temperature of the rollouts. Logits are divided by it before
      every log-prob / entropy (as verl does), so the learner scores the same tempered policy
      the sampler drew from and reported log-probs for: the PPO ratio starts at 1. The KL
      reference is tempered alike. SFT steps never temper.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    old_logprobs: Literal["behaviour", "learner"] = "behaviour"
    tis_cap: float | None = None
    kl_coef: float = 0.0
    kl_estimator: losses.KLEstimator = "k3"
    entropy_coef: float = 0.0
    agg_mode: losses.AggMode = "token-mean"
    loss_norm: float | None = None  # Dr. GRPO's constant C; "seq-mean-token-sum-norm" needs it
    temperature: float = 1.0
    router_aux_coef: float = 0.0  # MoE: coef x load-balancing loss over the trained tokens
    routing_replay: bool = False  # MoE: forwards use the sampler's recorded experts

    def __post_init__(self):
        if not self.router_aux_coef >= 0:
            raise ValueError(f"router_aux_coef={self.router_aux_coef} must be >= 0")
        if self.old_logprobs not in ("behaviour", "learner"):
            raise ValueError(f"old_logprobs={self.old_logprobs!r}: use 'behaviour' or 'learner'")
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (rollouts sample at it)")
        if self.tis_cap is not None and self.old_logprobs != "learner":
            raise ValueError("tis_cap needs old_logprobs='learner' (π_old/μ is 1 otherwise)")
        if self.agg_mode == "seq-mean-token-sum-norm" and not (self.loss_norm or 0) > 0:
            raise ValueError(
                "agg_mode='seq-mean-token-sum-norm' needs loss_norm > 0: Dr. GRPO's constant, "
                "e.g. the generation budget (max new tokens per turn x turns)"
            )


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    normalize_std: bool = True
    leave_one_out: bool = False
    eps: float = 1e-6
    zero_variance: Literal["filter", "keep"] = "filter"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = lora_lib.DEFAULT_TARGETS
    seed: int = 0


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
    this policy must be built from `learner.model` (`cua_jax.builders.build_engine`), and every
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
        remat: Literal["none", "full", "dots"] | None = None,
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
        self.layout = BatchLayout(self.config, self.mesh, num_substeps, bucket_shapes=bucket_shapes)
        self.packer = BatchPacker(self.config, self.layout, loss, advantages, seq_len_buckets)
        self._jit: dict[str, Callable] = {}
        self._donate = donate
        self._banned = tuple(int(t) for t in banned_token_ids)
        self.logits_chunk = int(logits_chunk)
        self.compiled_shapes: set[tuple] = set()
        self._warm: set[str] = set()  # shape-independent programs the warm-up compiled
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
        """The sharding of the batch's ``routes`` (rows over data x fsdp, like the tokens)."""
        return self.layout.route_sh

    @property
    def row_multiple(self) -> int:
        """Packed row counts must be multiples of this (num_substeps x data x fsdp)."""
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
        self, batch: PackedBatch, teacher: sdpo.TeacherTargets | None = None
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
            fn = jax.jit(self._logprobs_fn, static_argnums=(5,))
            self._jit["logprobs"] = fn
        ref = self._reference_params(self._trainable) if reference else self._trainable
        out = []
        for part, _ in self.chunks(batch):  # a token-budget batch: one call a chunk
            xs, images = self.layout.device_batch(part, substeps=1)
            lp = fn(ref, self._frozen, self._rest, xs, images, bool(part.pixel_values is not None))
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
            fn = self._get_grads(mode, isinstance(images, ImageGroups))
            acc = self._trainable  # the accumulator has the trainable params' shapes
            return fn.lower(
                self._trainable, self._frozen, self._rest, self._ref, xs, images, n_total, acc
            )
        args = self._step_args(batch, extra)
        return self._get_step(mode, isinstance(args[-1], ImageGroups)).lower(*args)

    def lower_apply(self) -> Any:
        """The optimizer update of a token-budget batch (`APPLY_PROGRAM`), lowered."""
        return self._get_apply().lower(self._trainable, self._opt_state, self._trainable)

    def warmup(
        self, mode: Literal["rl", "sft"] = "rl", stop: threading.Event | None = None
    ) -> dict[str, float]:
        """Compiles the train step of `mode` for every shape of the shape set (`self.shapes`)
        ahead of time, from a blank batch of each shape packed as real ones are; a later step
        of that shape runs the compiled program. Returns {program and shape: seconds}. A set
        `stop` ends it before the next program (`compile_each`)."""
        if self.shapes is None:
            raise ValueError("warmup needs a shape set: learner.shapes = ShapeSet.from_config(...)")
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
            self._jit[key] = jax.jit(lambda *a: self._grads_fn(mode, *a))
        xs, images = self.layout.device_batch(batch, self.num_substeps)
        grads, metrics = self._jit[key](
            self._trainable, self._frozen, self._rest, self._ref, xs, images
        )
        return {k: float(v) for k, v in jax.device_get(metrics).items()}, grads

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

    def _reference_params(self, trainable: nnx.State) -> nnx.State:
        if self._ref is not None:
            return self._ref
        raise ValueError("no reference policy: build the learner with LossConfig(kl_coef > 0)")

    def _merge(self, trainable, frozen, rest):
        return nnx.merge(self._graphdef, trainable, frozen, rest)

    def _embed(self, trainable, frozen, rest, ids_RL, images):
        model = self._merge(trainable, frozen, rest)
        if isinstance(images, ImageGroups):
            return image_groups.embed_groups(model, ids_RL, images)
        if images is None:
            emb, vmask, ds = model.embed(ids_RL)
        else:
            pv, meta = images
            emb, vmask, ds = model.embed(ids_RL, pv, vision_meta=meta)
        return (emb, ds), vmask

    def _token_stats(
        self, trainable, frozen, rest, emb, ds, vmask, mb, temperature, entropy, distill=None
    ):
        """(log π(next token), entropy or None, MoE RoutingInfo or None), f32[mb, L-1], at
        `temperature`, with the banned ids masked; the logits are made `logits_chunk` positions
        at a time. MoE: the decoder replays `mb["routes"]` with `routing_replay`."""
        model = self._merge(trainable, frozen, rest)
        attn = model.attn_fn(None, mb["segment_ids"])
        info = None
        if self.layout.moe:
            replay = None
            if self.loss_config.routing_replay:  # [B, T, L, K] -> [L, B, T, K]
                replay = jnp.transpose(mb["routes"], (2, 0, 1, 3))
            hidden, info = model.decode(
                emb, mb["position_ids"], attn, vmask, ds, routes=replay, return_routing=True
            )
        else:
            hidden = model.decode(emb, mb["position_ids"], attn, vmask, ds)
        hidden = hidden[:, :-1]
        banned = jnp.asarray(self._banned, jnp.int32) if self._banned else None

        def logits_fn(h):
            logits = model.logits(h)  # f32[mb, c, V]
            if banned is not None:  # finite, so 0-weight positions never make 0 * inf = NaN
                logits = logits.at[..., banned].set(-1e30)
            return logits if temperature == 1.0 else logits / temperature

        if distill is not None:  # SDPO: + the divergence from the teacher, from the same chunks
            return sdpo.chunked_stats_and_divergence(
                logits_fn,
                hidden,
                mb["input_ids"][:, 1:],
                mb["sdpo_ids"][:, 1:],
                mb["sdpo_logp"][:, 1:],
                chunk=self.logits_chunk,
                entropy=entropy,
                divergence=distill.divergence,
                js_beta=distill.js_beta,
            ), info
        lp, ent = losses.chunked_token_stats(
            logits_fn, hidden, mb["input_ids"][:, 1:], chunk=self.logits_chunk, entropy=entropy
        )
        return lp, ent, info

    def _routing_terms(self, info, mb, n_total):
        """MoE: (coef x this micro-batch's share of the load-balancing loss, metrics): the
        recorded/differing (token, layer) counts behind `routing_mismatch`, `router_aux_loss`."""
        routes = mb["routes"]  # i32[B, T, L, K]
        k = routes.shape[-1]
        _, own = jax.lax.top_k(jax.lax.stop_gradient(info.router_logits), k)  # [L, B, T, K]
        own = jnp.transpose(own, (1, 2, 0, 3))
        rec_BT = jnp.all(routes >= 0, axis=(2, 3)) & (mb["segment_ids"] > 0)
        differ = jnp.any(jnp.sort(own, -1) != jnp.sort(routes, -1), axis=-1)  # [B, T, L]
        metrics = {
            "_routing_differ": jnp.sum(differ & rec_BT[..., None]).astype(jnp.float32),
            "_routing_recorded": (jnp.sum(rec_BT) * routes.shape[2]).astype(jnp.float32),
        }
        coef = self.loss_config.router_aux_coef
        if not coef:
            return 0.0, metrics
        mask = mb["loss_mask"]
        n = jnp.sum(mask).astype(jnp.float32)
        # a micro-batch without trained tokens adds nothing (and no 0/0 in its backward)
        safe = jnp.where(n > 0, mask, jnp.ones_like(mask))
        aux = jnp.where(n > 0, load_balancing_loss(info.router_logits, k, safe), 0.0)
        metrics["router_aux_loss"] = aux
        return coef * aux * n / jnp.maximum(n_total, 1.0), metrics

    def _logprobs_fn(self, trainable, frozen, rest, xs, images, has_images):
        del has_images
        with shd.training_layout(self.mesh, self.rules):
            return self._logprobs(trainable, frozen, rest, xs, images)

    def _logprobs(self, trainable, frozen, rest, xs, images):
        ids = xs["input_ids"]
        (emb, ds), vmask = self._embed(trainable, frozen, rest, ids, images)
        lp, _, _ = self._token_stats(
            trainable, frozen, rest, emb, ds, vmask, xs, self.loss_config.temperature, False
        )
        return jnp.pad(lp, ((0, 0), (1, 0)))

    def _micro_loss(self, mode, trainable, frozen, rest, ref, emb, ds, vmask, ref_emb, mb, n_total):
        loss, metrics, info = self._micro_policy_loss(
            mode, trainable, frozen, rest, ref, emb, ds, vmask, ref_emb, mb
        )
        if info is None:  # dense
            return loss, metrics
        aux, routing = self._routing_terms(info, mb, n_total)
        return loss + aux, {**metrics, **routing, "loss": loss + aux}

    def _micro_policy_loss(self, mode, trainable, frozen, rest, ref, emb, ds, vmask, ref_emb, mb):
        """(loss, metrics, MoE RoutingInfo or None) of one micro-batch."""
        lc = self.loss_config
        temp = 1.0 if mode == "sft" else lc.temperature
        mask = mb["loss_mask"][:, 1:]
        weights = mb["loss_weights"][:, 1:]
        if mode == "sft":
            logp, _, info = self._token_stats(
                trainable, frozen, rest, emb, ds, vmask, mb, temp, False
            )
            return (*losses.sft_loss(logp, weights, mask), info)
        distill = sdpo.parse_mode(mode)
        if distill is None:
            logp, entropy, info = self._token_stats(
                trainable, frozen, rest, emb, ds, vmask, mb, temp, True
            )
        else:
            (logp, entropy, divergence), info = self._token_stats(
                trainable, frozen, rest, emb, ds, vmask, mb, temp, True, distill
            )
        if not lc.entropy_coef:
            entropy = jax.lax.stop_gradient(entropy)
        behaviour = jnp.where(mask, mb["behaviour_logprobs"][:, 1:], jax.lax.stop_gradient(logp))
        old = behaviour if lc.old_logprobs == "behaviour" else jax.lax.stop_gradient(logp)
        ref_logp = None
        if ref is not None:
            r_emb, r_ds = ref_emb
            ref_logp, _, _ = self._token_stats(
                ref, frozen, rest, r_emb, r_ds, vmask, mb, temp, False
            )
            ref_logp = jax.lax.stop_gradient(ref_logp)
        loss, metrics = losses.policy_loss(
            logp,
            old,
            mb["advantages"][:, 1:],
            weights,
            mask,
            eps_low=lc.eps_low,
            eps_high=lc.eps_high,
            behaviour_logprobs_BT=behaviour,
            tis_cap=lc.tis_cap,
            ref_logprobs_BT=ref_logp,
            kl_coef=lc.kl_coef,
            kl_estimator=lc.kl_estimator,
            entropy_BT=entropy,
            entropy_coef=lc.entropy_coef,
        )
        if distill is not None:
            loss, metrics = sdpo.micro_loss(loss, metrics, divergence, mb, distill.weight)
        return loss, metrics, info

    def _grads_fn(self, mode, trainable, frozen, rest, ref_full, xs, images):
        """(grads of the batch loss w.r.t. the trainable params, metrics)."""
        grads, metrics = self._grads_raw(mode, trainable, frozen, rest, ref_full, xs, images)
        return grads, self._batch_metrics(grads, metrics)

    def _grads_raw(self, mode, trainable, frozen, rest, ref_full, xs, images, n_total=None):
        """(grads, each micro-batch's metrics stacked [S]) of one call: the whole batch, or one
        chunk of a token-budget batch whose trained tokens in all are `n_total`. Traced in the
        FSDP `shd.training_layout`: rows over the batch axes, each weight gathered as it is
        used (else GSPMD may keep every row on every chip)."""
        with shd.training_layout(self.mesh, self.rules):
            return self._grads_laid_out(
                mode, trainable, frozen, rest, ref_full, xs, images, n_total
            )

    def _grads_laid_out(self, mode, trainable, frozen, rest, ref_full, xs, images, n_total):
        s = self.num_substeps
        ids = xs["input_ids"]
        if n_total is None:
            n_total = jnp.sum(xs["loss_mask"]).astype(jnp.float32)
        use_ref = mode != "sft" and self.loss_config.kl_coef > 0
        ref = None
        if use_ref:
            ref = ref_full if ref_full is not None else self._reference_params(trainable)
        if isinstance(images, ImageGroups):  # each micro-batch embeds its own screens
            return self._grads_grouped(mode, trainable, frozen, rest, ref, xs, images, n_total)
        (emb, ds), embed_vjp, vmask = jax.vjp(
            lambda tr: self._embed(tr, frozen, rest, ids, images), trainable, has_aux=True
        )
        ref_emb = None
        if use_ref:
            ref_emb, _ = self._embed(ref, frozen, rest, ids, images)
            ref_emb = jax.lax.stop_gradient(ref_emb)

        scan_in = {
            "mb": split_micro_inputs(xs, s),
            "emb": split_micro(emb, s),
            "ds": split_micro(ds, s),
            "vmask": split_micro(vmask, s),
            "ref_emb": split_micro(ref_emb, s),
        }

        def body(g_acc, x):
            def f(tr, e, d):
                return self._micro_loss(
                    mode, tr, frozen, rest, ref, e, d, x["vmask"], x["ref_emb"], x["mb"], n_total
                )

            (_, metrics), (g_tr, g_emb, g_ds) = jax.value_and_grad(
                f, argnums=(0, 1, 2), has_aux=True
            )(trainable, x["emb"], x["ds"])
            g_acc = jax.tree.map(jnp.add, g_acc, g_tr)
            return g_acc, (g_emb, g_ds, metrics)

        g0 = jax.tree.map(jnp.zeros_like, trainable)
        g_tr, (g_emb, g_ds, metrics) = jax.lax.scan(body, g0, scan_in)

        (g_embed,) = embed_vjp((unsplit_micro(g_emb), unsplit_micro(g_ds)))
        return jax.tree.map(jnp.add, g_tr, g_embed), metrics

    def _grads_grouped(self, mode, trainable, frozen, rest, ref, xs, images, n_total):
        """`_grads_fn` with grouped screens (`image_groups`): the scan over micro-batches embeds
        each one's rows with its own screens inside the gradient, so the vision tower's
        activations are one micro-batch's and each device encodes its own rows' screens."""
        scan_in = {"mb": split_micro_inputs(xs, self.num_substeps), "pv": images.pixel_values}

        def body(g_acc, x):
            mb = x["mb"]
            imgs = ImageGroups(x["pv"], images.meta)
            ref_emb = None
            if ref is not None:
                ref_emb, _ = self._embed(ref, frozen, rest, mb["input_ids"], imgs)
                ref_emb = jax.lax.stop_gradient(ref_emb)

            def f(tr):
                (e, d), vmask = self._embed(tr, frozen, rest, mb["input_ids"], imgs)
                return self._micro_loss(
                    mode, tr, frozen, rest, ref, e, d, vmask, ref_emb, mb, n_total
                )

            (_, metrics), g_tr = jax.value_and_grad(f, has_aux=True)(trainable)
            return jax.tree.map(jnp.add, g_acc, g_tr), metrics

        g0 = jax.tree.map(jnp.zeros_like, trainable)
        return jax.lax.scan(body, g0, scan_in)

    def _batch_metrics(self, grads, metrics):
        """The step's metrics from the scan's per-micro-batch ones."""
        out = combine_micro_metrics(metrics, jnp)
        out["grad_norm"] = optax.tree.norm(grads)
        return out

    def _step_fn(self, mode, trainable, opt_state, frozen, rest, ref_full, xs, images):
        grads, out = self._grads_fn(mode, trainable, frozen, rest, ref_full, xs, images)
        trainable, opt_state, norms = self._guarded_update(trainable, opt_state, grads)
        out.update(norms)
        return trainable, opt_state, out

    def _guarded_update(self, trainable, opt_state, grads):
        """(params, optimizer state, norms) after the optimizer update of `grads`, unless the
        update is not finite or its norm exceeds `max_update_ratio` x the parameters' norm:
        then the params and the optimizer state stay as they were and `update_rejected` is 1
        (`check_finite` stops the run; nothing of the step is saved or sampled)."""
        updates, new_opt = self._tx.update(grads, opt_state, trainable)
        update_norm = optax.tree.norm(updates)
        param_norm = optax.tree.norm(trainable)
        ratio = update_norm / jnp.maximum(param_norm, 1e-12)
        bound = self.optimizer_config.max_update_ratio
        ok = jnp.isfinite(update_norm) & jnp.isfinite(optax.tree.norm(grads))
        if bound > 0:
            ok = ok & (ratio <= bound)

        def keep(new, old):
            return jnp.where(ok, new, old)

        new_params = optax.apply_updates(trainable, updates)
        trainable = jax.tree.map(keep, new_params, trainable)
        opt_state = jax.tree.map(keep, new_opt, opt_state)
        norms = {
            "update_norm": update_norm,
            "update_ratio": ratio,
            "update_rejected": 1.0 - ok.astype(jnp.float32),
        }
        return trainable, opt_state, norms

    def _get_step(self, mode: str, grouped: bool = False) -> Callable:
        """The jitted step of `mode`; `grouped`: for `ImageGroups` screens (sharded pixels)."""
        key = (mode, "grouped") if grouped else mode
        fn = self._jit.get(key)
        if fn is None:
            images_sh = self.layout.images_sharding(grouped)
            ref_sh = None if self._ref is None else self._trainable_sh
            xs_sh = self.layout.xs_shardings(mode)

            def step(*a):
                return self._step_fn(mode, *a)

            step.__name__ = f"{mode}_step"  # the program's name in compile_stats' counts
            fn = jax.jit(
                step,
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

    def _get_grads(self, mode: str, grouped: bool) -> Callable:
        """The jitted gradient program of one chunk: (trainable, frozen, rest, ref, xs,
        images, n_total, grads so far) -> (grads so far + the chunk's, its micro-batches'
        metrics); the accumulator is donated."""
        key = (mode, "grads", grouped)
        fn = self._jit.get(key)
        if fn is None:
            images_sh = self.layout.images_sharding(grouped)
            ref_sh = None if self._ref is None else self._trainable_sh

            def grads(trainable, frozen, rest, ref, xs, images, n_total, acc):
                g, metrics = self._grads_raw(
                    mode, trainable, frozen, rest, ref, xs, images, n_total
                )
                return jax.tree.map(jnp.add, acc, g), metrics

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

    def _get_apply(self) -> Callable:
        """The jitted optimizer update from accumulated gradients (`APPLY_PROGRAM`)."""
        fn = self._jit.get(APPLY_PROGRAM)
        if fn is None:

            def apply_update(trainable, opt_state, grads):
                trainable, opt_state, out = self._guarded_update(trainable, opt_state, grads)
                out["grad_norm"] = optax.tree.norm(grads)
                return trainable, opt_state, out

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

            def zero_grads(t):
                return jax.tree.map(jnp.zeros_like, t)

            fn = jax.jit(zero_grads, out_shardings=self._trainable_sh)
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
            fn = self._get_grads(mode, grouped)
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
        trainable, opt_state, norms = self._get_apply()(self._trainable, self._opt_state, grads)
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
        trainable, opt_state, metrics = self._get_step(mode, grouped)(*args)
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
