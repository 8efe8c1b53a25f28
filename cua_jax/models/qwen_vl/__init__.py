"""Qwen2.5-VL / Qwen3-VL in Flax NNX with Hugging Face import/export (see model.py)."""

from cua_jax.models.qwen_vl.config import (
    PUBLISHED,
    QwenVLConfig,
    TextConfig,
    VisionConfig,
    published_config,
    tiny,
)
from cua_jax.models.qwen_vl.model import QwenVL, init_random
from cua_jax.models.qwen_vl.params import from_pretrained, save_pretrained
from cua_jax.models.qwen_vl.rope import get_rope_index
from cua_jax.models.qwen_vl.text import make_attention_mask, make_dense_attn_fn
from cua_jax.models.qwen_vl.vision import VisionMeta, vision_metadata

__all__ = [
    "PUBLISHED",
    "QwenVL",
    "QwenVLConfig",
    "TextConfig",
    "VisionConfig",
    "VisionMeta",
    "from_pretrained",
    "get_rope_index",
    "init_random",
    "make_attention_mask",
    "make_dense_attn_fn",
    "published_config",
    "save_pretrained",
    "tiny",
    "vision_metadata",
]
