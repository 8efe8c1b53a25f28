"""The learner's FSDP training layout (`sharding.training_layout`): inside it activations keep
their rows over the batch axes and each weight is all-gathered over them just before its
matmul, except the LM head, which splits its vocabulary over them instead; outside it (the
sampler) nothing changes. Without it GSPMD kept the FSDP-sharded
weights in place and ran every row on every chip (BENCHMARKS.md "What was in 2b's temporaries
on v5e-8"); the compiled gradient program on a 4-device CPU mesh shows which it did."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cua_jax import sharding as shd
from cua_jax.rl.learner import Learner, LossConfig
from tests.rl.test_learner import CFG, _model, make_groups


@pytest.fixture(scope="module")
def mesh():
    return shd.make_mesh(1, 2, 2, devices=jax.devices()[:4])  # fsdp=2 x tensor=2


def _spec(fn, x, mesh):
    out = jax.jit(fn, in_shardings=NamedSharding(mesh, P()))(x)
    return out.sharding.spec


def test_weights_are_gathered_over_the_row_axes_only(mesh):
    w = jnp.zeros((8, 12))

    def fn(x):
        with shd.training_layout(mesh):
            return shd.gathered(x, ("embed", "mlp"))

    # embed -> fsdp (a row axis): whole; mlp -> tensor: still split
    assert tuple(_spec(fn, w, mesh)) in ((None, "tensor"),)


def test_activations_keep_their_rows_over_the_batch_axes(mesh):
    def fn(x):
        with shd.training_layout(mesh):
            return shd.constrain(x * 2, ("batch", None, None))

    assert tuple(_spec(fn, jnp.zeros((4, 3, 5)), mesh))[0] in ("fsdp", ("data", "fsdp"))


def test_the_head_splits_its_vocabulary_over_the_row_axes_and_tensor(mesh):
    w = jnp.zeros((16, 12))  # (vocab, embed): vocab -> tensor, embed -> fsdp

    def fn(x):
        with shd.training_layout(mesh):
            w, logits_spec = shd.vocab_parallel(x, ("vocab", "embed"), 0)
            assert tuple(logits_spec) == (None, None, ("fsdp", "tensor"))
            return w

    assert tuple(_spec(fn, w, mesh))[0] == ("fsdp", "tensor")  # the embed dim whole
    with shd.training_layout(mesh):  # 4 does not divide 10: the gathered head instead
        assert shd.vocab_parallel(jnp.zeros((10, 12)), ("vocab", "embed"), 0) is None
    assert shd.vocab_parallel(w, ("vocab", "embed"), 0) is None  # outside a training layout


def test_outside_a_training_layout_nothing_is_constrained():
    x = jnp.ones((3, 5))
    assert shd.gathered(x, ("embed", "mlp")) is x
    assert shd.constrain(x, ("batch", None)) is x


def test_rows_the_batch_axes_cannot_divide_are_an_error(mesh):
    with shd.training_layout(mesh), pytest.raises(shd.MeshError, match="activation dim 3"):
        shd.constrain(jnp.zeros((3, 4)), ("batch", None))


def test_the_learners_program_runs_each_row_on_one_chip_only():
    """The RL step of the tiny model (text rows) on a 4-device FSDP mesh: its decoder's
    MLP activations are [rows / 4, L, F] a chip, never the whole batch's [rows, L, F] (23 such
    buffers without the layout). Its values equal one device's: tests/rl/test_learner.py."""
    mesh = shd.make_mesh(1, 4, 1, devices=jax.devices()[:4])
    learner = Learner(_model(), mesh=mesh, loss=LossConfig(), seq_len_buckets=(64,))
    batch, _ = learner.prepare_batch(make_groups(seed=3, n_groups=2, images=False))
    rows, length = batch.shape
    txt = learner.lower_step(batch).compile().as_text()
    f = CFG.text.intermediate_size
    whole = re.findall(rf"\[{rows},{length},{f}\]", txt)
    local = re.findall(rf"\[{rows // 4},{length},{f}\]", txt)
    assert not whole and local, (len(whole), len(local))
    # the vocabulary-parallel head: every row's logits against a quarter of the vocabulary
    # (the next-token positions: length - 1), never a row's logits over the whole vocabulary
    v = CFG.text.vocab_size
    assert re.search(rf"f32\[{rows},{length - 1},{v // 4}\]", txt)
    assert not re.search(rf"f32\[{rows // 4},{length - 1},{v}\]", txt)


def test_the_sdpo_teacher_pass_and_the_entropy_probe_run_each_row_on_one_chip_only():
    """The learner's other programs that run the model over a batch (SDPO's teacher pass,
    Entropulse's entropy probe) trace in the same layout: no [rows, L, F] buffer either."""
    from cua_jax.rl import entropulse, sdpo

    mesh = shd.make_mesh(1, 4, 1, devices=jax.devices()[:4])
    learner = Learner(_model(), mesh=mesh, loss=LossConfig(), seq_len_buckets=(64,))
    batch, _ = learner.prepare_batch(make_groups(seed=3, n_groups=2, images=False))
    rows, length = batch.shape
    f = CFG.text.intermediate_size
    (part, _), *_ = learner.chunks(batch)
    state = (learner._trainable, learner._frozen, learner._rest)
    xs, images = learner.layout.device_batch(part, substeps=learner.num_substeps)
    teacher = sdpo._teacher_jit(learner, 0, {}).lower(*state, xs, images)
    cache = {}
    entropulse.policy_entropy(learner, batch, cache)  # compiles and runs the probe
    xs1, images1 = learner.layout.device_batch(part, substeps=1)
    probe = cache["entropy"].lower(*state, xs1, images1)
    for name, lowered in (("teacher", teacher), ("entropy", probe)):
        txt = lowered.compile().as_text()
        whole = re.findall(rf"\[{rows},{length},{f}\]", txt)
        local = re.findall(rf"\[{rows // 4},{length},{f}\]", txt)
        assert not whole and local, (name, len(whole), len(local))
