"""Typed configuration for Qwen2.5-VL, Qwen3-VL and Qwen3.5 (dense and MoE), read from and written
to HF config.json.

`QwenVLConfig` is a frozen dataclass with a text and a vision sub-config whose field names equal
the Hugging Face names, so `from_hf_dict(json.load(...))` and `to_hf_dict()` stay a thin layer.
Run-time options that are not HF fields (parameter dtype, compute dtype, remat policy) live in
the same object but are never exported.

`family` names the vision tower, rotary layout, chat template and processor ("qwen2_5_vl" |
"qwen3_vl"). Qwen3-VL-MoE (HF model_type "qwen3_vl_moe", e.g. Qwen3-VL-30B-A3B) shares all of
those with Qwen3-VL and differs only in its decoder MLPs, so it is family "qwen3_vl" with
`text.num_experts > 0`; `QwenVLConfig.model_type` gives the HF name.

Qwen3.5 (HF model_type "qwen3_5", MoE "qwen3_5_moe") is family "qwen3_5": Qwen3-VL's vision
tower without DeepStack, and a hybrid decoder whose `text.layer_types` mix Gated DeltaNet
("linear_attention") and gated full-attention layers with partial rotary
(`text.partial_rotary_factor`); its MoE layers add a shared expert
(`text.shared_expert_intermediate_size`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from cua_jax.data.image import ImageConfig

Family = Literal["qwen2_5_vl", "qwen3_vl", "qwen3_5"]

FAMILIES: tuple[str, ...] = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")
ARCHITECTURES = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}
# HF model_type -> family (a MoE variant shares its dense family's vision, rotary and template).
MODEL_TYPES = {
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
}
LAYER_TYPES = ("linear_attention", "full_attention")
LINEAR_DIMS = (
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)
DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("none", "full", "dots", "ordered")
ATTN_IMPLS = ("xla", "splash")
MOE_DISPATCHES = ("auto", "all_to_all", "all_gather")
GATED_DELTA_IMPLS = ("reference", "pallas", "auto")
_DEFAULT_MROPE = {"qwen2_5_vl": (16, 24, 24), "qwen3_vl": (24, 20, 20), "qwen3_5": (11, 11, 10)}


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """The language decoder (HF `text_config`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool  # Qwen3-VL: T/H/W frequencies interleaved instead of in blocks
    attention_bias: bool  # q/k/v (Qwen2.5: q/k/v bias, no o bias; Qwen3: none)
    qk_norm: bool  # Qwen3-VL: RMSNorm on each q/k head before rotary
    hidden_act: str = "silu"
    max_position_embeddings: int = 128000
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # --- Mixture of experts (Qwen3-VL-MoE); num_experts == 0 means a dense decoder ---
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    # transformers' Qwen3-VL-MoE router always renormalises the top-k probabilities (it has no
    # norm_topk_prob switch); False keeps the raw softmax probabilities (Qwen2-MoE style).
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001  # HF field; the learner's coefficient is its own option
    # --- Qwen3.5 (family "qwen3_5"); the defaults leave the other families unchanged ---
    # one of LAYER_TYPES per decoder layer; () means every layer is full attention
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0  # rotary on the first head_dim * factor dims of q/k
    attn_output_gate: bool = False  # q_proj also gives a per-channel sigmoid gate on the output
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen3.5-MoE: a gated shared expert per layer

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each q/k head get rotary (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_type(self, i: int) -> str:
        """Decoder layer i's token mixer: "linear_attention" or "full_attention"."""
        return self.layer_types[i] if self.layer_types else "full_attention"

    def is_sparse_layer(self, i: int) -> bool:
        """Whether decoder layer i has the sparse MoE block (transformers' rule)."""
        return (
            self.is_moe
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The vision tower (HF `vision_config`)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    hidden_act: str
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0
    # Qwen2.5-VL only
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = ()
    tokens_per_second: int = 2
    # Qwen3-VL only
    num_position_embeddings: int = 0
    deepstack_visual_indexes: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclasses.dataclass(frozen=True)
class QwenVLConfig:
    """Full model config. `family` selects the Qwen2.5-VL or Qwen3-VL layout."""

    family: Family
    text: TextConfig
    vision: VisionConfig
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False
    # --- run-time options (not HF fields, never exported) ---
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype of activations; logits are always f32
    # "none" | "full" | "dots" | "ordered" (per decoder layer; text.remat_call)
    remat: str = "none"
    # full-sequence attention (the learner's) in query blocks of this many tokens, each block's
    # scores recomputed in the backward pass: f32 scores [heads, block, T] instead of [heads,
    # T, T]; 0: dense. The sampler brings its own attention.
    attn_block: int = 0
    # "xla": the jnp attention above (dense or blockwise); "splash": the Pallas TPU splash
    # attention kernel (flash-style: no [T, T] scores, segment-aware causal mask) in tiles of
    # attn_block (512 when 0) tokens; a TPU kernel, run in interpret mode on CPU (tests only).
    attn_impl: str = "xla"
    # MoE expert parallelism (`moe.SparseMoeBlock` on a mesh with an expert axis): "all_to_all"
    # sends each (token, expert) row to the device holding its expert and back; "all_gather"
    # gathers every expert device's tokens, runs the local experts on all of them and psums;
    # "auto": all_to_all when the sharding rules split the tokens over the expert axis ("batch"
    # maps to it), else all_gather: the one that moves fewer bytes (`moe.choose_all_to_all`)
    moe_dispatch: str = "auto"
    # Qwen3.5's chunked gated delta rule (prefill and training; decode steps are recurrent):
    # "reference": the jnp form (`gated_delta/reference.py`); "pallas": the Pallas TPU kernel
    # (`gated_delta/kernel.py`, interpret mode on CPU; forward and backward are Pallas
    # kernels); "auto": pallas on TPU, reference elsewhere
    gated_delta_impl: str = "reference"
    # The form of the screens a run feeds (the processor's ImageConfig.pixel_dtype), which the
    # compiled programs' abstract inputs and padding follow: "float32", transformers'
    # pixel_values f32[N, C*T*P*P]; "uint8", the frame's bytes in patch order u8[N, C*P*P],
    # 8x fewer bytes. The model takes either: it lifts bytes on the device (`vision.lift_pixels`)
    # normalizing with image_mean / image_std (preprocessor_config.json's, rescale 1/255; ()
    # takes the family's defaults)
    pixel_dtype: str = "float32"
    image_mean: tuple[float, ...] = ()
    image_std: tuple[float, ...] = ()

    @property
    def model_type(self) -> str:
        """The HF model_type: the family, or "<family>_moe" ("qwen3_vl_moe", "qwen3_5_moe") for a
        MoE decoder."""
        return f"{self.family}_moe" if self.text.is_moe else self.family

    @property
    def vision_family(self) -> str:
        """The vision tower's layout: Qwen3.5 uses Qwen3-VL's (without DeepStack)."""
        return "qwen3_vl" if self.family == "qwen3_5" else self.family

    @property
    def pixel_width(self) -> int:
        """Length of one row of the screens this run feeds (`pixel_dtype`'s form)."""
        v = self.vision
        t = v.temporal_patch_size if self.pixel_dtype == "float32" else 1
        return v.in_channels * t * v.patch_size**2

    @property
    def pixel_config(self) -> ImageConfig:
        """The image settings `vision.lift_pixels` normalizes uint8 screens with."""
        over = {}
        if self.image_mean:
            over["image_mean"] = tuple(self.image_mean)
        if self.image_std:
            over["image_std"] = tuple(self.image_std)
        return ImageConfig.for_family(
            self.vision_family,
            patch_size=self.vision.patch_size,
            temporal_patch_size=self.vision.temporal_patch_size,
            **over,
        )

    @property
    def vision_placeholder_ids(self) -> tuple[int, int, int, int]:
        """image pad, video pad, vision start, vision end: prompt-only tokens that a policy must
        never generate (a generated one would start an image run with no pixels behind it)."""
        return (
            self.image_token_id,
            self.video_token_id,
            self.vision_start_token_id,
            self.vision_end_token_id,
        )

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} is not supported; use one of {FAMILIES}")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r}: use one of {DTYPES}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r}: use one of {REMAT_POLICIES}")
        if self.attn_block < 0:
            raise ValueError(f"attn_block={self.attn_block}: use 0 (dense) or a block length")
        if self.pixel_dtype not in ("float32", "uint8"):
            raise ValueError(f"pixel_dtype={self.pixel_dtype!r}: use 'float32' or 'uint8'")
        for name in ("image_mean", "image_std"):
            if len(getattr(self, name)) not in (0, 3):
                raise ValueError(f"{name}={getattr(self, name)!r}: give one value per channel")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={self.attn_impl!r}: use one of {ATTN_IMPLS}")
        if self.moe_dispatch not in MOE_DISPATCHES:
            raise ValueError(f"moe_dispatch={self.moe_dispatch!r}: use one of {MOE_DISPATCHES}")
        if self.gated_delta_impl not in GATED_DELTA_IMPLS:
            raise ValueError(
                f"gated_delta_impl={self.gated_delta_impl!r}: use one of {GATED_DELTA_IMPLS}"
            )
        t, v = self.text, self.vision
        if t.num_attention_heads % t.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={t.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={t.num_key_value_heads}"
            )
        if sum(t.mrope_section) != t.rotary_dim // 2:
            raise ValueError(
                f"mrope_section={list(t.mrope_section)} must sum to the rotary dim / 2 = "
                f"{t.rotary_dim // 2} (head_dim={t.head_dim} x partial_rotary_factor="
                f"{t.partial_rotary_factor})"
            )
        if v.hidden_size % v.num_heads or v.head_dim % 4:
            raise ValueError(
                f"vision hidden_size={v.hidden_size} / num_heads={v.num_heads} must give a head "
                "dim divisible by 4 (2-D rotary)"
            )
        if v.out_hidden_size != t.hidden_size:
            raise ValueError(
                f"vision out_hidden_size={v.out_hidden_size} != text hidden_size={t.hidden_size}"
            )
        if self.vision_family == "qwen3_vl":
            if v.num_position_embeddings <= 0 or int(v.num_position_embeddings**0.5) ** 2 != (
                v.num_position_embeddings
            ):
                raise ValueError(
                    f"num_position_embeddings={v.num_position_embeddings} must be a square > 0"
                )
            if len(v.deepstack_visual_indexes) > t.num_hidden_layers:
                raise ValueError("more deepstack_visual_indexes than decoder layers")
        for idx in (*v.fullatt_block_indexes, *v.deepstack_visual_indexes):
            if not 0 <= idx < v.depth:
                raise ValueError(f"vision block index {idx} out of range for depth={v.depth}")
        if self.family == "qwen3_5":
            self._check_hybrid()
        elif t.layer_types or t.attn_output_gate or t.partial_rotary_factor != 1.0:
            raise ValueError(
                f"layer_types / attn_output_gate / partial_rotary_factor are Qwen3.5 fields; "
                f"family={self.family!r} has plain full-attention layers"
            )
        if t.is_moe:
            self._check_moe()

    def _check_hybrid(self) -> None:
        t = self.text
        if len(t.layer_types) != t.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(t.layer_types)} entries for num_hidden_layers="
                f"{t.num_hidden_layers}"
            )
        for lt in t.layer_types:
            if lt not in LAYER_TYPES:
                raise ValueError(f"layer_types has {lt!r}; use one of {LAYER_TYPES}")
        if "linear_attention" in t.layer_types:
            for name in LINEAR_DIMS:
                if getattr(t, name) <= 0:
                    raise ValueError(f"text_config.{name}={getattr(t, name)} must be > 0")
            if t.linear_num_value_heads % t.linear_num_key_heads:
                raise ValueError(
                    f"linear_num_value_heads={t.linear_num_value_heads} must be a multiple of "
                    f"linear_num_key_heads={t.linear_num_key_heads}"
                )
        if self.vision.deepstack_visual_indexes:
            raise ValueError("Qwen3.5's vision tower has no DeepStack (deepstack_visual_indexes)")
        if t.rotary_dim % 2 or t.rotary_dim <= 0:
            raise ValueError(
                f"head_dim={t.head_dim} x partial_rotary_factor={t.partial_rotary_factor} must "
                "give an even rotary dim > 0"
            )

    def _check_moe(self) -> None:
        t = self.text
        if self.family not in ("qwen3_vl", "qwen3_5"):
            raise ValueError(
                f"num_experts={t.num_experts}: MoE decoders exist for qwen3_5 and qwen3_vl only"
            )
        if not 1 <= t.num_experts_per_tok <= t.num_experts:
            raise ValueError(
                f"num_experts_per_tok={t.num_experts_per_tok} must be in [1, num_experts="
                f"{t.num_experts}]"
            )
        if t.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size={t.moe_intermediate_size} must be > 0")
        if self.family == "qwen3_5" and t.shared_expert_intermediate_size <= 0:
            raise ValueError(
                f"shared_expert_intermediate_size={t.shared_expert_intermediate_size}: every "
                "Qwen3.5-MoE layer has a shared expert (> 0)"
            )
        if t.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step={t.decoder_sparse_step} must be >= 1")
        for i in t.mlp_only_layers:
            if not 0 <= i < t.num_hidden_layers:
                raise ValueError(
                    f"mlp_only_layers has {i}, out of range for {t.num_hidden_layers} layers"
                )

    def replace(self, **kw: Any) -> QwenVLConfig:
        """A copy with top-level fields replaced (e.g. `cfg.replace(dtype="bfloat16")`)."""
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **options: Any) -> QwenVLConfig:
        """Parse a HF `config.json` dict (old flat Qwen2.5-VL layout or nested `text_config`).

        Raises ValueError naming the field for an unsupported model type / architecture / MoE /
        rope type, or a missing required field. `options` sets run-time fields (dtype, ...).
        """
        model_type = d.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"config.json model_type={model_type!r} is not supported; cua_jax supports "
                f"{tuple(MODEL_TYPES)}"
            )
        family: Family = MODEL_TYPES[model_type]  # type: ignore[assignment]
        moe = model_type.endswith("_moe")
        q35 = family == "qwen3_5"
        archs = d.get("architectures") or [ARCHITECTURES[model_type]]
        for arch in archs:
            if arch != ARCHITECTURES[model_type]:
                raise ValueError(
                    f"config.json architectures={archs!r}: only {ARCHITECTURES[model_type]!r} is "
                    f"supported for model_type={model_type!r}"
                )
        td = dict(d.get("text_config") or {})
        if not td:  # old Qwen2.5-VL layout: text fields at the top level
            td = {k: v for k, v in d.items() if k not in ("vision_config",)}
        vd = dict(d.get("vision_config") or {})
        if not vd:
            raise ValueError("config.json has no vision_config")
        if not moe:
            for moe_key in ("num_experts", "moe_intermediate_size", "num_experts_per_tok"):
                if td.get(moe_key):
                    raise ValueError(
                        f"text_config.{moe_key} is set but model_type={model_type!r} is dense; "
                        f"a MoE checkpoint has model_type '{model_type}_moe'"
                    )
        if td.get("use_sliding_window"):
            raise ValueError("text_config.use_sliding_window=true is not supported")

        def req(src: dict[str, Any], key: str, where: str) -> Any:
            if key not in src or src[key] is None:
                raise ValueError(f"config.json {where}.{key} is missing (required)")
            return src[key]

        rope = dict(td.get("rope_parameters") or td.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ValueError(
                f"text_config.rope_scaling.rope_type={rope_type!r} is not supported "
                "(only default M-RoPE)"
            )
        rope_theta = rope.get("rope_theta", td.get("rope_theta", d.get("rope_theta")))
        if rope_theta is None:  # transformers' defaults
            rope_theta = {"qwen2_5_vl": 1000000.0, "qwen3_vl": 500000.0, "qwen3_5": 10000.0}[family]
        mrope = tuple(rope.get("mrope_section") or _DEFAULT_MROPE[family])
        hidden = req(td, "hidden_size", "text_config")
        heads = req(td, "num_attention_heads", "text_config")
        head_dim = td.get("head_dim") or hidden // heads
        text = TextConfig(
            vocab_size=req(td, "vocab_size", "text_config"),
            hidden_size=hidden,
            # Qwen3.5-MoE has no dense MLP (every layer sparse) and no intermediate_size
            intermediate_size=int(td.get("moe_intermediate_size") or 0)
            if model_type == "qwen3_5_moe" and td.get("intermediate_size") is None
            else req(td, "intermediate_size", "text_config"),
            num_hidden_layers=req(td, "num_hidden_layers", "text_config"),
            num_attention_heads=heads,
            num_key_value_heads=td.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            # transformers' defaults when config.json omits it: 1e-5 (Qwen2.5-VL), 1e-6 (Qwen3-VL)
            rms_norm_eps=float(td.get("rms_norm_eps", 1e-5 if family == "qwen2_5_vl" else 1e-6)),
            rope_theta=float(rope_theta),
            mrope_section=mrope,
            mrope_interleaved=family != "qwen2_5_vl",
            attention_bias=(family == "qwen2_5_vl") or bool(td.get("attention_bias", False)),
            qk_norm=family != "qwen2_5_vl",
            hidden_act=td.get("hidden_act", "silu"),
            max_position_embeddings=td.get("max_position_embeddings", 128000),
            bos_token_id=td.get("bos_token_id", d.get("bos_token_id")),
            eos_token_id=td.get("eos_token_id", d.get("eos_token_id")),
            pad_token_id=td.get("pad_token_id", d.get("pad_token_id")),
            **(_moe_fields(td) if moe else {}),
            **(_hybrid_fields(td, rope) if q35 else {}),
        )
        if text.hidden_act != "silu":
            raise ValueError(f"text_config.hidden_act={text.hidden_act!r}: only 'silu' supported")
        if family != "qwen2_5_vl" and text.attention_bias:
            raise ValueError(f"text_config.attention_bias=true is not supported for {family}")
        vrope = vd.get("rope_parameters") or {}
        vision = VisionConfig(
            depth=req(vd, "depth", "vision_config"),
            hidden_size=req(vd, "hidden_size", "vision_config"),
            intermediate_size=req(vd, "intermediate_size", "vision_config"),
            num_heads=req(vd, "num_heads", "vision_config"),
            out_hidden_size=req(vd, "out_hidden_size", "vision_config"),
            hidden_act=vd.get(
                "hidden_act", "silu" if family == "qwen2_5_vl" else "gelu_pytorch_tanh"
            ),
            patch_size=vd.get("patch_size", 14 if family == "qwen2_5_vl" else 16),
            temporal_patch_size=vd.get("temporal_patch_size", 2),
            spatial_merge_size=vd.get("spatial_merge_size", 2),
            in_channels=vd.get("in_channels", vd.get("in_chans", 3)),
            rope_theta=float(vrope.get("rope_theta", 10000.0)),
            window_size=vd.get("window_size", 112),
            fullatt_block_indexes=tuple(vd.get("fullatt_block_indexes") or ()),
            tokens_per_second=vd.get("tokens_per_second", 2),
            num_position_embeddings=vd.get("num_position_embeddings", 0),
            # Qwen3.5's tower has no DeepStack (transformers drops the field)
            deepstack_visual_indexes=() if q35 else tuple(vd.get("deepstack_visual_indexes") or ()),
        )
        if family == "qwen2_5_vl" and not vision.fullatt_block_indexes:
            raise ValueError("vision_config.fullatt_block_indexes is missing (required)")
        # As transformers: Qwen2.5-VL is tied if either the top level or text_config says so
        # (pre-v5 saves kept it in text_config); Qwen3-VL reads the top level only.
        tie = bool(d.get("tie_word_embeddings"))
        if family == "qwen2_5_vl":
            tie = tie or bool(td.get("tie_word_embeddings"))
        ids = {
            k: d[k]
            for k in (
                "image_token_id",
                "video_token_id",
                "vision_start_token_id",
                "vision_end_token_id",
            )
            if d.get(k) is not None
        }
        return cls(
            family=family, text=text, vision=vision, tie_word_embeddings=tie, **ids, **options
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` dict that transformers' `AutoConfig` reads as this model."""
        t, v = self.text, self.vision
        rope: dict[str, Any] = {
            "rope_type": "default",
            "rope_theta": t.rope_theta,
            "mrope_section": list(t.mrope_section),
        }
        if t.mrope_interleaved:
            rope["mrope_interleaved"] = True
        if self.family == "qwen3_5":
            rope["partial_rotary_factor"] = t.partial_rotary_factor
        text = {
            "model_type": f"{self.family}_text",
            "vocab_size": t.vocab_size,
            "hidden_size": t.hidden_size,
            "intermediate_size": t.intermediate_size,
            "num_hidden_layers": t.num_hidden_layers,
            "num_attention_heads": t.num_attention_heads,
            "num_key_value_heads": t.num_key_value_heads,
            "hidden_act": t.hidden_act,
            "max_position_embeddings": t.max_position_embeddings,
            "rms_norm_eps": t.rms_norm_eps,
            "rope_parameters": rope,
            "bos_token_id": t.bos_token_id,
            "eos_token_id": t.eos_token_id,
            "pad_token_id": t.pad_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.family != "qwen2_5_vl":
            text["head_dim"] = t.head_dim
            text["attention_bias"] = False
        if self.model_type == "qwen3_5_moe":  # transformers' config has no dense width
            del text["intermediate_size"]
        if self.family == "qwen3_5":
            text["layer_types"] = list(t.layer_types)
            text["linear_conv_kernel_dim"] = t.linear_conv_kernel_dim
            text.update({k: getattr(t, k) for k in LINEAR_DIMS})
        vision: dict[str, Any] = {
            "model_type": f"{self.family}_vision",
            "depth": v.depth,
            "hidden_size": v.hidden_size,
            "intermediate_size": v.intermediate_size,
            "num_heads": v.num_heads,
            "out_hidden_size": v.out_hidden_size,
            "hidden_act": v.hidden_act,
            "patch_size": v.patch_size,
            "temporal_patch_size": v.temporal_patch_size,
            "spatial_merge_size": v.spatial_merge_size,
            "in_channels": v.in_channels,
            "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
        }
        if self.family == "qwen2_5_vl":
            vision.update(
                window_size=v.window_size,
                fullatt_block_indexes=list(v.fullatt_block_indexes),
                tokens_per_second=v.tokens_per_second,
            )
        else:
            vision["num_position_embeddings"] = v.num_position_embeddings
            if self.family == "qwen3_vl":
                vision["deepstack_visual_indexes"] = list(v.deepstack_visual_indexes)
        if t.is_moe:
            text.update(
                model_type=f"{self.model_type}_text",
                num_experts=t.num_experts,
                num_experts_per_tok=t.num_experts_per_tok,
                moe_intermediate_size=t.moe_intermediate_size,
                router_aux_loss_coef=t.router_aux_loss_coef,
            )
            if self.family == "qwen3_5":  # every layer sparse, each with a shared expert
                text["shared_expert_intermediate_size"] = t.shared_expert_intermediate_size
            else:
                text.update(
                    decoder_sparse_step=t.decoder_sparse_step,
                    mlp_only_layers=list(t.mlp_only_layers),
                )
            vision["model_type"] = f"{self.model_type}_vision"
        return {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "text_config": text,
            "vision_config": vision,
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": self.param_dtype,
        }


def _moe_fields(td: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of a qwen3_vl_moe `text_config` (transformers 5 writes num_experts as
    num_local_experts)."""
    td = dict(td, num_experts=td.get("num_experts", td.get("num_local_experts")))
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if not td.get(key):
            raise ValueError(f"config.json text_config.{key} is missing (required for MoE)")
    return dict(
        num_experts=int(td["num_experts"]),
        num_experts_per_tok=int(td["num_experts_per_tok"]),
        moe_intermediate_size=int(td["moe_intermediate_size"]),
        decoder_sparse_step=int(td.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in td.get("mlp_only_layers") or ()),
        norm_topk_prob=True,  # transformers' Qwen3-VL-MoE router always renormalises
        router_aux_loss_coef=float(td.get("router_aux_loss_coef", 0.001)),
    )


def _hybrid_fields(td: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3.5 fields of a `text_config` (layer pattern, Gated DeltaNet sizes, partial
    rotary, output gate, shared expert), with transformers' defaults."""
    n = td.get("num_hidden_layers")
    types = td.get("layer_types")
    if types is None:  # transformers' default pattern
        interval = int(td.get("full_attention_interval", 4))
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(int(n or 0))
        ]
    out: dict[str, Any] = dict(
        layer_types=tuple(types),
        partial_rotary_factor=float(
            rope.get("partial_rotary_factor", td.get("partial_rotary_factor", 0.25))
        ),
        attn_output_gate=True,
        linear_conv_kernel_dim=int(td.get("linear_conv_kernel_dim", 4)),
        # transformers' defaults (Qwen3_5TextConfig) when config.json omits them
        linear_key_head_dim=int(td.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(td.get("linear_value_head_dim", 128)),
        linear_num_key_heads=int(td.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(td.get("linear_num_value_heads", 32)),
    )
    if td.get("num_experts") or td.get("num_local_experts"):
        out["shared_expert_intermediate_size"] = int(td.get("shared_expert_intermediate_size") or 0)
    return out


# tiny(moe=True): 8 experts, top-2, every layer sparse (Qwen3.5: each with a shared expert).
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
TINY_SHARED_EXPERT = dict(shared_expert_intermediate_size=96)
# tiny("qwen3_5"): Gated DeltaNet sizes (2 q/k heads of 32, 4 value heads of 16, conv width 4),
# rotary on half of each 32-dim head, and linear / full attention layers alternating.
TINY_HYBRID = dict(
    partial_rotary_factor=0.5,
    attn_output_gate=True,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=32,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


SPLASH_BLOCK = 512  # the splash kernel's tile when model.attn_block is 0


def splash_tile(attn_block: int, row_len: int) -> int:
    """The splash kernel's tile for rows of `row_len` tokens: `attn_block` (SPLASH_BLOCK when
    0), at most the row."""
    return min(attn_block or SPLASH_BLOCK, row_len)


def tiny(
    family: Family = "qwen3_vl",
    vocab_size: int = 512,
    *,
    moe: bool | dict[str, Any] = False,
    scale: int = 1,
    **overrides: Any,
) -> QwenVLConfig:
    """A tiny random-init config for tests and the CPU smoke run.

    2 vision blocks, 2 decoder layers, hidden 128, GQA (4 q heads / 2 kv heads). Qwen2.5-VL gets
    one window-attention and one full-attention vision block (window = 2x2 merged tokens);
    Qwen3-VL gets a 4x4 learned position grid and DeepStack features from both vision blocks.
    `scale` = k multiplies depths, widths and head counts by k (head sizes stay 32 and 16) and
    the Qwen3-VL position grid by k a side, DeepStack taken from the last two vision blocks:
    the "small" preset is k = 2 (4 + 4 blocks, hidden 256, an 8x8 grid).
    Special token ids default to the top of the vocabulary; `overrides` replaces any top-level
    field (token ids, tie_word_embeddings, dtype, remat ...) and the text config's
    bos/eos/pad_token_id (written to generation_config.json on export).
    `moe=True` (qwen3_vl, qwen3_5) makes every decoder layer a sparse MoE block (`TINY_MOE`: 8
    experts, top-2, expert width 64; Qwen3.5 adds a shared expert of width 96); a dict
    overrides those text fields, e.g. `moe=dict(num_experts=4, mlp_only_layers=(1,))`.
    Qwen3.5 (`TINY_HYBRID`) alternates Gated DeltaNet and full-attention layers (linear
    first), with rotary on half of each head; `layer_types=(...)` among `overrides` sets
    another pattern.
    """
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: use one of {FAMILIES}")
    if scale < 1:
        raise ValueError(f"scale={scale} must be >= 1")
    q35 = family == "qwen3_5"
    q3 = family in ("qwen3_vl", "qwen3_5")  # Qwen3.5 takes Qwen3-VL's tower and rotary layout
    k = scale
    text = TextConfig(
        vocab_size=vocab_size,
        hidden_size=128 * k,
        intermediate_size=256 * k,
        num_hidden_layers=2 * k,
        num_attention_heads=4 * k,
        num_key_value_heads=2 * k,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=5000000.0 if q3 else 1000000.0,
        mrope_section=(4, 2, 2) if q35 else (6, 5, 5) if q3 else (4, 6, 6),
        mrope_interleaved=q3,
        attention_bias=not q3,
        qk_norm=q3,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=vocab_size - 8,
        pad_token_id=vocab_size - 7,
    )
    vision = VisionConfig(
        depth=2 * k,
        hidden_size=64 * k,
        intermediate_size=128 * k,
        num_heads=4 * k,
        out_hidden_size=128 * k,
        hidden_act="gelu_pytorch_tanh" if q3 else "silu",
        patch_size=16 if q3 else 14,
        window_size=112 if q3 else 56,  # Qwen2.5: 56 // 2 // 14 = 2 merged tokens a side
        fullatt_block_indexes=() if q3 else tuple(range(1, 2 * k, 2)),
        num_position_embeddings=16 * k * k if q3 else 0,
        deepstack_visual_indexes=(2 * k - 2, 2 * k - 1) if q3 and not q35 else (),
    )
    if q35:
        pattern = overrides.pop("layer_types", None) or tuple(
            ("linear_attention", "full_attention")[i % 2] for i in range(text.num_hidden_layers)
        )
        text = dataclasses.replace(
            text, rope_theta=10000000.0, layer_types=tuple(pattern), **TINY_HYBRID
        )
    ids = dict(
        vision_start_token_id=vocab_size - 6,
        vision_end_token_id=vocab_size - 5,
        image_token_id=vocab_size - 4,
        video_token_id=vocab_size - 3,
    )
    text_ids = {
        k: overrides.pop(k)
        for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        if k in overrides
    }
    text = dataclasses.replace(text, **text_ids)
    if moe:
        base = {**TINY_MOE, **(TINY_SHARED_EXPERT if q35 else {})}
        text = dataclasses.replace(text, **{**base, **(moe if isinstance(moe, dict) else {})})
    ids.update(overrides)
    return QwenVLConfig(family=family, text=text, vision=vision, **ids)


def tiny_qwen35(vocab_size: int = 512, **overrides: Any) -> QwenVLConfig:
    """The tiny dense Qwen3.5 (`tiny("qwen3_5")`): 2 layers, Gated DeltaNet then gated full
    attention, Qwen3-VL's tower without DeepStack."""
    return tiny("qwen3_5", vocab_size, **overrides)


def tiny_qwen35_moe(vocab_size: int = 512, **overrides: Any) -> QwenVLConfig:
    """The tiny Qwen3.5-MoE (`tiny("qwen3_5", moe=True)`): as `tiny_qwen35`, every MLP a sparse
    block of 8 experts (top-2) plus a gated shared expert."""
    return tiny("qwen3_5", vocab_size, moe=True, **overrides)


# ---------------------------------------------------------------- published checkpoints
# The dimensions of the published Hugging Face `config.json` files (Qwen/Qwen2.5-VL-*-Instruct,
# Qwen/Qwen3-VL-*-Instruct): enough to build a real-size model abstractly (no download) for
# sharding checks and ahead-of-time memory plans (cua_jax.plan).
_PUBLISHED_IDS = dict(
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
)
# Qwen2.5-VL: one 675M vision tower for every size (out_hidden_size = the text width).
_Q25_VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    fullatt_block_indexes=[7, 15, 23, 31],
    window_size=112,
)
# Qwen3-VL: a smaller tower for 2B / 4B than for 8B / 32B.
_Q3_VISION_SMALL = dict(
    depth=24,
    hidden_size=1024,
    intermediate_size=4096,
    num_heads=16,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[5, 11, 17],
)
_Q3_VISION = dict(
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
)
# (hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings, vision)
PUBLISHED: dict[tuple[str, str], tuple[int, int, int, int, int, int, bool, dict[str, Any]]] = {
    ("qwen2_5_vl", "3b"): (2048, 11008, 36, 16, 2, 151936, True, _Q25_VISION),
    ("qwen2_5_vl", "7b"): (3584, 18944, 28, 28, 4, 152064, False, _Q25_VISION),
    ("qwen2_5_vl", "32b"): (5120, 27648, 64, 40, 8, 152064, False, _Q25_VISION),
    ("qwen2_5_vl", "72b"): (8192, 29568, 80, 64, 8, 152064, False, _Q25_VISION),
    ("qwen3_vl", "2b"): (2048, 6144, 28, 16, 8, 151936, True, _Q3_VISION_SMALL),
    ("qwen3_vl", "4b"): (2560, 9728, 36, 32, 8, 151936, True, _Q3_VISION_SMALL),
    ("qwen3_vl", "8b"): (4096, 12288, 36, 32, 8, 151936, False, _Q3_VISION),
    ("qwen3_vl", "32b"): (5120, 25600, 64, 64, 8, 151936, False, _Q3_VISION),
    ("qwen3_vl", "30b-a3b"): (2048, 6144, 48, 32, 4, 151936, False, _Q3_VISION),
}
# Qwen3-VL-MoE checkpoints (HF model_type "qwen3_vl_moe"): their text_config's MoE fields (every
# decoder layer sparse). Qwen3-VL-235B-A22B (94 layers, hidden 4096, 64 heads / 4 kv heads, 128
# experts of width 1536, top-8) is not listed: 2.4e11 parameters, beyond what the abstract
# sharding checks (tests/configs) build.
PUBLISHED_MOE: dict[tuple[str, str], dict[str, Any]] = {
    ("qwen3_vl", "30b-a3b"): dict(
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        rope_theta=5000000.0,
    ),
}


# Qwen3.5 (HF model_type "qwen3_5" / "qwen3_5_moe"): the text_config fields cua_jax reads. Not
# downloaded here: taken from copies of the config.json files quoted in public code (Qwen3.6-27B's
# verbatim, the same architecture and sizes as Qwen3.5-27B; several copies of Qwen3.5-35B-A3B's
# text_config agree). Check: the abstract 27b has 27.36e9 parameters, the 55.56 GB bf16
# checkpoint less its multi-token-prediction layer. The vision tower is the same for both (27
# blocks of width 1152, no DeepStack). Not in PUBLISHED: configs/ has no Qwen3.5 presets yet,
# and PUBLISHED lists exactly the presets' checkpoints.
_Q35_TEXT = dict(
    vocab_size=248320,
    head_dim=256,
    rms_norm_eps=1e-6,
    max_position_embeddings=262144,
    full_attention_interval=4,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
        "partial_rotary_factor": 0.25,
    },
)
_Q35_VISION = dict(
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    num_position_embeddings=2304,
    hidden_act="gelu_pytorch_tanh",
    patch_size=16,
)
_Q35_IDS = dict(
    image_token_id=248056,
    video_token_id=248057,
    vision_start_token_id=248053,
    vision_end_token_id=248054,
)
PUBLISHED_QWEN35: dict[str, dict[str, Any]] = {
    "27b": dict(
        _Q35_TEXT,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        linear_num_value_heads=48,
    ),
    "35b-a3b": dict(
        _Q35_TEXT,
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        linear_num_value_heads=32,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
    ),
}


def published_hf_dict(family: str, size: str) -> dict[str, Any]:
    """The `config.json` dict (the fields cua_jax reads) of a published checkpoint."""
    if family == "qwen3_5" and size in PUBLISHED_QWEN35:
        text = dict(PUBLISHED_QWEN35[size])
        moe = "num_experts" in text
        return {
            "model_type": "qwen3_5_moe" if moe else "qwen3_5",
            "text_config": text,
            "vision_config": dict(_Q35_VISION, out_hidden_size=text["hidden_size"]),
            "tie_word_embeddings": False,
            **_Q35_IDS,
        }
    if (family, size) not in PUBLISHED:
        known = ", ".join(
            [f"{f}:{s}" for f, s in PUBLISHED] + [f"qwen3_5:{s}" for s in PUBLISHED_QWEN35]
        )
        raise ValueError(f"no published config for {family}:{size}; known: {known}")
    hidden, inter, layers, heads, kv, vocab, tied, vision = PUBLISHED[family, size]
    text: dict[str, Any] = dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        tie_word_embeddings=tied,
    )
    if family == "qwen3_vl":
        text["head_dim"] = 128
    moe = PUBLISHED_MOE.get((family, size))
    if moe is not None:
        text.update(moe)
        family = "qwen3_vl_moe"
    return {
        "model_type": family,
        "text_config": text,
        "tie_word_embeddings": tied,
        "vision_config": dict(vision, out_hidden_size=hidden),
        **_PUBLISHED_IDS,
    }


def published_config(family: str, size: str, **options: Any) -> QwenVLConfig:
    """The config of a published checkpoint (`("qwen3_vl", "8b")`, `("qwen3_5", "35b-a3b")`, ...)
    without downloading it.

    `options` sets run-time fields (param_dtype, dtype, remat). Raises ValueError naming the
    known sizes for an unknown one.
    """
    return QwenVLConfig.from_hf_dict(published_hf_dict(family, size), **options)
