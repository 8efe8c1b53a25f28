"""Per-turn policies and recovery detours (cua_jax.rl.policies)."""

import numpy as np
import pytest

from cua_jax import actions as A
from cua_jax.rl import policies


def test_recovery_detours_pick_the_share_and_land_on_the_episodes_screen():
    detours = policies.recovery_detours(40, share=0.5, seed=1)
    clicks = [d for d in detours if d is not None]
    assert len(detours) == 40 and len(clicks) == 20
    for w, h in [(1920, 1080), (640, 480), (64, 64)]:
        pts = np.array([[c.x, c.y] for c in (d(w, h) for d in clicks)])
        assert (pts >= 0).all() and (pts[:, 0] < w).all() and (pts[:, 1] < h).all()
        assert pts[:, 0].max() > 0.75 * w and pts[:, 1].max() > 0.75 * h  # spread over the screen
        assert pts[:, 0].min() < 0.25 * w and pts[:, 1].min() < 0.25 * h
    for d in clicks:
        c = d(1000, 1000)
        assert isinstance(c, A.Click) and c.button == "left" and c.count == 1
        assert (c.x, c.y) == (float(int(d.fx * 1000)), float(int(d.fy * 1000)))
    assert policies.recovery_detours(40, share=0.0, seed=1) == [None] * 40
    assert None not in policies.recovery_detours(5, share=1.0, seed=1)
    assert len([d for d in policies.recovery_detours(8, share=0.25, seed=9) if d]) == 2
    # deterministic in (n, share, seed); another seed picks other episodes
    assert policies.recovery_detours(40, share=0.5, seed=1) == detours
    assert policies.recovery_detours(40, share=0.5, seed=2) != detours
    with pytest.raises(ValueError, match="share=1.5 must be in"):
        policies.recovery_detours(4, share=1.5, seed=0)


def test_recovery_detours_equal_the_trainers_former_draw():
    """Pinned to what train._recovery_detours(config, 8) drew for the smoke config (seed 0,
    recovery_share 0.25), i.e. numpy's default_rng(config.seed + 1): episodes 3 and 4."""
    detours = policies.recovery_detours(8, share=0.25, seed=1)
    got = [None if d is None else d(1000, 1000) for d in detours]
    assert got == [None] * 3 + [A.Click(549.0, 27.0), A.Click(753.0, 538.0)] + [None] * 3
    assert [detours[3](1920, 1080), detours[4](1920, 1080)] == [
        A.Click(1055.0, 29.0),
        A.Click(1446.0, 581.0),
    ]


@pytest.mark.parametrize("share,n", [(0.5, 40), (0.25, 8), (1.0, 5), (0.0, 7)])
def test_recovery_detours_match_the_trainers_while_it_has_its_own(share, n):
    """Same draws as the config-taking helper the trainer used before this module had one."""
    from configs.qwen3vl_grpo import get_config
    from cua_jax import train

    old = getattr(train, "_recovery_detours", None)
    if old is None:
        pytest.skip("train._recovery_detours is gone (the trainer calls policies.recovery_detours)")
    config = get_config("smoke")
    config.sft.recovery_share = share
    ref = old(config, n)
    mine = policies.recovery_detours(n, share=share, seed=config.seed + 1)
    for w, h in [(1920, 1080), (1280, 800), (64, 64)]:
        assert [d and d(w, h) for d in mine] == [d and d(w, h) for d in ref]
