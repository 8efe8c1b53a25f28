"""Screens as bytes: the model lifts uint8 patch rows to the processor's f32 pixel_values on the
device, so both forms give the same logits (and gradients), in every family."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cua_jax.data.image import ImageConfig, preprocess_images
from cua_jax.models import qwen_vl
from cua_jax.models.qwen_vl.vision import lift_pixels


def _configs():
    return {
        "qwen2_5_vl": qwen_vl.tiny("qwen2_5_vl"),
        "qwen3_vl": qwen_vl.tiny("qwen3_vl"),
        "qwen3_5": qwen_vl.tiny_qwen35(),
    }


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_uint8_screens_give_the_float_screens_logits(family):
    cfg = _configs()[family]
    # a checkpoint's own normalization (from its preprocessor_config.json) is the one applied
    cfg = dataclasses.replace(cfg, image_mean=(0.4, 0.45, 0.5), image_std=(0.2, 0.25, 0.3))
    image = ImageConfig.for_family(
        cfg.vision_family,
        patch_size=cfg.vision.patch_size,
        image_mean=cfg.image_mean,
        image_std=cfg.image_std,
        min_pixels=32 * 32,
        max_pixels=96 * 96,
    )
    rng = np.random.default_rng(0)
    screens = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((70, 90), (41, 64))]
    f32 = preprocess_images(screens, image)
    u8 = preprocess_images(screens, dataclasses.replace(image, pixel_dtype="uint8"))
    lifted = np.asarray(lift_pixels(jnp.asarray(u8["pixel_values"]), cfg))
    np.testing.assert_array_equal(lifted.view(np.uint32), f32["pixel_values"].view(np.uint32))

    grid = f32["image_grid_thw"]
    runs = [
        [cfg.image_token_id] * int(np.prod(g) // cfg.vision.spatial_merge_size**2) for g in grid
    ]
    ids = np.asarray([[5, 6, *runs[0], 7, *runs[1], 8, 9]], np.int32)
    model = qwen_vl.init_random(cfg, seed=0)

    def loss(state, pix, graphdef):
        logits = nnx.merge(graphdef, state)(jnp.asarray(ids), pixel_values=pix, image_grid_thw=grid)
        return jnp.mean(logits**2), logits

    graphdef, state = nnx.split(model)
    fn = jax.value_and_grad(loss, has_aux=True)
    (l32, logits32), g32 = fn(state, jnp.asarray(f32["pixel_values"]), graphdef)
    (l8, logits8), g8 = fn(state, jnp.asarray(u8["pixel_values"]), graphdef)
    np.testing.assert_allclose(np.asarray(logits8), np.asarray(logits32), rtol=0, atol=1e-6)
    np.testing.assert_allclose(float(l8), float(l32), rtol=1e-6)
    w32 = g32["model"]["visual"]["patch_embed"]["proj"]["kernel"][...]
    w8 = g8["model"]["visual"]["patch_embed"]["proj"]["kernel"][...]
    np.testing.assert_allclose(np.asarray(w8), np.asarray(w32), rtol=1e-5, atol=1e-7)


def test_uint8_rows_of_another_patch_size_name_the_problem():
    cfg = qwen_vl.tiny("qwen3_vl")
    with pytest.raises(ValueError, match="rows of 588 bytes"):
        lift_pixels(jnp.zeros((4, 588), jnp.uint8), cfg)


def test_from_pretrained_takes_the_checkpoints_normalization(tmp_path):
    cfg = qwen_vl.tiny("qwen2_5_vl")
    model = qwen_vl.init_random(cfg, seed=0)
    qwen_vl.save_pretrained(model, str(tmp_path))
    (tmp_path / "preprocessor_config.json").write_text(
        '{"image_mean": [0.1, 0.2, 0.3], "image_std": [0.4, 0.5, 0.6], "patch_size": 14}'
    )
    loaded = qwen_vl.from_pretrained(str(tmp_path))
    assert loaded.config.pixel_config.image_mean == (0.1, 0.2, 0.3)
    assert loaded.config.pixel_config.image_std == (0.4, 0.5, 0.6)
