import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cua_jax.checkpoint.orbax_io import Checkpointer, CheckpointError


def _state(seed):
    k = jax.random.PRNGKey(seed)
    return {
        "params": {"w": jax.random.normal(k, (4, 3)), "b": jnp.arange(3, dtype=jnp.float32)},
        "opt": {"count": jnp.asarray(seed, jnp.int32)},
        "rng": jax.random.PRNGKey(seed + 100),
    }


def test_save_restore_keep_and_meta(tmp_path):
    ck = Checkpointer(str(tmp_path / "ckpt"), keep=2, save_every=2)
    for step in range(1, 7):
        ck.save(step, _state(step), {"tasks_cursor": step * 10, "store": {"trained": step}})
    ck.wait()
    assert ck.all_steps() == [4, 6]  # every 2nd step, newest 2 kept
    assert ck.latest_step() == 6
    state, meta = ck.restore(jax.tree.map(jnp.zeros_like, _state(0)))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(_state(6)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert meta == {"tasks_cursor": 60, "store": {"trained": 6}, "step": 6}
    state4, meta4 = ck.restore(_state(0), step=4)
    assert meta4["tasks_cursor"] == 40
    np.testing.assert_array_equal(state4["params"]["w"], _state(4)["params"]["w"])
    ck.close()


def test_force_save_and_errors(tmp_path):
    ck = Checkpointer(str(tmp_path / "c"), keep=3, save_every=100)
    assert not ck.save(3, _state(3), {})
    assert ck.save(3, _state(3), {}, force=True)
    ck.wait()
    with pytest.raises(CheckpointError, match="step 5"):
        ck.restore(_state(0), step=5)
    bad = _state(0)
    bad["params"]["w"] = jnp.zeros((2, 2))
    with pytest.raises(CheckpointError, match="does not match"):
        ck.restore(bad)
    ck.close()
    with pytest.raises(CheckpointError, match="no checkpoint"):
        Checkpointer(str(tmp_path / "empty")).restore(_state(0))


def test_init_params_from_another_runs_checkpoint(tmp_path):
    """A new run starts from saved weights with another trainable set: a full fine-tuning
    checkpoint initialises a model whose learner freezes the vision tower."""
    from flax import nnx

    from cua_jax.checkpoint.orbax_io import init_params
    from cua_jax.models import qwen_vl
    from cua_jax.rl.learner import Learner

    cfg = qwen_vl.tiny("qwen3_vl", vocab_size=256)
    trained = qwen_vl.init_random(cfg, seed=1)
    ck = Checkpointer(str(tmp_path / "c"), keep=2)
    ck.save(7, Learner(trained, seq_len_buckets=(64,)).state_dict(), {}, force=True)
    ck.wait()
    fresh = qwen_vl.init_random(cfg, seed=2)
    n = init_params(fresh, Checkpointer(str(tmp_path / "c")).restore_params())
    want, got = nnx.state(trained, nnx.Param), nnx.state(fresh, nnx.Param)
    assert n == len(jax.tree.leaves(want))
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    frozen = Learner(fresh, seq_len_buckets=(64,), freeze_vision=True)  # other trainable set
    assert "visual" not in frozen.state_dict()["params"]["model"]
    # That run's own checkpoints hold only its trainable params; restoring one (resume, eval,
    # export) starts from the same init weights, so the frozen tower is the source's again.
    ck2 = Checkpointer(str(tmp_path / "run2"), keep=2)
    ck2.save(1, frozen.state_dict(), {}, force=True)
    ck2.wait()
    import ml_collections

    from cua_jax import train

    config = ml_collections.ConfigDict(
        {"ckpt": {"init_params_from": str(tmp_path / "c"), "init_params_step": -1}}
    )
    again = qwen_vl.init_random(cfg, seed=3)
    assert train.init_model_weights(again, config) == n
    resumed = Learner(again, seq_len_buckets=(64,), freeze_vision=True)
    state, _ = ck2.restore(resumed.abstract_state())
    resumed.load_state_dict(state)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(nnx.state(again, nnx.Param)),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert train.init_model_weights(again, ml_collections.ConfigDict({"ckpt": {}})) == 0
    other = qwen_vl.init_random(qwen_vl.tiny("qwen3_vl", vocab_size=512), seed=0)
    with pytest.raises(CheckpointError, match="has shape"):
        init_params(other, ck.restore_params())
    with pytest.raises(CheckpointError, match="step 3"):
        ck.restore_params(3)
    ck.close()
    # a run's workdir works as well as its checkpoints directory
    (tmp_path / "run1").mkdir()
    (tmp_path / "c").rename(tmp_path / "run1" / "checkpoints")
    config.ckpt.init_params_from = str(tmp_path / "run1")
    assert train.init_model_weights(again, config) == n
