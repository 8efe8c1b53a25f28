"""Qwen2.5-VL / Qwen3-VL / Qwen3.5 (dense and MoE) in Flax NNX with Hugging Face import/export
(see model.py; the MoE block, routing replay and aux loss in moe.py; Qwen3.5's hybrid decoder in
qwen35.py, its Gated DeltaNet in gated_deltanet.py)."""

from cua_jax.models.qwen_vl.config import (
    PUBLISHED,
    PUBLISHED_QWEN35,
    QwenVLConfig,
    TextConfig,
    VisionConfig,
    published_config,
    tiny,
    tiny_qwen35,
    tiny_qwen35_moe,
)
from cua_jax.models.qwen_vl.gated_deltanet import LinearAttnState
from cua_jax.models.qwen_vl.model import QwenVL, init_random
from cua_jax.models.qwen_vl.moe import (
    RoutingInfo,
    load_balancing_loss,
    routing_mismatch,
    set_expert_mesh,
)
from cua_jax.models.qwen_vl.params import from_pretrained, save_pretrained
from cua_jax.models.qwen_vl.qwen35 import (
    RowAttnFn,
    full_attention_layers,
    initial_linear_states,
    linear_attention_layers,
)
from cua_jax.models.qwen_vl.rope import get_rope_index
from cua_jax.models.qwen_vl.text import make_attention_mask, make_dense_attn_fn
from cua_jax.models.qwen_vl.vision import VisionMeta, vision_metadata

__all__ = [
    "PUBLISHED",
    "PUBLISHED_QWEN35",
    "QwenVL",
    "LinearAttnState",
    "QwenVLConfig",
    "RoutingInfo",
    "RowAttnFn",
    "TextConfig",
    "VisionConfig",
    "VisionMeta",
    "from_pretrained",
    "full_attention_layers",
    "get_rope_index",
    "init_random",
    "initial_linear_states",
    "linear_attention_layers",
    "load_balancing_loss",
    "make_attention_mask",
    "make_dense_attn_fn",
    "published_config",
    "routing_mismatch",
    "save_pretrained",
    "set_expert_mesh",
    "tiny",
    "tiny_qwen35",
    "tiny_qwen35_moe",
    "vision_metadata",
]
