"""Qwen2.5-VL / Qwen3-VL / Qwen3.5 (dense and MoE) in Flax NNX with Hugging Face import/export
(see model.py; the MoE block, routing replay and aux loss in moe.py; Qwen3.5's hybrid decoder in
qwen35.py, its Gated DeltaNet in gated_deltanet.py).

Names are imported lazily, as `cua_jax.sampler`'s: `cua_jax.models.qwen_vl.config` loads without
JAX (the config's checks read it before a launch imports the trainer)."""

from cua_jax import lazy

_EXPORTS = {
    "from_pretrained": "cua_jax.models.qwen_vl.params",
    "full_attention_layers": "cua_jax.models.qwen_vl.qwen35",
    "get_rope_index": "cua_jax.models.qwen_vl.rope",
    "init_random": "cua_jax.models.qwen_vl.model",
    "initial_linear_states": "cua_jax.models.qwen_vl.qwen35",
    "linear_attention_layers": "cua_jax.models.qwen_vl.qwen35",
    "LinearAttnState": "cua_jax.models.qwen_vl.gated_deltanet",
    "load_balancing_loss": "cua_jax.models.qwen_vl.moe",
    "make_attention_mask": "cua_jax.models.qwen_vl.text",
    "make_dense_attn_fn": "cua_jax.models.qwen_vl.text",
    "PUBLISHED": "cua_jax.models.qwen_vl.config",
    "published_config": "cua_jax.models.qwen_vl.config",
    "PUBLISHED_QWEN35": "cua_jax.models.qwen_vl.config",
    "QwenVL": "cua_jax.models.qwen_vl.model",
    "QwenVLConfig": "cua_jax.models.qwen_vl.config",
    "routing_mismatch": "cua_jax.models.qwen_vl.moe",
    "RoutingInfo": "cua_jax.models.qwen_vl.moe",
    "RowAttnFn": "cua_jax.models.qwen_vl.qwen35",
    "save_pretrained": "cua_jax.models.qwen_vl.params",
    "set_expert_mesh": "cua_jax.models.qwen_vl.moe",
    "TextConfig": "cua_jax.models.qwen_vl.config",
    "tiny": "cua_jax.models.qwen_vl.config",
    "tiny_qwen35": "cua_jax.models.qwen_vl.config",
    "tiny_qwen35_moe": "cua_jax.models.qwen_vl.config",
    "vision_metadata": "cua_jax.models.qwen_vl.vision",
    "VisionConfig": "cua_jax.models.qwen_vl.config",
    "VisionMeta": "cua_jax.models.qwen_vl.vision",
}

__getattr__, __dir__, __all__ = lazy.exports(__name__, _EXPORTS, submodules=True)
