"""`QwenVL`: the Qwen2.5-VL / Qwen3-VL policy (Flax NNX), equal to transformers'
`Qwen2_5_VLForConditionalGeneration` / `Qwen3VLForConditionalGeneration`.

Module tree (names follow HF, so `params.py` stays a short table):
    model.visual                      VisionModel (patch_embed, [pos_embed], blocks[i], merger,
                                      [deepstack_merger_list[j]])
    model.language_model              TextModel (embed_tokens, layers[i].{self_attn,mlp,...}, norm)
    lm_head                           absent when tie_word_embeddings

Full forward (same inputs and meaning as transformers; logits f32[B, T, V]):
    logits = model(input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None,
                   position_ids=None, segment_ids=None)
  * `image_grid_thw` is a host (numpy) array: the vision layout is computed from it on the
    host. M-RoPE `position_ids` i32[3, B, T] are computed with `get_rope_index` when not given
    (that needs host `input_ids`); inside `jax.jit` pass `position_ids` (and `vision_meta`).
  * `segment_ids` i32[B, T] (0 = padding) restricts attention to the same segment (packed rows).
  * Text-only calls without position_ids use positions arange(T), as transformers does.

Decomposed forward, for the sampler and the learner (these names and signatures are stable):
    embeds_BTD, visual_pos_mask_BT, deepstack = model.embed(input_ids, pixel_values, image_grid_thw)
        -> inputs_embeds f[B, T, D] with image features scattered at image-pad tokens,
           visual_pos_mask bool[B, T] (None without images), deepstack list of f[B, T, D]
           (Qwen3 with images; else None). Pass `vision_meta=vision_metadata(cfg, grid)` to
           avoid recomputing the layout, e.g. under jit. Images are matched to image-pad runs
           in row-major order over the batch: pixel_values / image_grid_thw list the images
           of row 0 first, then row 1, ... (as transformers' processor does).
    hidden_BTD = model.decode(embeds_BTD, position_ids_3BT, attn_fn, visual_pos_mask, deepstack)
        -> final-normed hidden states. `attn_fn(layer_idx, q_BTNH, k_BTKH, v_BTKH) -> o_BTNH`
           receives q/k after q/k-norm and rotary; `make_dense_attn_fn(attention_mask,
           segment_ids)` is the dense causal default. A paged-KV sampler passes its own attn_fn
           that writes k/v for `layer_idx` into its cache and attends over the cached prefix
           (then B, T are its decode batch / chunk and position_ids its absolute positions).
    logits = model.logits(hidden_BTD) -> f32[B, T, V]

MoE (Qwen3-VL-MoE): `decode(..., return_routing=True)` and `model(..., return_routing=True)`
also return a `moe.RoutingInfo` (router logits f32[L, B, T, E] and chosen experts
i32[L, B, T, K] of the L sparse layers); `routes=` i32[L, B, T, K] replays given experts
(routing replay: the learner reuses the sampler's choices). `moe.load_balancing_loss` turns the
router logits into the auxiliary loss.

Qwen3.5 (family "qwen3_5", dense and MoE; qwen35.py): `model.language_model` is the hybrid
decoder (Gated DeltaNet and gated full-attention layers). `decode` also takes `segment_ids` /
`attention_mask` for the linear layers (by default those of the `qwen35.RowAttnFn` that
`model.attn_fn` returns) and `linear_states` (one `LinearAttnState` per linear layer, to
continue an earlier call); `return_linear_states=True` appends their new states to the result.
The linear layers' chunked rule follows `config.gated_delta_impl` (the jnp reference, or the
Pallas kernel on the model's `use_mesh` mesh; `gated_deltanet.make_chunk_rule`).

Random init (tiny / smoke presets): `QwenVL(config, rngs=nnx.Rngs(seed))` or `init_random`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from cua_jax import sharding as shd
from cua_jax.models.qwen_vl import qwen35
from cua_jax.models.qwen_vl.config import QwenVLConfig
from cua_jax.models.qwen_vl.gated_deltanet import LinearAttnState, make_chunk_rule
from cua_jax.models.qwen_vl.moe import RoutingInfo
from cua_jax.models.qwen_vl.rope import get_rope_index, mrope_cos_sin, text_positions
from cua_jax.models.qwen_vl.text import (
    AttnFn,
    Linear,
    TextModel,
    deepstack_add,
    jdtype,
    make_dense_attn_fn,
)
from cua_jax.models.qwen_vl.vision import VisionMeta, VisionModel, vision_metadata

_ROWS_BTD = ("batch", None, None)  # a [B, T, D] activation's logical axes: rows over "batch"


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


class Model(nnx.Module):
    """HF `model`: `visual` + `language_model` (Qwen3.5: the hybrid decoder)."""

    def __init__(self, cfg: QwenVLConfig, *, rngs: nnx.Rngs):
        self.visual = VisionModel(cfg, rngs=rngs)
        text_cls = qwen35.HybridTextModel if cfg.family == "qwen3_5" else TextModel
        self.language_model = text_cls(cfg, rngs=rngs)


class QwenVL(nnx.Module):
    """Qwen2.5-VL / Qwen3-VL for conditional generation. See the module docstring."""

    def __init__(self, config: QwenVLConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.model = Model(config, rngs=rngs)
        # where the splash attention kernel runs its shard_map (`use_mesh`; None: one device)
        self.attn_mesh: Mesh | None = None
        self.attn_rules: tuple = ()
        t = config.text
        if not config.tie_word_embeddings:
            self.lm_head = Linear(
                t.hidden_size,
                t.vocab_size,
                ("embed", "vocab"),
                bias=False,
                rngs=rngs,
                param_dtype=jdtype(config.param_dtype),
                dtype=jdtype(config.dtype),
            )

    def use_mesh(self, mesh: Mesh | None, rules: tuple | None = None) -> None:
        """The mesh and rules the model's parameters live on (set by `sharding.shard_model`):
        `attn_impl="splash"` runs its Pallas kernel under shard_map on it."""

        self.attn_mesh = mesh
        self.attn_rules = tuple(shd.DEFAULT_RULES if rules is None else rules)

    def attn_fn(
        self, attention_mask: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> AttnFn:
        """The full-sequence causal attention of the config (`attn_impl`, `attn_block`) on the
        model's mesh: what __call__, the learner and the SDPO teacher decode with. It carries
        the mask and segment ids (`qwen35.RowAttnFn`) for Qwen3.5's linear layers."""
        cfg = self.config
        fn = make_dense_attn_fn(
            attention_mask,
            segment_ids,
            cfg.attn_block,
            cfg.attn_impl,
            self.attn_mesh,
            self.attn_rules,
        )
        return qwen35.RowAttnFn(fn, attention_mask, segment_ids)

    # ------------------------------------------------------------------------------ embed
    def embed(
        self,
        input_ids: jax.Array,
        pixel_values: jax.Array | None = None,
        image_grid_thw: np.ndarray | None = None,
        *,
        vision_meta: VisionMeta | None = None,
    ) -> tuple[jax.Array, jax.Array | None, list[jax.Array] | None]:
        """Token embeddings with image features in place of the image-pad tokens.

        Returns (inputs_embeds f[B, T, D], visual_pos_mask bool[B, T] | None,
        deepstack_embeds list of f[B, T, D] | None). Raises ValueError naming both counts when
        the number of image-pad tokens differs from the number of merged image tokens (checked
        whenever input_ids is a host value).
        """
        cfg = self.config
        ids = jnp.asarray(input_ids)
        x_BTD = self.model.language_model.embed_tokens(ids).astype(jdtype(cfg.dtype))
        if pixel_values is None:
            return x_BTD, None, None
        if vision_meta is None:
            if image_grid_thw is None:
                raise ValueError("pixel_values given without image_grid_thw (or vision_meta)")
            if _is_tracer(image_grid_thw):
                raise ValueError(
                    "image_grid_thw must be a host (numpy) array; under jit pass "
                    "vision_meta=vision_metadata(config, image_grid_thw) instead"
                )
            vision_meta = vision_metadata(cfg, np.asarray(image_grid_thw))
        P = pixel_values.shape[0]
        if vision_meta.patch_perm.shape[0] != P:
            raise ValueError(
                f"pixel_values has {P} patches but image_grid_thw describes "
                f"{vision_meta.patch_perm.shape[0]} (sum of t*h*w)"
            )
        M = vision_meta.merge_unperm.shape[0]
        if not _is_tracer(input_ids):
            n_tok = int(np.sum(np.asarray(input_ids) == cfg.image_token_id))
            if n_tok != M:
                raise ValueError(
                    f"Image features and image tokens do not match: input_ids hold {n_tok} image "
                    f"tokens (id {cfg.image_token_id}) but the images give {M} merged tokens "
                    "(sum of t*h*w / merge^2); render the prompt with the processor that made "
                    "pixel_values"
                )
        feats_ME, deepstack = self.model.visual(jnp.asarray(pixel_values), vision_meta)
        mask_BT = ids == cfg.image_token_id
        # i-th image token (row-major over the batch) takes the i-th merged feature.
        order = jnp.cumsum(mask_BT.reshape(-1)).reshape(mask_BT.shape) - 1
        idx = jnp.clip(order, 0, M - 1)

        def scatter(f_ME):
            return jnp.where(
                mask_BT[..., None], jnp.take(f_ME, idx, axis=0).astype(x_BTD.dtype), x_BTD
            )

        x_BTD = scatter(feats_ME)
        ds = None
        if deepstack:
            zeros = jnp.zeros_like(x_BTD)
            ds = [
                jnp.where(mask_BT[..., None], jnp.take(f, idx, axis=0).astype(x_BTD.dtype), zeros)
                for f in deepstack
            ]
        return x_BTD, mask_BT, ds

    # ----------------------------------------------------------------------------- decode
    def decode(
        self,
        inputs_embeds_BTD: jax.Array,
        position_ids_3BT: jax.Array,
        attn_fn: AttnFn,
        visual_pos_mask: jax.Array | None = None,
        deepstack_embeds: list[jax.Array] | None = None,
        *,
        routes: jax.Array | None = None,
        return_routing: bool = False,
        segment_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        linear_states: list[LinearAttnState] | None = None,
        return_linear_states: bool = False,
        lengths: jax.Array | None = None,
    ) -> jax.Array | tuple:
        """Decoder layers + final norm. DeepStack features are added after layers 0..k-1.

        MoE only: `routes` i32[L, B, T, K] replays the experts of the L sparse layers;
        `return_routing` returns (hidden, RoutingInfo). Qwen3.5 only: `segment_ids`,
        `attention_mask`, `linear_states`, and `return_linear_states` (appends the list of
        new linear states to the result), `lengths` i32[B] (right-padded rows: the states
        returned are those after each row's last real token); see the module docstring."""
        t = self.config.text
        if self.config.family == "qwen3_5":
            if deepstack_embeds is not None:
                raise ValueError("Qwen3.5 has no DeepStack features (deepstack_embeds)")
            if return_routing and not t.is_moe:
                raise ValueError("return_routing needs a MoE model (text.num_experts > 0)")
            h, routing, states = qwen35.decode(
                self.model.language_model,
                inputs_embeds_BTD,
                position_ids_3BT,
                attn_fn,
                routes=routes,
                segment_ids=segment_ids,
                attention_mask=attention_mask,
                linear_states=linear_states,
                lengths=lengths,
                chunk_rule=make_chunk_rule(
                    self.config.gated_delta_impl, self.attn_mesh, self.attn_rules
                ),
            )
            out = (h, routing) if return_routing else (h,)
            out = (*out, states) if return_linear_states else out
            return out if len(out) > 1 else h
        if return_linear_states or linear_states is not None or lengths is not None:
            raise ValueError("linear_states are for Qwen3.5 (family 'qwen3_5') only")
        lm = self.model.language_model
        sparse = [i for i in range(t.num_hidden_layers) if t.is_sparse_layer(i)]
        if (routes is not None or return_routing) and not sparse:
            raise ValueError("routes / return_routing need a MoE model (text.num_experts > 0)")
        if routes is not None and jnp.shape(routes)[0] != len(sparse):
            raise ValueError(
                f"routes has {jnp.shape(routes)[0]} layers but the model has {len(sparse)} "
                "sparse layers"
            )
        cos, sin = mrope_cos_sin(
            jnp.asarray(position_ids_3BT),
            t.head_dim,
            t.rope_theta,
            t.mrope_section,
            t.mrope_interleaved,
        )
        h = inputs_embeds_BTD.astype(jdtype(self.config.dtype))
        # rows over the batch axes between layers, in a learner's `shd.training_layout`
        h = shd.constrain(h, _ROWS_BTD)
        infos = []
        for i in range(t.num_hidden_layers):
            r = None if routes is None or i not in sparse else routes[sparse.index(i)]
            h, info = lm.run_layer(i, h, cos, sin, attn_fn, r)
            if info is not None:
                infos.append(info)
            if deepstack_embeds is not None and i < len(deepstack_embeds):
                if visual_pos_mask is None:
                    raise ValueError("deepstack_embeds given without visual_pos_mask")
                h = deepstack_add(h, deepstack_embeds[i], visual_pos_mask)
            h = shd.constrain(h, _ROWS_BTD)
        h = lm.norm(h)
        if not return_routing:
            return h
        return h, RoutingInfo(jnp.stack([lg for lg, _ in infos]), jnp.stack([e for _, e in infos]))

    # ----------------------------------------------------------------------------- logits
    def logits(self, hidden_BTD: jax.Array, *, vocab_parallel: bool = True) -> jax.Array:
        """f32[B, T, V] (tied: hidden @ embed_tokens.weight.T). In a learner's
        `shd.training_layout` the head is vocabulary-parallel (`shd.vocab_parallel`): every row
        of the chunk on each chip against its slice of the vocabulary, the logits split over
        the vocabulary. Where the mesh cannot divide the vocabulary, or `vocab_parallel` is
        False (a top-k over each row's vocabulary: SDPO's teacher), the rows stay over the
        batch axes and the head is all-gathered over them (`shd.gathered`)."""
        dt = hidden_BTD.dtype
        if self.config.tie_word_embeddings:
            w, names, eq = (
                self.model.language_model.embed_tokens.weight[...],
                ("vocab", "embed"),
                "vd",
            )
        else:
            w, names, eq = self.lm_head.kernel[...], ("embed", "vocab"), "dv"
        w = w.astype(dt)
        split = shd.vocab_parallel(w, names, names.index("vocab")) if vocab_parallel else None
        if split is not None:
            w, spec = split
            hidden_BTD = shd.constrain_spec(hidden_BTD, jax.sharding.PartitionSpec())
        else:
            w, spec = shd.gathered(w, names), None
            hidden_BTD = shd.constrain(hidden_BTD, _ROWS_BTD)
        logits = jnp.einsum(f"btd,{eq}->btv", hidden_BTD, w, preferred_element_type=jnp.float32)
        if spec is not None:
            return shd.constrain_spec(logits, spec)
        return shd.constrain(logits, ("batch", None, "vocab"))

    # ---------------------------------------------------------------------------- forward
    def position_ids_for(
        self,
        input_ids,
        attention_mask=None,
        image_grid_thw=None,
    ) -> np.ndarray:
        """M-RoPE positions as transformers computes them in forward (host side)."""
        B, T = np.shape(input_ids)
        if image_grid_thw is None:
            return text_positions(B, T)
        if _is_tracer(input_ids) or _is_tracer(attention_mask):
            raise ValueError("under jit, pass position_ids (computed with get_rope_index)")
        pos, _ = get_rope_index(
            np.asarray(input_ids),
            np.asarray(image_grid_thw),
            None if attention_mask is None else np.asarray(attention_mask),
            image_token_id=self.config.image_token_id,
            spatial_merge_size=self.config.vision.spatial_merge_size,
        )
        return pos

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        pixel_values: jax.Array | None = None,
        image_grid_thw: np.ndarray | None = None,
        position_ids: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        *,
        vision_meta: VisionMeta | None = None,
        routes: jax.Array | None = None,
        return_routing: bool = False,
    ) -> jax.Array | tuple[jax.Array, RoutingInfo]:
        """Full forward -> logits f32[B, T, V] (MoE: + RoutingInfo with return_routing; routes
        replays experts). See the module docstring."""
        embeds, vis_mask, ds = self.embed(
            input_ids, pixel_values, image_grid_thw, vision_meta=vision_meta
        )
        if position_ids is None:
            grid = image_grid_thw if pixel_values is not None else None
            position_ids = self.position_ids_for(input_ids, attention_mask, grid)
        position_ids = jnp.asarray(position_ids)
        if position_ids.ndim == 2:  # [B, T] text positions -> all three axes
            position_ids = jnp.broadcast_to(position_ids[None], (3, *position_ids.shape))
        attn_fn = self.attn_fn(attention_mask, segment_ids)
        out = self.decode(
            embeds,
            position_ids,
            attn_fn,
            vis_mask,
            ds,
            routes=routes,
            return_routing=return_routing,
        )
        if return_routing:
            hidden, routing = out
            return self.logits(hidden), routing
        return self.logits(out)


def init_random(config: QwenVLConfig, seed: int = 0, dtype: str | None = None) -> QwenVL:
    """Random-init model (tiny / smoke presets). `dtype` sets both param and compute dtype."""
    if dtype is not None:
        config = config.replace(param_dtype=dtype, dtype=dtype)
    return QwenVL(config, rngs=nnx.Rngs(seed))
