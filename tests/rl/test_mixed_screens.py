"""Screens of two sizes in one token-budget batch (envs at different resolutions): the packer
buckets them, one size a chunk, and every chunk's screens are grouped by (micro-batch, device)
and sharded, never the replicated flat layout; on a 4-device mesh the step's loss, gradients
and log-probs equal one device's flat one-call step on the same samples."""

import numpy as np
import pytest

from cua_jax.rl import batching, image_groups
from cua_jax.rl.learner import Learner, LossConfig
from cua_jax.rl.trajectory import Trajectory, Turn, rope_position_fn, trajectory_to_samples
from tests.rl.test_learner import CFG, PATCH_DIM, _model
from tests.rl.test_token_budget import GRID, OPT, _budget_learner, _close, _per_token
from tests.rl.test_token_budget import mesh4 as mesh4  # the module's fixture

WIDE = (1, 4, 8)  # 32 patches, 8 merged tokens: twice the run's screen


def _prompt(rng, grid):
    tokens = grid[1] * grid[2] // 4
    return np.r_[
        rng.integers(0, 200, rng.integers(2, 6)),
        CFG.vision_start_token_id,
        [CFG.image_token_id] * tokens,
        CFG.vision_end_token_id,
        rng.integers(0, 200, 2),
    ]


def mixed_groups(seed=0, n_groups=4, group_size=4):
    """GRPO groups whose episodes' screens are the run's 4x4 (even groups) or 4x8 (odd), with
    some text-only episodes."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        grid = GRID if g % 2 == 0 else WIDE
        grp = []
        for i in range(group_size):
            img = i % 3 != 2
            prompt = _prompt(rng, grid) if img else rng.integers(0, 200, rng.integers(4, 12))
            gen = rng.integers(0, 200, rng.integers(3, 8))
            n = int(np.prod(grid))
            turn = Turn(
                prompt,
                gen,
                -rng.random(gen.size) * 3,
                pixel_values=rng.normal(size=(n, PATCH_DIM)).astype(np.float32) if img else None,
                image_grid_thw=np.array([grid]) if img else None,
            )
            grp.append(Trajectory("task", f"g{g}", [turn], reward=float(rng.random())))
        groups.append(grp)
    return groups


def test_screen_buckets_put_the_runs_size_first_and_text_with_it():
    pos = rope_position_fn(CFG)
    samples = [s for g in mixed_groups() for t in g for s in trajectory_to_samples(t, 0.5, pos)]
    buckets = batching.screen_buckets(samples, GRID)
    assert [g for g, _ in buckets] == [GRID, WIDE]
    assert sum(len(b) for _, b in buckets) == len(samples)
    assert all(batching.sample_grid(s) in (GRID, None) for s in buckets[0][1])
    assert all(batching.sample_grid(s) == WIDE for s in buckets[1][1])
    # one size only: one bucket, the samples as given
    only = [s for s in samples if batching.sample_grid(s) != WIDE]
    ((grid, same),) = batching.screen_buckets(only, GRID)
    assert grid == GRID and [id(s) for s in same] == [id(s) for s in only]


def test_mixed_screens_are_bucketed_and_sharded_and_equal_one_device(mesh4):
    groups = mixed_groups(seed=3)
    budget = _budget_learner(mesh4, group_screens=8, tokens=64)
    batch, _ = budget.prepare_batch(groups)
    grids = set(batch.chunk_grids)
    assert grids == {GRID, WIDE} and len(batch.chunk_grids) == batch.chunks
    parts = budget.chunks(batch)
    for part, _ in parts:
        _, images = budget.layout.device_batch(part, 1)
        assert isinstance(images, image_groups.ImageGroups)  # never the flat layout
        (grid,) = part.chunk_grids
        assert all(tuple(g) == grid for g in np.asarray(part.image_grid_thw).reshape(-1, 3))
        # the groups are sharded over the 4 devices, each holding its own rows' screens
        assert images.pixel_values.sharding.shard_shape(images.pixel_values.shape)[1] == 1

    one = Learner(_model(), optimizer=OPT, loss=LossConfig(kl_coef=0.05), seq_len_buckets=(64,))
    ref, _ = one.prepare_batch(groups, num_rows=32)
    m_b, g_b = budget.loss_and_grads(batch)
    m_1, g_1 = one.loss_and_grads(ref)
    assert m_b["num_tokens"] == m_1["num_tokens"]
    for k in ("loss", "pg_loss", "kl", "grad_norm"):
        assert m_b[k] == pytest.approx(m_1[k], rel=1e-4, abs=1e-7), k
    _close(g_b, g_1)
    np.testing.assert_allclose(
        _per_token(budget.token_logprobs(batch), batch),
        _per_token(one.token_logprobs(ref), ref),
        rtol=1e-5,
        atol=1e-6,
    )


def test_a_sample_of_two_screen_sizes_goes_flat_and_still_equals_one_device(mesh4):
    """An episode whose screens change size mid-way (one sample of a 4x4 and a 4x8 screen) is
    the one case left flat: its chunk takes the replicated layout; the step still equals one
    device's."""
    rng = np.random.default_rng(5)
    groups = mixed_groups(seed=5, n_groups=2)
    t0 = Turn(
        _prompt(rng, GRID),
        rng.integers(0, 200, 4),
        -rng.random(4),
        pixel_values=rng.normal(size=(16, PATCH_DIM)).astype(np.float32),
        image_grid_thw=np.array([GRID]),
    )
    t1 = Turn(
        np.r_[t0.full_ids, _prompt(rng, WIDE)],
        rng.integers(0, 200, 3),
        -rng.random(3),
        pixel_values=rng.normal(size=(32, PATCH_DIM)).astype(np.float32),
        image_grid_thw=np.array([WIDE]),
        extends_previous=True,
    )
    groups[0][0] = Trajectory("task", "g0", [t0, t1], reward=0.9)
    budget = _budget_learner(mesh4, group_screens=8, tokens=64)
    batch, _ = budget.prepare_batch(groups)
    assert None in batch.chunk_grids
    kinds = []
    for part, _ in budget.chunks(batch):
        _, images = budget.layout.device_batch(part, 1)
        kinds.append((part.chunk_grids[0], isinstance(images, image_groups.ImageGroups)))
    assert (None, False) in kinds and all(grouped for g, grouped in kinds if g is not None)
    one = Learner(_model(), optimizer=OPT, loss=LossConfig(kl_coef=0.05), seq_len_buckets=(64,))
    ref, _ = one.prepare_batch(groups, num_rows=32)
    m_b, g_b = budget.loss_and_grads(batch)
    m_1, g_1 = one.loss_and_grads(ref)
    for k in ("loss", "pg_loss", "kl", "grad_norm"):
        assert m_b[k] == pytest.approx(m_1[k], rel=1e-4, abs=1e-7), k
    _close(g_b, g_1)
