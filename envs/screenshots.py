"""Screenshot bytes -> ``u8[H, W, 3]`` RGB, the observation every env returns.

A PNG goes through imagecodecs' ``png_decode``, anything else (JPEG, and PNG layouts it returns
in another form: grey+alpha, 16-bit) through Pillow. The result is the same array either way
(an alpha channel is dropped, as Pillow's ``convert("RGB")`` drops it); imagecodecs takes 8-14x
less CPU on browser and desktop screens (`tools/bench_decode.py`, BENCHMARKS "Screenshot
decode"). That matters where one process decodes a whole fleet's screens: the trainer.
"""

from __future__ import annotations

import io

import imagecodecs
import numpy as np
from PIL import Image

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def decode_with_pillow(data: bytes) -> np.ndarray:
    """PNG/JPEG bytes -> u8[H, W, 3] RGB by Pillow (the reference, and the fallback)."""
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im if im.mode == "RGB" else im.convert("RGB"), dtype=np.uint8)


def decode_screenshot(data: bytes) -> np.ndarray:
    """PNG/JPEG bytes -> u8[H, W, 3] RGB (C-contiguous, Pillow's pixels exactly)."""
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
