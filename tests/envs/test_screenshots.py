"""`envs.screenshots.decode_screenshot` against Pillow, the reference, on every PNG layout a
screen can come in (and JPEG, which goes to Pillow itself): the same u8[H, W, 3] pixels; a host's
frame (`encode_frame`) round-trips, and a malformed one is a clear error."""

import io

import numpy as np
import pytest
from PIL import Image

from envs import screenshots
from envs.screenshots import FRAME_MAGIC, decode_screenshot, decode_with_pillow, encode_frame


def _image(mode: str) -> Image.Image:
    rng = np.random.default_rng(0)
    rgba = rng.integers(0, 256, size=(37, 53, 4), dtype=np.uint8)
    rgba[5:20, 10:40] = (200, 30, 30, 128)  # a flat block, as screens have
    im = Image.fromarray(rgba, "RGBA")
    if mode == "P_trns":
        p = im.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
        p.info["transparency"] = 3
        return p
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65536, size=(37, 53), dtype=np.uint16))
    return im.convert(mode)


def _encode(im: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    im.save(
        buf,
        format=fmt,
        **({"transparency": im.info["transparency"]} if "transparency" in im.info else {}),
    )
    return buf.getvalue()


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P", "P_trns", "I;16", "1"])
def test_png_layouts_decode_to_pillows_pixels(mode):
    data = _encode(_image(mode))
    out = decode_screenshot(data)
    ref = decode_with_pillow(data)
    assert out.dtype == np.uint8 and out.shape == (37, 53, 3) and out.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "P_trns"])
def test_colour_pngs_never_reach_pillow(mode, monkeypatch):
    """Browser and desktop screens (RGB, RGBA) take the fast path."""
    data = _encode(_image(mode))
    ref = decode_with_pillow(data)

    def no_pillow(_):
        raise AssertionError("fell back to Pillow")

    monkeypatch.setattr(screenshots, "decode_with_pillow", no_pillow)
    np.testing.assert_array_equal(screenshots.decode_screenshot(data), ref)


def test_jpeg_goes_to_pillow():
    data = _encode(_image("RGB"), "JPEG")
    np.testing.assert_array_equal(decode_screenshot(data), decode_with_pillow(data))


def test_a_broken_png_is_pillows_error():
    data = _encode(_image("RGB"))
    with pytest.raises(OSError):
        decode_screenshot(data[:60])


def test_a_frame_round_trips_and_a_malformed_one_is_a_clear_error():
    rng = np.random.default_rng(0)
    img = np.full((48, 64, 3), 245, np.uint8)
    img[10:20, 5:40] = rng.integers(0, 256, (10, 35, 3), np.uint8)
    frame = encode_frame(img)
    assert frame[:4] == FRAME_MAGIC and len(frame) < img.nbytes
    out = decode_screenshot(frame)
    assert out.dtype == np.uint8 and out.shape == img.shape and np.array_equal(out, img)
    assert out.flags.c_contiguous and out.flags.writeable
    with pytest.raises(ValueError, match="shorter than its header"):
        decode_screenshot(frame[:8])
    with pytest.raises(ValueError, match="a screen frame of 64x48"):
        decode_screenshot(frame[:-5])
    with pytest.raises(ValueError, match=r"u8\[H, W, 3\] RGB"):
        encode_frame(img[..., 0])
