import os
import subprocess
import time

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

    from cua_jax.job import train

    config = ml_collections.ConfigDict(
        {"ckpt": {"init_params_from": str(tmp_path / "c"), "init_params_step": -1}}
    )
    again = qwen_vl.init_random(cfg, seed=3)
    assert train.init_model_weights(again, config) == n
    resumed = Learner(again, seq_len_buckets=(64,), freeze_vision=True)
    state, _ = ck2.restore(resumed.abstract_state())
    resumed.load_state_dict(state)
    for a, b in zip(
        jax.tree.leaves(want), jax.tree.leaves(nnx.state(again, nnx.Param)), strict=True
    ):
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


# ---- faults: damaged checkpoints, another config, failed saves ---------------------------------


def _big_state(seed):
    """Random (incompressible) arrays, so each array's data file is its own and sizeable."""
    k = jax.random.PRNGKey(seed)
    return {"params": {"w": jax.random.normal(k, (128, 64)), "b": jnp.arange(3.0)}}


def _saved(tmp_path, steps=(1, 2, 3)):
    d = tmp_path / "ckpt"
    ck = Checkpointer(str(d), keep=5)
    for s in steps:
        ck.save(s, _big_state(s), {"cursor": s}, force=True)
    ck.close()
    return d


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _array_files(step_dir):
    return [p for p in step_dir.glob("state/**/d/*") if p.is_file()]


def test_truncated_array_file_names_the_intact_previous_step(tmp_path):
    d = _saved(tmp_path)
    for p in _array_files(d / "3"):  # truncated array data in the latest checkpoint
        _truncate(p)
    with pytest.raises(CheckpointError) as info:
        Checkpointer(str(d)).restore(_big_state(0))
    msg = str(info.value)
    assert f"checkpoint {d}/3 is damaged" in msg
    assert "newest intact checkpoint is step 2" in msg
    assert f"--config.ckpt.load_checkpoint_path={d}/2" in msg
    assert "different config" not in msg and "\n" not in msg
    # the flag's path works: a Checkpointer on one step's directory sees that step only
    one = Checkpointer(str(d / "2"))
    assert one.all_steps() == [2] and one.latest_step() == 2
    state, meta = one.restore(_big_state(0))
    np.testing.assert_array_equal(state["params"]["w"], _big_state(2)["params"]["w"])
    assert meta["cursor"] == 2
    with pytest.raises(CheckpointError, match="read-only"):
        one.save(4, _big_state(4), {}, force=True)
    np.testing.assert_array_equal(one.restore_params()["w"], _big_state(2)["params"]["w"])
    # and so does moving the damaged one aside
    (d / "3").rename(d / "3.damaged")
    assert Checkpointer(str(d)).latest_step() == 2
    state, _ = Checkpointer(str(d)).restore(_big_state(0))
    np.testing.assert_array_equal(state["params"]["w"], _big_state(2)["params"]["w"])


@pytest.mark.parametrize("what", ["meta/metadata", "state/_METADATA"])
def test_truncated_metadata_is_damage_not_another_config(tmp_path, what):
    d = _saved(tmp_path, steps=(1, 2))
    _truncate(d / "2" / what)
    with pytest.raises(CheckpointError, match=f"{d}/2 is damaged.*intact checkpoint is step 1"):
        Checkpointer(str(d)).restore(_big_state(0))
    state, _ = Checkpointer(str(d)).restore(_big_state(0), step=1)  # the intact one restores
    np.testing.assert_array_equal(state["params"]["w"], _big_state(1)["params"]["w"])
    _truncate(d / "1" / what)  # both damaged: says so
    with pytest.raises(CheckpointError, match="damaged.*no older checkpoint here is intact"):
        Checkpointer(str(d)).restore(_big_state(0))


def test_another_config_names_the_first_differing_key(tmp_path):
    d = _saved(tmp_path, steps=(1,))
    wide = _big_state(0)
    wide["params"]["w"] = jnp.zeros((128, 32))
    with pytest.raises(
        CheckpointError, match=r"`params/w` has shape \(128, 64\) in the checkpoint"
    ):
        Checkpointer(str(d)).restore(wide)
    more = _big_state(0)
    more["opt"] = {"mu": jnp.zeros(3)}
    with pytest.raises(CheckpointError, match="the checkpoint has no `opt/mu`"):
        Checkpointer(str(d)).restore(more)
    fewer = {"params": {"w": jnp.zeros((128, 64))}}
    with pytest.raises(CheckpointError, match="the checkpoint has `params/b`, which the model"):
        Checkpointer(str(d)).restore(fewer)


