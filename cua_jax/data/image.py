"""Image preprocessing for Qwen2.5-VL and Qwen3-VL, equal to transformers' Qwen2-VL processor.

Both families use transformers' `Qwen2VLImageProcessor` (Qwen3-VL only changes its settings), so
one pipeline serves both:

    uint8 RGB [H, W, 3]
      -> smart_resize to a multiple of patch_size * merge_size within [min_pixels, max_pixels]
      -> bicubic resize on uint8 (PIL, exactly what the PIL-backend processor calls)
      -> rescale by 1/255 (float64, then float32) and normalize with mean/std (float32)
      -> duplicate the frame temporal_patch_size times and flatten patches
         in (grid_h/merge, grid_w/merge, merge, merge) order, each patch as (C, T, P, P)
    -> pixel_values f32[num_patches, C*T*P*P], image_grid_thw i32[n_images, 3] (t, h, w)

Screens in bytes (ImageConfig.pixel_dtype="uint8", what the trainer holds): the resized frame's
uint8 values in the same patch order, one temporal frame, u8[num_patches, C*P*P] -- 8x fewer
bytes than the f32 rows, for the rollout side, the store, the batches and the device. The model
lifts them (`lift_patch_bytes`, the same normalize table, then the temporal copy) as the patch
embedding's first step, so both forms give the same bits of pixel_values.

Two resize backends, one per transformers backend (ImageConfig.resize_backend):
  "pil" (default): PIL's bicubic; bit-identical (max abs 0) to `Qwen2VLImageProcessorPil`.
  "torchvision": a numpy port of torch's uint8 antialiased bicubic; equal to the torchvision
    backend `Qwen2VLImageProcessor` (what AutoProcessor picks when torchvision is installed):
    identical resized uint8 pixels, pixel_values within 1e-6 (float32 rounding of the fused
    normalization). Slower than PIL (pure numpy), so use it when matching that backend matters.
The two backends disagree with each other by up to ~20 uint8 levels on high-frequency content
(torch uses int16 weights of adaptive precision, Pillow 22-bit ones), so pick the one the
checkpoint's users preprocess with.

numpy + PIL only (no torch): this runs in rollout workers next to the sampler.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import PIL.Image

# transformers.image_utils.OPENAI_CLIP_MEAN / _STD and IMAGENET_STANDARD_MEAN / _STD.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF_MEAN_STD = (0.5, 0.5, 0.5)

# Qwen refuses images more elongated than this (transformers' smart_resize raises too).
MAX_ASPECT_RATIO = 200

ImageLike = PIL.Image.Image | np.ndarray
RESIZE_BACKENDS = ("pil", "torchvision")
PIXEL_DTYPES = ("float32", "uint8")


@dataclasses.dataclass(frozen=True)
class ImageConfig:
    """Settings of the Qwen-VL image processor (the fields of preprocessor_config.json).

    Defaults are Qwen2.5-VL's (transformers' Qwen2VLImageProcessor defaults).
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    # "pil": PIL's bicubic, as transformers' PIL backend (Qwen2VLImageProcessorPil).
    # "torchvision": torch's uint8 antialiased bicubic, as the torchvision backend
    # (Qwen2VLImageProcessor, what AutoProcessor picks when torchvision is installed).
    resize_backend: str = "pil"
    # "float32": transformers' pixel_values (normalized, temporally repeated), f32[N, C*T*P*P].
    # "uint8": the resized frame's bytes in patch order, u8[N, C*P*P] (the model lifts them).
    pixel_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.resize_backend not in RESIZE_BACKENDS:
            raise ValueError(
                f"resize_backend must be one of {RESIZE_BACKENDS}, got {self.resize_backend!r}"
            )
        if self.pixel_dtype not in PIXEL_DTYPES:
            raise ValueError(f"pixel_dtype must be one of {PIXEL_DTYPES}, got {self.pixel_dtype!r}")

    @property
    def factor(self) -> int:
        """Side lengths of resized images are multiples of this (one merged token)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one row of pixel_values: C * T * P * P."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    @property
    def pixel_width(self) -> int:
        """Length of one row of what `preprocess_images` returns in this config's pixel_dtype:
        C*T*P*P floats, or C*P*P bytes."""
        return self.patch_dim if self.pixel_dtype == "float32" else 3 * self.patch_size**2

    @classmethod
    def for_family(cls, family: str, **overrides: Any) -> ImageConfig:
        """Default settings of a model family: "qwen2_5_vl" or "qwen3_vl".

        Qwen3-VL's values are those of its released preprocessor_config.json (transformers has no
        Qwen3-VL image processor class; it configures Qwen2VLImageProcessor with them):
        patch 16, mean/std 0.5, shortest_edge 65536 (256*256), longest_edge 16777216 (4096*4096).
        """
        if family in ("qwen2_5_vl", "qwen2_vl"):
            base = cls()
        elif family == "qwen3_vl":
            base = cls(
                patch_size=16,
                min_pixels=65536,
                max_pixels=16777216,
                image_mean=HALF_MEAN_STD,
                image_std=HALF_MEAN_STD,
            )
        else:
            raise ValueError(
                f"unknown model family {family!r}: expected 'qwen2_5_vl' or 'qwen3_vl'"
            )
        return dataclasses.replace(base, **overrides)

    @classmethod
    def from_preprocessor_config(
        cls, cfg: dict[str, Any], resize_backend: str = "pil"
    ) -> ImageConfig:
        """Reads a Hugging Face preprocessor_config.json dict (either size layout)."""
        size = cfg.get("size") or {}
        min_pixels = cfg.get("min_pixels", size.get("shortest_edge", cls.min_pixels))
        max_pixels = cfg.get("max_pixels", size.get("longest_edge", cls.max_pixels))
        for key, want in (("do_resize", True), ("do_rescale", True), ("do_normalize", True)):
            if cfg.get(key, want) is not want:
                raise ValueError(
                    f"preprocessor_config.json has {key}={cfg[key]!r}; only {want} is supported"
                )
        if cfg.get("resample", 3) != 3:
            raise ValueError(
                f"preprocessor_config.json has resample={cfg['resample']!r}; only 3 (bicubic) "
                "is supported"
            )
        return cls(
            patch_size=int(cfg.get("patch_size", cls.patch_size)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", cls.temporal_patch_size)),
            merge_size=int(cfg.get("merge_size", cls.merge_size)),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            image_mean=tuple(float(x) for x in cfg.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=tuple(float(x) for x in cfg.get("image_std", OPENAI_CLIP_STD)),
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
            resize_backend=resize_backend,
        )


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, area within [min_pixels, max_pixels].

    The same arithmetic as transformers' `smart_resize` (Python's round-half-even included), so
    the number of image tokens agrees with theirs for every size.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got height={height}, width={width}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got {ratio} "
            f"(image {height}x{width}); crop or pad the image to a less elongated shape"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb_array(image: ImageLike) -> np.ndarray:
    """u8[H, W, 3] from a PIL image or a uint8 array [H, W], [H, W, 3] or [H, W, 4].

    Transparency is composited onto white, as transformers' convert_to_rgb does.
    """
    if isinstance(image, PIL.Image.Image):
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            image = PIL.Image.alpha_composite(white, rgba)
        return np.asarray(image.convert("RGB"))
    if not isinstance(image, np.ndarray):
        raise TypeError(
            f"image must be a PIL.Image or a uint8 numpy array, got {type(image).__name__}"
        )
    if image.dtype != np.uint8:
        raise TypeError(
            f"image arrays must be uint8 RGB [H, W, 3] (0..255), got dtype {image.dtype}; "
            "convert with (x * 255).round().astype(np.uint8) if it holds floats in [0, 1]"
        )
    if image.ndim == 2:
        return np.repeat(image[:, :, None], 3, axis=2)
    if image.ndim == 3 and image.shape[2] == 3:
        return image
    if image.ndim == 3 and image.shape[2] == 4:
        return to_rgb_array(PIL.Image.fromarray(image, mode="RGBA"))
    raise ValueError(
        f"image array must be [H, W], [H, W, 3] or [H, W, 4] (channels last), got {image.shape}"
    )


def resize_bicubic(rgb_HWC: np.ndarray, height: int, width: int) -> np.ndarray:
    """u8[height, width, 3]: PIL's antialiased bicubic, the call transformers' PIL backend makes."""
    if rgb_HWC.shape[:2] == (height, width):
        # PIL returns an unchanged copy for same-size bicubic; skip the round trip.
        return rgb_HWC
    resized = PIL.Image.fromarray(rgb_HWC).resize((width, height), PIL.Image.Resampling.BICUBIC)
    return np.asarray(resized)


def _torch_aa_cubic(x: float) -> float:
    # Keys cubic with a = -0.5, in torch's operation order (HelperInterpCubic::aa_filter with
    # cubic_convolution1/2 of ATen's UpSample.h) so the float64 weights agree bit for bit.
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2) * x - (a + 3)) * x * x + 1
    if x < 2.0:
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return 0.0


def _torch_u8_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(first tap i64[out], int16-valued weights i32[out, K], precision) of one axis.

    A port of ATen's HelperInterpBase::_compute_index_ranges_int16_weights for antialiased
    bicubic (align_corners=False, no scale factor): float64 weights normalized per output,
    then scaled by 2**precision (the largest that keeps every weight below 2**15) and rounded
    half away from zero.
    """
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    k_max = int(math.ceil(support)) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    first = np.zeros(out_size, np.int64)
    w_f64 = np.zeros((out_size, k_max), np.float64)
    wt_max = 0.0
    for i in range(out_size):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)  # int() truncates toward 0, as the C++ cast
        size = min(max(min(int(center + support + 0.5), in_size) - lo, 0), k_max)
        ws = [_torch_aa_cubic((j + lo - center + 0.5) * invscale) for j in range(size)]
        total = 0.0
        for v in ws:  # sequential sum, as the C++ loop
            total += v
        if total != 0.0:
            ws = [v / total for v in ws]
            wt_max = max(wt_max, *ws)
        first[i] = lo
        w_f64[i, :size] = ws
    precision = 0
    while precision < 22 and int(0.5 + wt_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    v = w_f64 * (1 << precision)
    w_int = np.where(v < 0, np.trunc(v - 0.5), np.trunc(v + 0.5)).astype(np.int32)
    return first, w_int, precision


def _torch_u8_resample_axis(x: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """One separable pass in integer arithmetic: (2**(p-1) + sum w*x) >> p, clamped to uint8."""
    in_size = x.shape[axis]
    first, w, precision = _torch_u8_weights(in_size, out_size)
    x = np.ascontiguousarray(np.moveaxis(x, axis, 0)).astype(np.int32)
    acc = np.full((out_size, *x.shape[1:]), 1 << (precision - 1), np.int32)
    w_shape = (out_size,) + (1,) * (x.ndim - 1)
    for j in range(w.shape[1]):
        taps = x[np.minimum(first + j, in_size - 1)]  # zero weight past each window's end
        acc += w[:, j].reshape(w_shape) * taps
    out = np.clip(acc >> precision, 0, 255).astype(np.uint8)
    return np.moveaxis(out, 0, axis)


def resize_bicubic_torchvision(rgb_HWC: np.ndarray, height: int, width: int) -> np.ndarray:
    """u8[height, width, 3] equal to torchvision's resize(BICUBIC, antialias=True) on uint8.

    torch resizes uint8 images with its own fixed-point kernel (ported from Pillow-SIMD but with
    int16 weights of adaptive precision, where Pillow uses 22-bit ones), so results differ from
    PIL's by a few levels. Hand-written in numpy because cua_jax does not import torch; the
    horizontal pass runs first, as in ATen.
    """
    out = rgb_HWC
    if out.shape[1] != width:
        out = _torch_u8_resample_axis(out, width, axis=1)
    if out.shape[0] != height:
        out = _torch_u8_resample_axis(out, height, axis=0)
    return out


def normalize(rgb_HWC: np.ndarray, config: ImageConfig) -> np.ndarray:
    """f32[3, H, W] = (x * rescale_factor - mean) / std, in transformers' dtypes.

    The PIL backend rescales in float64 and casts to float32 before normalizing in float32;
    doing the same keeps the result bit-identical. The torchvision backend instead fuses the
    two as (x - mean/rescale) / (std/rescale) in float32 (last-bit differences, < 1e-6).
    """
    if config.resize_backend == "torchvision":
        mean = np.asarray(config.image_mean, np.float32) * np.float32(1 / config.rescale_factor)
        std = np.asarray(config.image_std, np.float32) * np.float32(1 / config.rescale_factor)
        x = np.moveaxis(rgb_HWC, -1, 0).astype(np.float32)
        return (x - mean[:, None, None]) / std[:, None, None]
    x_CHW = np.moveaxis(rgb_HWC, -1, 0).astype(np.float64) * config.rescale_factor
    x_CHW = x_CHW.astype(np.float32)
    mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]
    return (x_CHW - mean) / std


def patchify(x_CHW: np.ndarray, config: ImageConfig) -> tuple[np.ndarray, int, int]:
    """Flattens one frame into f32[grid_h * grid_w, C*T*P*P] in the vision tower's order.

    Rows run over (grid_h/merge, grid_w/merge, merge, merge) so that each group of merge**2
    consecutive rows is one merged token; each row is (C, T, P, P) with the still image repeated
    T = temporal_patch_size times.
    """
    c, h, w = x_CHW.shape
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    if h % (p * m) or w % (p * m):
        raise ValueError(f"frame {h}x{w} is not a multiple of patch*merge = {p * m}")
    gh, gw = h // p, w // p
    x = x_CHW.reshape(c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, P, P)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    return np.ascontiguousarray(x).reshape(gh * gw, c * t * p * p), gh, gw


@functools.lru_cache(maxsize=16)
def normalize_table(config: ImageConfig) -> np.ndarray:
    """f32[3 * 256]: `normalize` of every uint8 value of every channel, channel-major.

    `normalize` is elementwise in (channel, value), so a lookup in this table gives its bits
    exactly, in either backend's dtypes.
    """
    values = np.broadcast_to(np.arange(256, dtype=np.uint8)[None, :, None], (1, 256, 3))
    return np.ascontiguousarray(normalize(values, config)).reshape(3 * 256)


def patch_bytes(rgb_HWC: np.ndarray, config: ImageConfig) -> tuple[np.ndarray, int, int]:
    """u8[grid_h * grid_w, C*P*P]: the frame's values in the vision tower's patch order.

    Rows run as `patchify`'s; each row is (C, P, P), one temporal frame: the bytes
    `patch_values` normalizes and repeats.
    """
    h, w, c = rgb_HWC.shape
    p, m = config.patch_size, config.merge_size
    if h % (p * m) or w % (p * m):
        raise ValueError(f"frame {h}x{w} is not a multiple of patch*merge = {p * m}")
    gh, gw = h // p, w // p
    x = rgb_HWC.reshape(gh // m, m, p, gw // m, m, p, c)
    # (gh/m, gw/m, m, m, C, P, P): one row a patch.
    x = np.ascontiguousarray(x.transpose(0, 3, 1, 4, 6, 2, 5)).reshape(gh * gw, c * p * p)
    return x, gh, gw


def lift_patch_bytes(rows_u8: np.ndarray, config: ImageConfig) -> np.ndarray:
    """f32[N, C*T*P*P] from `patch_bytes` rows u8[N, C*P*P]: `patch_values`' bits.

    Each value becomes its normalized float by a lookup in `normalize_table`, written into the
    temporally repeated layout. The model does the same on the device (vision.lift_pixels).
    """
    n = rows_u8.shape[0]
    c, t, pp = 3, config.temporal_patch_size, config.patch_size**2
    table = normalize_table(config).reshape(c, 256)
    x = rows_u8.reshape(n, c, pp)
    out = np.empty((n, c, t, pp), np.float32)
    for ch in range(c):
        out[:, ch] = np.take(table[ch], x[:, ch], mode="clip")[:, None]
    return out.reshape(n, c * t * pp)


def patch_values(rgb_HWC: np.ndarray, config: ImageConfig) -> tuple[np.ndarray, int, int]:
    """`patchify(normalize(rgb_HWC))`, bit for bit, in one pass over uint8 data.

    The frame is rearranged into patch order while it is still uint8 (a quarter of the f32
    bytes) and each value becomes its normalized float by one lookup per channel in
    `normalize_table`, written straight into the temporally duplicated rows: no float64 frame,
    no f32 frame and no f32 transpose (BENCHMARKS.md, "Screens into patches by table lookup").
    """
    rows, gh, gw = patch_bytes(rgb_HWC, config)
    return lift_patch_bytes(rows, config), gh, gw


def preprocess_images(
    images: Sequence[ImageLike], config: ImageConfig | None = None
) -> dict[str, np.ndarray]:
    """pixel_values f32[num_patches, C*T*P*P] (or, with pixel_dtype "uint8", the bytes
    u8[num_patches, C*P*P]) and image_grid_thw i32[n_images, 3].

    Rows of pixel_values are the images' patches one image after another, as transformers'
    processor concatenates them.
    """
    config = config or ImageConfig()
    patches, grids = [], []
    for image in images:
        rgb = to_rgb_array(image)
        h, w = smart_resize(
            rgb.shape[0], rgb.shape[1], config.factor, config.min_pixels, config.max_pixels
        )
        resize = resize_bicubic if config.resize_backend == "pil" else resize_bicubic_torchvision
        to_rows = patch_values if config.pixel_dtype == "float32" else patch_bytes
        frame = resize(rgb, h, w)
        flat, gh, gw = to_rows(frame, config)
        if np.may_share_memory(flat, frame):  # rows of their own, never a view of the caller's
            flat = flat.copy()
        patches.append(flat)
        grids.append((1, gh, gw))
    if not patches:
        return {
            "pixel_values": np.zeros((0, config.pixel_width), np.dtype(config.pixel_dtype)),
            "image_grid_thw": np.zeros((0, 3), np.int32),
        }
    return {  # one screen (a turn's): its rows as they are, not copied again
        "pixel_values": patches[0] if len(patches) == 1 else np.concatenate(patches, axis=0),
        "image_grid_thw": np.asarray(grids, dtype=np.int32),
    }


def num_image_tokens(grid_thw: Sequence[int] | np.ndarray, merge_size: int = 2) -> int:
    """Number of `<|image_pad|>` tokens for one image: t * h * w / merge_size**2."""
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w // merge_size**2


def image_grid_for_size(height: int, width: int, config: ImageConfig | None = None) -> np.ndarray:
    """i32[3] grid (1, h/P, w/P) an image of this size gets, without touching pixels."""
    config = config or ImageConfig()
    h, w = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    return np.asarray((1, h // config.patch_size, w // config.patch_size), np.int32)
