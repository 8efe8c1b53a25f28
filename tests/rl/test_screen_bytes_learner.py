"""The learner on screens as bytes: the same step as on their float pixel values, and a batch in
the other form refused with the reason."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from cua_jax.data.image import lift_patch_bytes
from cua_jax.models import qwen_vl
from cua_jax.rl.learner import Learner, LossConfig
from tests.rl.test_learner import CFG, make_groups


def _as_bytes(groups, seed=1):
    """The groups with each screen replaced by random bytes; and a copy with their floats."""
    rng = np.random.default_rng(seed)
    image = CFG.pixel_config
    as_u8, as_f32 = [], []
    for grp in groups:
        g8, g32 = [], []
        for traj in grp:
            t8 = dataclasses.replace(traj, turns=[dataclasses.replace(t) for t in traj.turns])
            t32 = dataclasses.replace(traj, turns=[dataclasses.replace(t) for t in traj.turns])
            for a, b in zip(t8.turns, t32.turns, strict=True):
                if a.pixel_values is not None:
                    rows = rng.integers(0, 256, (a.pixel_values.shape[0], 3 * 16 * 16), np.uint8)
                    a.pixel_values, b.pixel_values = rows, lift_patch_bytes(rows, image)
            g8.append(t8)
            g32.append(t32)
        as_u8.append(g8)
        as_f32.append(g32)
    return as_u8, as_f32


def test_a_step_on_bytes_equals_the_step_on_their_floats():
    groups8, groups32 = _as_bytes(make_groups())
    learners = {
        form: Learner(
            qwen_vl.QwenVL(CFG.replace(pixel_dtype=form), rngs=nnx.Rngs(0)),
            loss=LossConfig(),
            seq_len_buckets=(64,),
        )
        for form in ("uint8", "float32")
    }
    b8, _ = learners["uint8"].prepare_batch(groups8, num_rows=8)
    b32, _ = learners["float32"].prepare_batch(groups32, num_rows=8)
    assert b8.pixel_values.dtype == np.uint8 and b8.pixel_values.nbytes * 8 == (
        b32.pixel_values.nbytes
    )
    for _ in range(2):
        m8, m32 = learners["uint8"].train_step(b8), learners["float32"].train_step(b32)
        assert m8["loss"] == pytest.approx(m32["loss"], rel=1e-6, abs=1e-7)
        assert m8["grad_norm"] == pytest.approx(m32["grad_norm"], rel=1e-5)
    with pytest.raises(ValueError, match=r"screens are float32.*takes uint8 rows of 768"):
        learners["uint8"].train_step(b32)
