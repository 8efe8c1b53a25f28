"""Image preprocessing vs transformers' Qwen2-VL image processors (PIL and torchvision backends),
and the patch layout checked by hand."""

import itertools

import numpy as np
import PIL.Image
import pytest

from cua_jax.data.image import (
    ImageConfig,
    image_grid_for_size,
    num_image_tokens,
    preprocess_images,
    smart_resize,
)
from tests.data.hf_local import build_hf_image_processor

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
# Small max_pixels keeps the test fast and makes large inputs hit the limit; min_pixels is the
# family default (Qwen3-VL's 65536 makes every small image hit it).
MAX_PIXELS = 160 * 32 * 32


def _screenshot(h: int, w: int, seed: int) -> np.ndarray:
    """u8[h, w, 3] screenshot-like: flat panels, gradients, thin dark 'text' strokes."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], -1)
    img = img.astype(np.uint8)
    for _ in range(6):
        y0, x0 = rng.integers(0, h), rng.integers(0, w)
        img[y0 : y0 + rng.integers(2, 40), x0 : x0 + rng.integers(2, 80)] = rng.integers(0, 256, 3)
    img[::7, ::3] = 20
    return img


def _noise(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


# (height, width): tiny (min_pixels), odd sizes, extreme-but-legal aspect ratios, large
# (max_pixels), an exact multiple of the factor (no resize). Arrays are channels-last; the HF
# side is told so (it would guess channels-first for the 3-row image).
SIZES = [(20, 20), (37, 513), (100, 200), (480, 640), (1000, 30), (3, 590), (896, 1792), (64, 96)]


@pytest.fixture(scope="module")
def hf_processors():
    return {
        (fam, backend): build_hf_image_processor(fam, backend, max_pixels=MAX_PIXELS)
        for fam in FAMILIES
        for backend in ("pil", "torchvision")
    }


def _ours(fam: str, images) -> dict[str, np.ndarray]:
    return preprocess_images(images, ImageConfig.for_family(fam, max_pixels=MAX_PIXELS))


@pytest.mark.parametrize("fam", FAMILIES)
def test_matches_pil_backend_exactly(hf_processors, fam):
    """Bit-identical to Qwen2VLImageProcessorPil on noise and screenshots of many shapes,
    one image at a time and all in one batch (patches concatenated in order)."""
    images = [f(h, w, i) for i, (h, w) in enumerate(SIZES) for f in (_noise, _screenshot)]
    hf = hf_processors[(fam, "pil")]
    for img in images:
        ref = hf(images=[img], return_tensors="np", input_data_format="channels_last")
        ours = _ours(fam, [img])
        assert ours["pixel_values"].dtype == np.float32
        assert ours["image_grid_thw"].dtype == np.int32
        np.testing.assert_array_equal(ours["image_grid_thw"], ref["image_grid_thw"])
        assert ours["pixel_values"].shape == ref["pixel_values"].shape
        assert np.abs(ours["pixel_values"] - ref["pixel_values"]).max() <= 1e-6
    ref = hf(images=images, return_tensors="np", input_data_format="channels_last")
    ours = _ours(fam, images)
    np.testing.assert_array_equal(ours["image_grid_thw"], ref["image_grid_thw"])
    np.testing.assert_array_equal(ours["pixel_values"], ref["pixel_values"])


def test_limits_are_hit(hf_processors):
    """The size list exercises both the min_pixels and the max_pixels branch."""
    for fam in FAMILIES:
        cfg = ImageConfig.for_family(fam, max_pixels=MAX_PIXELS)
        areas = [int(np.prod(image_grid_for_size(h, w, cfg))) * cfg.patch_size**2 for h, w in SIZES]
        plain = [round(h / cfg.factor) * round(w / cfg.factor) * cfg.factor**2 for h, w in SIZES]
        assert any(p > cfg.max_pixels for p in plain) and max(areas) <= cfg.max_pixels
        assert any(p < cfg.min_pixels for p in plain) and min(areas) >= cfg.min_pixels


@pytest.mark.parametrize("fam", FAMILIES)
def test_pil_inputs_rgba_and_grayscale(hf_processors, fam):
    rgba = PIL.Image.fromarray(
        np.concatenate([_screenshot(90, 120, 1), _noise(90, 120, 2)[..., :1]], -1), "RGBA"
    )
    gray = PIL.Image.fromarray(_screenshot(70, 50, 3)[..., 0], "L")
    rgb = PIL.Image.fromarray(_screenshot(300, 200, 4))
    ref = hf_processors[(fam, "pil")](images=[rgba, gray, rgb], return_tensors="np")
    ours = _ours(fam, [rgba, gray, rgb])
    np.testing.assert_array_equal(ours["image_grid_thw"], ref["image_grid_thw"])
    np.testing.assert_array_equal(ours["pixel_values"], ref["pixel_values"])


@pytest.mark.parametrize("fam", FAMILIES)
def test_matches_torchvision_backend(hf_processors, fam):
    """resize_backend="torchvision" equals Qwen2VLImageProcessor (torchvision backend)."""
    cfg = ImageConfig.for_family(fam, max_pixels=MAX_PIXELS, resize_backend="torchvision")
    hf = hf_processors[(fam, "torchvision")]
    for i, (h, w) in enumerate(SIZES):
        for img in (_noise(h, w, i), _screenshot(h, w, i)):
            ref = hf(images=[img], return_tensors="np", input_data_format="channels_last")
            ours = preprocess_images([img], cfg)
            np.testing.assert_array_equal(ours["image_grid_thw"], ref["image_grid_thw"])
            assert ours["pixel_values"].shape == ref["pixel_values"].shape
            assert np.abs(ours["pixel_values"] - ref["pixel_values"]).max() <= 1e-6, (h, w)


def test_backends_really_differ():
    """Why both resize backends exist: transformers' two backends disagree by many uint8 levels
    on high-frequency content (here noise shrunk from 37x513 to 32x512), and each of ours sides
    with its own counterpart."""
    img = _noise(37, 513, 0)
    kw = {"return_tensors": "np", "input_data_format": "channels_last"}
    refs = {
        b: build_hf_image_processor("qwen3_vl", b, min_pixels=8192)(images=[img], **kw)
        for b in ("pil", "torchvision")
    }
    np.testing.assert_array_equal(refs["pil"]["image_grid_thw"], [[1, 2, 32]])
    step = 1 / 255 / 0.5
    assert (
        np.abs(refs["pil"]["pixel_values"] - refs["torchvision"]["pixel_values"]).max() > 3 * step
    )
    for backend, ref in refs.items():
        cfg = ImageConfig.for_family("qwen3_vl", min_pixels=8192, resize_backend=backend)
        assert (
            np.abs(preprocess_images([img], cfg)["pixel_values"] - ref["pixel_values"]).max()
            <= 1e-6
        )


def test_patch_layout_by_hand():
    """Each row of pixel_values is one patch (c, t, py, px) with the frame repeated over t, rows
    ordered (block_row, block_col, merge_row, merge_col). Checked on an image that needs no
    resize, with mean 0, std 1 and rescale 1 so values are the raw pixels."""
    cfg = ImageConfig(
        patch_size=2,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=16,
        max_pixels=10**6,
        image_mean=(0.0, 0.0, 0.0),
        image_std=(1.0, 1.0, 1.0),
        rescale_factor=1.0,
    )
    h, w = 8, 12  # grid 4 x 6 patches
    img = (np.arange(h * w * 3) % 251).astype(np.uint8).reshape(h, w, 3)
    out = preprocess_images([img], cfg)
    np.testing.assert_array_equal(out["image_grid_thw"], [[1, 4, 6]])
    pv = out["pixel_values"]
    assert pv.shape == (24, 3 * 2 * 2 * 2)
    row = 0
    for br, bc, mr, mc in itertools.product(range(2), range(3), range(2), range(2)):
        py, px = br * 2 + mr, bc * 2 + mc  # patch coordinates
        patch = img[py * 2 : py * 2 + 2, px * 2 : px * 2 + 2].transpose(2, 0, 1)  # (c, y, x)
        expected = np.stack([patch, patch], axis=1).reshape(-1)  # (c, t, y, x)
        np.testing.assert_array_equal(pv[row], expected.astype(np.float32))
        row += 1
    assert num_image_tokens(out["image_grid_thw"][0], 2) == 6


def test_smart_resize_matches_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        smart_resize as hf_smart_resize,
    )

    rng = np.random.default_rng(0)
    sizes = [(h, w) for h in (1, 2, 13, 14, 27, 28, 29, 55, 56, 57) for w in (1, 3, 50, 199, 200)]
    sizes += [tuple(int(v) for v in rng.integers(1, 5000, 2)) for _ in range(300)]
    limits = [(56 * 56, 28 * 28 * 1280), (65536, 16777216), (1, 32 * 32 * 4), (4096, 4096 * 9)]
    for (h, w), factor, (lo, hi) in itertools.product(sizes, (28, 32), limits):
        try:
            want = hf_smart_resize(h, w, factor, lo, hi)
        except ValueError:
            with pytest.raises(ValueError, match="aspect ratio"):
                smart_resize(h, w, factor, lo, hi)
            continue
        got = smart_resize(h, w, factor, lo, hi)
        assert got == want, (h, w, factor, lo, hi)
        assert got[0] % factor == 0 and got[1] % factor == 0


def test_smart_resize_edge_cases():
    # Tiny image: scaled up to min_pixels, still multiples of the factor.
    assert smart_resize(1, 1, 28, 56 * 56, 28 * 28 * 1280) == (56, 56)
    # Aspect ratio exactly 200 is allowed, above it transformers raises and so do we.
    h, w = smart_resize(1, 200, 28, 56 * 56, 28 * 28 * 1280)
    assert h % 28 == 0 and w % 28 == 0 and h * w >= 56 * 56
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        smart_resize(1, 201, 28, 56 * 56, 28 * 28 * 1280)
    with pytest.raises(ValueError, match="aspect ratio"):
        preprocess_images([np.zeros((2, 1000, 3), np.uint8)])
    with pytest.raises(ValueError, match="must be positive"):
        smart_resize(0, 10)


def test_bad_inputs_name_the_problem():
    with pytest.raises(TypeError, match="uint8"):
        preprocess_images([np.zeros((28, 28, 3), np.float32)])
    with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
        preprocess_images([np.zeros((28, 28, 5), np.uint8)])
    with pytest.raises(TypeError, match="PIL.Image"):
        preprocess_images(["screenshot.png"])
    with pytest.raises(ValueError, match="unknown model family"):
        ImageConfig.for_family("llava")
    empty = preprocess_images([])
    assert empty["pixel_values"].shape == (0, 1176) and empty["image_grid_thw"].shape == (0, 3)


def test_preprocessor_config_round_trip():
    cfg = ImageConfig.from_preprocessor_config(
        {
            "size": {"longest_edge": 16777216, "shortest_edge": 65536},
            "patch_size": 16,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        }
    )
    assert cfg == ImageConfig.for_family("qwen3_vl")
    legacy = ImageConfig.from_preprocessor_config({"min_pixels": 3136, "max_pixels": 1003520})
    assert legacy == ImageConfig.for_family("qwen2_5_vl")
    with pytest.raises(ValueError, match="resample"):
        ImageConfig.from_preprocessor_config({"resample": 2})
    with pytest.raises(ValueError, match="resize_backend"):
        ImageConfig(resize_backend="opencv")


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
@pytest.mark.parametrize("fam", FAMILIES)
def test_patch_values_are_normalize_then_patchify_bit_for_bit(fam, backend):
    """The table-lookup path gives the two-step path's float32 bits on every uint8 value."""
    from cua_jax.data.image import normalize, patch_values, patchify

    cfg = ImageConfig.for_family(fam, resize_backend=backend)
    rng = np.random.default_rng(3)
    f = cfg.factor
    for h, w in ((f, f), (2 * f, 3 * f), (5 * f, 2 * f)):
        rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        rgb.reshape(-1, 3)[:256] = np.arange(256)[:, None]  # every value in every channel
        want, wh, ww = patchify(normalize(rgb, cfg), cfg)
        got, gh, gw = patch_values(rgb, cfg)
        assert (gh, gw) == (wh, ww) and got.dtype == want.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
