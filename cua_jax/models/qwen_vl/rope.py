"""Rotary position embeddings for Qwen-VL: M-RoPE cos/sin tables. The position ids come from
the host (`get_rope_index`, in `cua_jax.data.positions`: numpy, no JAX; imported here too).

Letters: B batch, T tokens, H head dim, F = H/2 rotary frequencies.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from cua_jax.data.positions import get_rope_index  # noqa: F401 -- the model's API


def text_positions(batch: int, seq_len: int) -> np.ndarray:
    """Plain positions i32[3, B, T] = arange(T) on all axes (what transformers uses for text)."""
    return np.broadcast_to(np.arange(seq_len, dtype=np.int32), (3, batch, seq_len)).copy()


def mrope_axis_of_freq(
    head_dim: int, mrope_section: tuple[int, ...], interleaved: bool
) -> np.ndarray:
    """i32[F]: which position axis (0=t, 1=h, 2=w) drives each rotary frequency.

    Qwen2.5-VL uses contiguous blocks [t]*s0 + [h]*s1 + [w]*s2; Qwen3-VL interleaves them
    (t h w t h w ...) for the first 3*s1 / 3*s2 frequencies, the rest stay t.
    """
    F = head_dim // 2
    if interleaved:
        axis = np.zeros(F, np.int32)
        axis[1 : mrope_section[1] * 3 : 3] = 1
        axis[2 : mrope_section[2] * 3 : 3] = 2
        return axis
    return np.repeat(np.arange(3, dtype=np.int32), mrope_section)


def mrope_cos_sin(
    position_ids_3BT: jnp.ndarray,
    head_dim: int,
    theta: float,
    mrope_section: tuple[int, ...],
    interleaved: bool,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(cos, sin) f32[B, T, H] for M-RoPE, laid out for `rotate_half` (halves duplicated)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    axis = mrope_axis_of_freq(head_dim, mrope_section, interleaved)
    pos_BTF = jnp.moveaxis(position_ids_3BT.astype(jnp.float32), 0, -1)[..., axis]  # f32[B,T,F]
    freqs = pos_BTF * jnp.asarray(inv_freq, jnp.float32)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def vision_cos_sin(pos_hw_N2: jnp.ndarray, head_dim: int, theta: float) -> tuple[jnp.ndarray, ...]:
    """(cos, sin) f32[N, H] of the vision tower's 2-D axial rotary for (h, w) patch coordinates."""
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial))
    f = (
        pos_hw_N2.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    )  # f32[N, 2, H/4]
    f = jnp.concatenate([f[:, 0], f[:, 1]], axis=-1)  # f32[N, H/2]
    emb = jnp.concatenate([f, f], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def rotate_half(x: jnp.ndarray) -> jnp.ndarray:
    h = x.shape[-1] // 2
    return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def apply_rotary(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x[..., N, H] with cos/sin[..., H] broadcast over the head axis N; computed in f32."""
    xf = x.astype(jnp.float32)
    c, s = cos[..., None, :], sin[..., None, :]
    return (xf * c + rotate_half(xf) * s).astype(x.dtype)