def test_learner_checkpoint_with_truncated_meta_is_damage(tmp_path):
    """The tree comparison reads optax's state (named tuples) as saved: a damaged learner
    checkpoint is not mistaken for another config."""
    from cua_jax.models import qwen_vl
    from cua_jax.rl.learner import Learner

    learner = Learner(
        qwen_vl.init_random(qwen_vl.tiny("qwen3_vl", vocab_size=256), seed=1), seq_len_buckets=(64,)
    )
    ck = Checkpointer(str(tmp_path / "c"), keep=3)
    for s in (1, 2):
        ck.save(s, learner.state_dict(), {}, force=True)
    ck.close()
    _truncate(tmp_path / "c" / "2" / "meta" / "metadata")
    with pytest.raises(CheckpointError, match="2 is damaged.*intact checkpoint is step 1"):
        Checkpointer(str(tmp_path / "c")).restore(learner.abstract_state())


def test_failed_async_save_raises_at_the_next_save(tmp_path, monkeypatch):
    """A save that fails in the background (as orbax reports it: from wait_until_finished)
    stops the run at the next `save()` call, which the trainer makes every step."""
    ck = Checkpointer(str(tmp_path / "c"), keep=3, save_every=50)
    assert ck.save(0, _big_state(0), {}, force=True)
    ck.wait()
    mngr = ck._mngr

    def fail():
        raise ValueError("RESOURCE_EXHAUSTED: Failed writing: No space left on device [OS 28]")

    assert ck.save(50, _big_state(1), {})
    mngr.wait_until_finished()  # the save's thread has ended (behind the Checkpointer's back)...
    monkeypatch.setattr(mngr, "wait_until_finished", fail)  # ...with this error
    with pytest.raises(CheckpointError) as info:
        ck.save(51, _big_state(1), {})  # not a save step: still reports the failure
    msg = str(info.value)
    assert "saving checkpoint step 50" in msg and "No space left" in msg
    assert f"newest saved checkpoint is {tmp_path / 'c'}/0" in msg
    ck.close()  # the failure was raised already: close does not raise it again


def test_failed_save_raises_at_wait_and_close(tmp_path, monkeypatch):
    ck = Checkpointer(str(tmp_path / "c"), keep=3)
    assert ck.save(1, _big_state(1), {}, force=True)

    def fail():
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck._mngr, "wait_until_finished", fail)
    with pytest.raises(CheckpointError, match="step 1 .*No space left"):
        ck.wait()
    ck2 = Checkpointer(str(tmp_path / "c2"), keep=3)
    assert ck2.save(1, _big_state(1), {}, force=True)
    monkeypatch.setattr(ck2._mngr, "wait_until_finished", fail)
    with pytest.raises(CheckpointError, match="step 1 .*No space left"):
        ck2.close()


def test_synchronous_save_failure_names_the_step(tmp_path, monkeypatch):
    ck = Checkpointer(str(tmp_path / "c"), keep=3)

    def fail(*a, **k):
        raise PermissionError(13, "Permission denied", str(tmp_path / "c"))

    monkeypatch.setattr(ck._mngr, "save", fail)
    with pytest.raises(CheckpointError, match="saving checkpoint step 4 .*Permission denied"):
        ck.save(4, _big_state(4), {}, force=True)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (needs root and mount rights; skipped where there are none)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip() or r.returncode})")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_stops_at_the_first_failed_save(small_tmpfs):
    ck = Checkpointer(str(small_tmpfs / "c"), keep=3, save_every=5)
    big = {"params": {"w": jax.random.normal(jax.random.PRNGKey(0), (512, 1024))}}  # 2 MiB
    assert ck.save(0, big, {}, force=True)  # async: fails in the background
    with pytest.raises(CheckpointError, match="saving checkpoint step 0 .*(No space|RESOURCE)"):
        for step in range(1, 6):  # at the next save step (5) at the latest; with steps that
            time.sleep(1)  # take time, as train steps do, at the first step after the failure
            ck.save(step, big, {})
    ck.close()


def test_the_hinted_step_of_the_runs_own_checkpoints_resumes_the_run(tmp_path):
    """The damaged-checkpoint hint works for the run's own workdir: `load_checkpoint_path`
    naming one of its own steps resumes from it, later steps are set aside (not deleted), and
    the run saves its next steps into the same directory."""
    import ml_collections

    from cua_jax.job.train import _resume_source

    d = _saved(tmp_path)
    for p in _array_files(d / "3"):
        _truncate(p)
    cfg = ml_collections.ConfigDict({"ckpt": {"load_checkpoint_path": f"{d}/2", "keep": 5}})
    ck = Checkpointer(str(d), keep=5)
    source = _resume_source(cfg, ck)
    assert source is ck and ck.latest_step() == 2
    assert (d / "3.set_aside").is_dir() and not (d / "3").exists()
    state, meta = ck.restore(_big_state(0))
    assert meta["cursor"] == 2
    np.testing.assert_array_equal(state["params"]["w"], _big_state(2)["params"]["w"])
    ck.save(3, _big_state(33), {"cursor": 33}, force=True)
    ck.close()
    assert Checkpointer(str(d)).restore(_big_state(0))[1]["cursor"] == 33
    cfg.ckpt.load_checkpoint_path = f"{d}/7"
    with pytest.raises(ValueError, match="no step 7 in"):
        _resume_source(cfg, Checkpointer(str(d), keep=5))