@pytest.mark.parametrize("fam", FAMILIES)
def test_screens_as_bytes_lift_to_the_float_rows_bit_for_bit(fam, backend):
    """pixel_dtype="uint8" gives the resized frame's bytes in patch order, 8x fewer bytes than
    the f32 rows; lifting them gives the f32 rows' bits, images of odd sizes included."""
    from cua_jax.data.image import lift_patch_bytes

    f32 = ImageConfig.for_family(fam, resize_backend=backend)
    u8 = ImageConfig.for_family(fam, resize_backend=backend, pixel_dtype="uint8")
    rng = np.random.default_rng(5)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((97, 131), (60, 45))]
    want, got = preprocess_images(images, f32), preprocess_images(images, u8)
    np.testing.assert_array_equal(got["image_grid_thw"], want["image_grid_thw"])
    assert got["pixel_values"].dtype == np.uint8
    assert got["pixel_values"].shape == (want["pixel_values"].shape[0], u8.pixel_width)
    assert want["pixel_values"].nbytes == 8 * got["pixel_values"].nbytes
    lifted = lift_patch_bytes(got["pixel_values"], f32)
    np.testing.assert_array_equal(lifted.view(np.uint32), want["pixel_values"].view(np.uint32))
    empty = preprocess_images([], u8)["pixel_values"]
    assert empty.shape == (0, u8.pixel_width) and empty.dtype == np.uint8
    with pytest.raises(ValueError, match="pixel_dtype"):
        ImageConfig(pixel_dtype="float16")
