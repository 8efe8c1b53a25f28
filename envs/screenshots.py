"""Screenshot bytes -> ``u8[H, W, 3]`` RGB, the observation every env returns.

An env host may send a screen as a *frame* instead of a PNG (`encode_frame`: a 12-byte header,
then the RGB pixels compressed by zstd at level 1): on Chromium screens of the built-in pages
(640x480 and 1280x720) that is 3-8 kB against PNG's 6-14 kB, and it decodes in 0.05-0.17 ms
against 0.19-0.79 (3.4-5.8x less CPU; `tools/bench_decode.py`, BENCHMARKS "Screens as frames"),
and decode is CPU the one trainer process spends on every turn of a fleet. A host compresses
a frame in about 0.2 ms after decoding the browser's PNG itself: hosts are many, the trainer
is one. `decode_screenshot` takes either, by its first bytes.

A PNG goes through imagecodecs' ``png_decode``, anything else (JPEG, and PNG layouts it returns
in another form: grey+alpha, 16-bit) through Pillow. The result is the same array either way
(an alpha channel is dropped, as Pillow's ``convert("RGB")`` drops it); imagecodecs takes 8-14x
less CPU on browser and desktop screens (`tools/bench_decode.py`, BENCHMARKS "Screenshot
decode"). That matters where one process decodes a whole fleet's screens: the trainer.
"""

from __future__ import annotations

import io
import struct

import imagecodecs
import numpy as np
from PIL import Image

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FRAME_MAGIC = b"CUAF"  # then >HH height, width, 4 reserved bytes, zstd of u8[H, W, 3]
_FRAME_HEAD = struct.Struct(">4sHHI")


def encode_frame(img: np.ndarray, level: int = 1) -> bytes:
    """u8[H, W, 3] RGB -> a frame (see the module docstring)."""
    img = np.ascontiguousarray(img, np.uint8)
    if img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"a frame is u8[H, W, 3] RGB, got {img.dtype}{list(img.shape)}")
    h, w, _ = img.shape
    return _FRAME_HEAD.pack(FRAME_MAGIC, h, w, 0) + bytes(imagecodecs.zstd_encode(img, level))


def decode_frame(data: bytes) -> np.ndarray:
    """`encode_frame`'s inverse; ValueError naming what is wrong with a malformed frame."""
    if len(data) < _FRAME_HEAD.size:
        raise ValueError(f"a screen frame of {len(data)} bytes is shorter than its header")
    _, h, w, _ = _FRAME_HEAD.unpack_from(data)
    out = np.empty((h, w, 3), np.uint8)
    try:
        raw = imagecodecs.zstd_decode(data[_FRAME_HEAD.size :], out=out.reshape(-1))
    except Exception as e:  # imagecodecs raises its own ZstdError
        raise ValueError(f"a screen frame of {w}x{h} does not decompress: {e}") from None
    if len(raw) != h * w * 3:
        raise ValueError(f"a screen frame of {w}x{h} holds {len(raw)} bytes, not {h * w * 3}")
    return out


def decode_with_pillow(data: bytes) -> np.ndarray:
    """PNG/JPEG bytes -> u8[H, W, 3] RGB by Pillow (the reference, and the fallback)."""
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im if im.mode == "RGB" else im.convert("RGB"), dtype=np.uint8)


def decode_screenshot(data: bytes) -> np.ndarray:
    """PNG/JPEG bytes or a frame (`encode_frame`) -> u8[H, W, 3] RGB (C-contiguous; an
    image's pixels are Pillow's exactly)."""
    if data[:4] == FRAME_MAGIC:
        return decode_frame(data)
    if data[:8] == PNG_SIGNATURE:
        try:
            img = imagecodecs.png_decode(data)
        except imagecodecs.PngError:
            img = None  # let Pillow say what is wrong with it
        if img is not None and img.dtype == np.uint8 and img.ndim == 3:
            if img.shape[2] == 3:
                return img
            if img.shape[2] == 4:  # RGBA (or a palette with transparency): drop alpha
                return np.ascontiguousarray(img[..., :3])
    return decode_with_pillow(data)
