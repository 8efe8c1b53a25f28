"""Tiny random Hugging Face Qwen-VL models built locally (no downloads), for parity tests.

Reusable by other parts' tests:

    from tests.models.hf_tiny import save_tiny_hf, make_hf_model, image_inputs, prompt_ids
    hf_dir = save_tiny_hf("qwen3_vl", tmp_path)          # HF save_pretrained of a random model
    model = qwen_vl.from_pretrained(hf_dir)

The HF configs here are written with transformers' own config classes (independently of
cua_jax's config code), and every weight is re-drawn so norms and biases are not trivial.
torch / transformers are imported lazily: this module is test-only.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

# Token ids of the tiny configs (top of a 512-token vocabulary, as cua_jax's `tiny` preset).
VOCAB = 512
VISION_START, VISION_END, IMAGE_TOKEN, VIDEO_TOKEN = VOCAB - 6, VOCAB - 5, VOCAB - 4, VOCAB - 3


# The tiny Qwen3-VL-MoE text config (hidden 64, 2 layers, 8 experts, top-2); `text_kw` of
# `hf_config("qwen3_vl_moe", ...)` overrides any field, e.g. mlp_only_layers=[1].
MOE_TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=48,  # 2F != D and F != D: the two expert layouts differ in shape
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
)


def hf_config(
    family: str, *, tie_word_embeddings: bool = False, vocab_size: int = VOCAB, **text_kw: Any
):
    """A transformers config object for a tiny model of `family` ("qwen2_5_vl" | "qwen3_vl" |
    "qwen3_vl_moe")."""
    ids = dict(
        image_token_id=vocab_size - 4,
        video_token_id=vocab_size - 3,
        vision_start_token_id=vocab_size - 6,
        vision_end_token_id=vocab_size - 5,
        tie_word_embeddings=tie_word_embeddings,
    )
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        text = dict(
            vocab_size=vocab_size,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            bos_token_id=None,
            eos_token_id=vocab_size - 8,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [4, 6, 6],
            },
            tie_word_embeddings=tie_word_embeddings,
        )
        text.update(text_kw)
        vision = dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=4,
            out_hidden_size=128,
            hidden_act="silu",
            patch_size=14,
            temporal_patch_size=2,
            spatial_merge_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
            tokens_per_second=2,
        )
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    if family == "qwen3_vl":
        from transformers import Qwen3VLConfig

        text = dict(
            vocab_size=vocab_size,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [6, 5, 5],
                "mrope_interleaved": True,
            },
            tie_word_embeddings=tie_word_embeddings,
        )
        text.update(text_kw)
        vision = dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=4,
            out_hidden_size=128,
            hidden_act="gelu_pytorch_tanh",
            patch_size=16,
            temporal_patch_size=2,
            spatial_merge_size=2,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0, 1],
        )
        return Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    if family == "qwen3_vl_moe":
        from transformers import Qwen3VLMoeConfig

        text = dict(MOE_TEXT, vocab_size=vocab_size, tie_word_embeddings=tie_word_embeddings)
        text.update(text_kw)
        vision = dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=4,
            out_hidden_size=text["hidden_size"],
            hidden_act="gelu_pytorch_tanh",
            patch_size=16,
            temporal_patch_size=2,
            spatial_merge_size=2,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0, 1],
        )
        return Qwen3VLMoeConfig(text_config=text, vision_config=vision, **ids)
    raise ValueError(f"unknown family {family!r}")


def make_hf_model(family: str, seed: int = 0, **config_kw: Any):
    """A random-weight transformers ForConditionalGeneration model in f32 eval mode."""
    import torch
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeForConditionalGeneration,
    )

    cls = {
        "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": Qwen3VLForConditionalGeneration,
        "qwen3_vl_moe": Qwen3VLMoeForConditionalGeneration,
    }[family]
    torch.manual_seed(seed)
    cfg = hf_config(family, **config_kw)
    cfg._attn_implementation = "eager"
    model = cls(cfg).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and name.endswith("weight"):  # norm scales
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                # HF stores expert weights [E, out, in]: the fan-in is the last dim
                fan_in = p.shape[-1] if "experts" in name else int(np.prod(p.shape[1:]))
                std = 0.5 if "embed_tokens" in name or "pos_embed" in name else fan_in**-0.5
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model


def save_tiny_hf(family: str, out_dir: str | os.PathLike, seed: int = 0, **config_kw: Any) -> str:
    """Build a random tiny HF model and `save_pretrained` it (safetensors) to `out_dir`."""
    model = make_hf_model(family, seed, **config_kw)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


def image_inputs(family: str, sizes: list[tuple[int, int]], seed: int = 0):
    """(pixel_values f32[P, C], image_grid_thw i64[N, 3]) for images of (height, width) pixels.

    Uses transformers' own image processor (instantiated locally from kwargs) on random RGB
    images, so patch order and normalisation are the real ones.
    """
    from transformers import Qwen2VLImageProcessor

    rng = np.random.default_rng(seed)
    patch = 14 if family == "qwen2_5_vl" else 16  # qwen3_vl and qwen3_vl_moe: 16
    proc = Qwen2VLImageProcessor(
        patch_size=patch,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=(patch * 2) ** 2,
        max_pixels=(patch * 2) ** 2 * 64,
    )
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    out = proc(images=images, return_tensors="np")
    return np.asarray(out["pixel_values"], np.float32), np.asarray(out["image_grid_thw"])


def prompt_ids(
    image_grid_thw: np.ndarray | None, text_lens: list[int], seed: int = 0, merge: int = 2
) -> np.ndarray:
    """i64[T]: text, then for each image <vision_start> image-pad * n <vision_end> text ...

    `text_lens` has len(images) + 1 entries (text before, between and after the images).
    Text ids are random in [0, VOCAB - 8).
    """
    rng = np.random.default_rng(seed)
    grids = [] if image_grid_thw is None else list(np.asarray(image_grid_thw))
    if len(text_lens) != len(grids) + 1:
        raise ValueError("text_lens needs one more entry than there are images")
    parts = [rng.integers(0, VOCAB - 8, text_lens[0])]
    for g, n_text in zip(grids, text_lens[1:], strict=True):
        n_img = int(np.prod(g)) // (merge * merge)
        parts += [[VISION_START], [IMAGE_TOKEN] * n_img, [VISION_END]]
        parts.append(rng.integers(0, VOCAB - 8, n_text))
    return np.concatenate([np.asarray(p, np.int64) for p in parts])


def hf_logits(model, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None):
    """transformers forward -> numpy logits f32[B, T, V] (mm_token_type_ids built from ids)."""
    import torch

    ids = torch.as_tensor(np.asarray(input_ids))
    kw: dict[str, Any] = {"input_ids": ids}
    if attention_mask is not None:
        kw["attention_mask"] = torch.as_tensor(np.asarray(attention_mask))
    if pixel_values is not None:
        kw["pixel_values"] = torch.as_tensor(np.asarray(pixel_values))
        kw["image_grid_thw"] = torch.as_tensor(np.asarray(image_grid_thw))
        kw["mm_token_type_ids"] = (ids == model.config.image_token_id).to(torch.int32)
    with torch.no_grad():
        return model(**kw).logits.float().numpy()
