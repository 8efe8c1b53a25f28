"""What the learner-level attention tests share: a one-layer tiny Qwen3-VL config and a group
of random text-only episodes (one turn each) to pack."""

import dataclasses

import numpy as np

from cua_jax.models import qwen_vl
from cua_jax.rl.trajectory import Trajectory, Turn


def one_layer_config():
    tiny = qwen_vl.tiny("qwen3_vl", vocab_size=256)
    return tiny.replace(
        text=dataclasses.replace(tiny.text, num_hidden_layers=1),
        vision=dataclasses.replace(tiny.vision, depth=1, deepstack_visual_indexes=(0,)),
    )


def random_text_group(prompt_len=(4, 12), gen_len=(3, 9), size=4, seed=0) -> list[Trajectory]:
    """`size` one-turn episodes: prompts and generations of lengths drawn from the ranges."""
    rng = np.random.default_rng(seed)
    group = []
    for _ in range(size):
        p, n = rng.integers(0, 200, rng.integers(*prompt_len)), int(rng.integers(*gen_len))
        turn = Turn(p, rng.integers(0, 200, n), -rng.random(n) * 4)
        group.append(Trajectory("t", "g", [turn], reward=float(rng.random())))
    return group
