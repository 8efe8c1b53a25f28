"""Expert parallelism by all-to-all (`moe_dispatch="all_to_all"`) on 4 and 8 forced host devices,
against one device: forward output and gradients (tokens, router, expert stacks, expert LoRA,
shared expert) of the Qwen3-VL-MoE block and the Qwen3.5-MoE block (shared expert), with routing
replay and a router biased so one expert gets most rows; a token count the mesh does not divide
(padding). The CPU emulation of `ragged_all_to_all` against the op's documented semantics
(numpy), and the dispatch switch.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cua_jax import sharding as shd
from cua_jax.models import lora, qwen_vl
from cua_jax.models.qwen_vl import moe
from cua_jax.models.qwen_vl.qwen35 import SharedExpertMoeBlock

B, T = 3, 5  # 15 tokens: the 4 expert devices get 4 each, one padding token


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _mesh(**axes):
    return shd.make_mesh(
        data=1, fsdp=1, devices=jax.devices()[: int(np.prod(list(axes.values())))], **axes
    )


# ------------------------------------------------------------------ the emulated collective
def _emulated(mesh, operand, out_rows, in_off, send, out_off, recv, chunk):
    spec = jax.sharding.PartitionSpec("expert")

    def f(operand, in_off, send, out_off, recv):
        out = jnp.zeros((out_rows, *operand.shape[1:]), operand.dtype)
        return moe.ragged_all_to_all_emulated(
            operand, out, in_off, send, out_off, recv, axis_name="expert", chunk=chunk
        )

    args = [np.concatenate(a) for a in (operand, in_off, send, out_off, recv)]
    fn = jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)
    return np.asarray(jax.jit(fn)(*args)).reshape(len(operand), out_rows, *operand[0].shape[1:])


def test_emulated_ragged_all_to_all_matches_documented_semantics():
    # jax.lax.ragged_all_to_all's docstring example (an axis of size 2)
    mesh2 = shd.make_mesh(data=1, fsdp=1, devices=jax.devices()[:2], expert=2)
    i32 = lambda *v: np.asarray(v, np.int32)  # noqa: E731
    got = _emulated(
        mesh2,
        [np.asarray([1, 2, 2], np.float32), np.asarray([3, 4, 0], np.float32)],
        4,
        [i32(0, 1), i32(0, 1)],
        [i32(1, 2), i32(1, 1)],
        [i32(0, 0), i32(1, 2)],
        [i32(1, 1), i32(2, 1)],
        chunk=2,
    )
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])
    # random slice sizes with gaps on both sides, 4 devices, against a numpy reference
    rng = np.random.default_rng(0)
    P, rows, out_rows, D = 4, 12, 20, 3
    S = rng.integers(0, 4, size=(P, P)).astype(np.int32)  # S[s, j]: rows s sends to j
    in_off = (np.cumsum(S, 1) - S + rng.integers(0, 2, size=(P, 1))).astype(np.int32)
    out_off = (np.cumsum(S, 0) - S + rng.integers(0, 3, size=(1, P))).astype(np.int32)
    ops = [rng.normal(size=(rows, D)).astype(np.float32) for _ in range(P)]
    want = np.zeros((P, out_rows, D), np.float32)
    for s in range(P):
        for j in range(P):
            n = S[s, j]
            want[j, out_off[s, j] : out_off[s, j] + n] = ops[s][in_off[s, j] : in_off[s, j] + n]
    got = _emulated(
        _mesh(expert=4), ops, out_rows, list(in_off), list(S), list(out_off), list(S.T), chunk=4
    )
    np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------- the blocks, 4 devices
def _block(family):
    if family == "qwen3_vl":
        block = moe.SparseMoeBlock(qwen_vl.tiny("qwen3_vl", moe=True), rngs=nnx.Rngs(1))
    else:
        block = SharedExpertMoeBlock(qwen_vl.tiny_qwen35_moe(), rngs=nnx.Rngs(1))
    assert block.dispatch == "auto"  # the default
    lora.apply_lora(block, 4, 8.0, (r"experts$",), rngs=nnx.Rngs(2))
    rng = np.random.default_rng(3)
    for _, var in nnx.to_flat_state(nnx.state(block, nnx.LoRAParam)):
        var.set_value(jnp.asarray(0.05 * rng.normal(size=var.get_value().shape), jnp.float32))
    # A router biased towards expert 0 (the tokens have a positive mean): uneven loads.
    block.gate.kernel[...] = block.gate.kernel[...] * 10.0
    block.gate.kernel[:, 0] = block.gate.kernel[:, 0] + 0.3
    block.experts.base_module.down_proj[...] = block.experts.base_module.down_proj[...] * 20.0
    return block


def _grads(block, x, routes):
    graphdef, state = nnx.split(block)

    @jax.jit
    def f(state, x, routes):
        def loss(state, x):
            y, logits, experts = nnx.merge(graphdef, state)(x, routes)
            return jnp.sum(jnp.sin(y)), (y, experts)

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(state, x)

    (g_state, g_x), (y, experts) = f(state, x, routes)
    flat = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(g_state)}
    return np.asarray(y), np.asarray(experts), flat, np.asarray(g_x)


@pytest.fixture(scope="module")
def one_device(request):
    block = _block(request.param)
    D = block.gate.kernel.shape[0]
    x = jax.random.normal(jax.random.key(5), (B, T, D)) + 0.5
    # routing replay: rows 0-1 replay recorded experts (most of them expert 0, plus 3), row 2
    # is unrecorded (-1) and uses the router's own top-k
    routes = np.full((B, T, 2), -1, np.int32)
    routes[:2, :, 0] = 0
    routes[:2, :, 1] = 3
    routes[1, 3] = (5, 6)
    return request.param, block, x, routes, _grads(block, x, routes)


@pytest.mark.parametrize(
    "one_device, axes",
    [
        ("qwen3_vl", dict(expert=2, tensor=2)),
        ("qwen3_vl", dict(expert=4, tensor=2)),
        ("qwen3_5", dict(expert=4)),
        ("qwen3_5", dict(expert=8)),
    ],
    ids=[
        "qwen3_vl-expert2xtensor2",
        "qwen3_vl-expert4xtensor2",
        "qwen3_5-expert4",
        "qwen3_5-expert8",
    ],
    indirect=["one_device"],
)
def test_all_to_all_forward_and_gradients_equal_one_device(one_device, axes):
    family, block, x, routes, (y_ref, e_ref, g_ref, gx_ref) = one_device
    load = np.bincount(e_ref.reshape(-1), minlength=8) / e_ref.size
    assert load[0] >= 0.4, load  # uneven: expert 0 holds nearly half of all rows
    np.testing.assert_array_equal(e_ref[:2], routes[:2])  # replayed
    sharded = nnx.clone(block)
    shd.shard_model(sharded, _mesh(**axes))
    moe.set_expert_mesh(sharded, sharded.mesh, dispatch="all_to_all")
    assert sharded.mesh.shape["expert"] == axes["expert"] and sharded.dispatch == "all_to_all"
    y, e, g, gx = _grads(sharded, x, routes)
    np.testing.assert_array_equal(e, e_ref)
    assert _rel(y, y_ref) <= 1e-5
    assert _rel(gx, gx_ref) <= 1e-5
    want = {
        "gate.kernel",
        "experts.base_module.gate_up_proj",
        "experts.base_module.down_proj",
        "experts.gate_up_lora.lora_a",
        "experts.gate_up_lora.lora_b",
        "experts.down_lora.lora_a",
        "experts.down_lora.lora_b",
    }
    assert want <= set(g) and set(g) == set(g_ref)
    for k in g_ref:
        assert np.abs(g_ref[k]).max() > 0, k
        # the router's gradient sums every token's softmax term (a router scaled x10: sharp)
        # in the mesh's order: 1.4e-5 seen on expert=2 x tensor=2, f32 reassociation
        assert _rel(g[k], g_ref[k]) <= (5e-5 if k == "gate.kernel" else 1e-5), k


# Each parameter's PartitionSpec and one device's shard of it on the 8-device meshes: the
# expert stacks split over `expert` (8 experts: 2 a device on expert=4, 1 on expert=8), their
# MLP width over `tensor`, the router and the shared expert's hidden side over `fsdp` (1 here).
GOLDEN = {
    ("qwen3_vl", (("expert", 4), ("tensor", 2))): {
        "experts.base_module.down_proj": (("expert", "tensor", "fsdp"), (2, 32, 128)),
        "experts.base_module.gate_up_proj": (("expert", "fsdp", None, "tensor"), (2, 128, 2, 32)),
        "experts.down_lora.lora_a": (("expert", "tensor", None), (2, 32, 4)),
        "experts.down_lora.lora_b": (("expert", None, "fsdp"), (2, 4, 128)),
        "experts.gate_up_lora.lora_a": (("expert", "fsdp", None), (2, 128, 4)),
        "experts.gate_up_lora.lora_b": (("expert", None, None, "tensor"), (2, 4, 2, 32)),
        "gate.kernel": (("fsdp", None), (128, 8)),
    },
    ("qwen3_5", (("expert", 8),)): {
        "experts.base_module.down_proj": (("expert", "tensor", "fsdp"), (1, 64, 128)),
        "experts.base_module.gate_up_proj": (("expert", "fsdp", None, "tensor"), (1, 128, 2, 64)),
        "experts.down_lora.lora_a": (("expert", "tensor", None), (1, 64, 4)),
        "experts.down_lora.lora_b": (("expert", None, "fsdp"), (1, 4, 128)),
        "experts.gate_up_lora.lora_a": (("expert", "fsdp", None), (1, 128, 4)),
        "experts.gate_up_lora.lora_b": (("expert", None, None, "tensor"), (1, 4, 2, 64)),
        "gate.kernel": (("fsdp", None), (128, 8)),
        "shared_expert.down_proj.kernel": (("tensor", "fsdp"), (96, 128)),
        "shared_expert.gate_proj.kernel": (("fsdp", "tensor"), (128, 96)),
        "shared_expert.up_proj.kernel": (("fsdp", "tensor"), (128, 96)),
        "shared_expert_gate.kernel": (("fsdp", None), (128, 1)),
    },
}


@pytest.mark.parametrize("family, axes", sorted(GOLDEN), ids=lambda v: str(v))
def test_expert_parallel_shardings_on_8_devices_are_the_golden_ones(family, axes):
    block = _block(family)
    shd.shard_model(block, _mesh(**dict(axes)))
    got = {}
    for path, var in nnx.to_flat_state(nnx.state(block)):
        x = var.get_value()
        shards = {tuple(s.data.shape) for s in x.addressable_shards}
        assert len(shards) == 1 and len(x.addressable_shards) == 8, (path, shards)
        got[".".join(map(str, path))] = (tuple(x.sharding.spec), shards.pop())
    assert got == GOLDEN[family, axes]


def test_dispatch_switch_and_errors():
    """Both dispatches give the one-device output (forward, expert=4 on 4 devices), each program
    with its own collective; bad names are one-line errors."""
    block = moe.SparseMoeBlock(qwen_vl.tiny("qwen3_vl", moe=True), rngs=nnx.Rngs(0))
    block.gate.kernel[...] = block.gate.kernel[...] * 30.0
    x = jax.random.normal(jax.random.key(1), (2, 4, block.gate.kernel.shape[0]))
    fn = jax.jit(lambda s, x, g: nnx.merge(g, s)(x)[0], static_argnums=2)
    graphdef, state = nnx.split(block)
    want = np.asarray(fn(state, x, graphdef))
    for dispatch, collective in (("all_to_all", "all_to_all"), ("all_gather", "all_reduce")):
        b = nnx.clone(block)
        moe.set_expert_mesh(b, _mesh(expert=4), dispatch=dispatch)
        graphdef, state = nnx.split(b)
        lowered = fn.lower(state, x, graphdef)
        text = lowered.as_text()
        assert collective in text and (dispatch == "all_to_all") == ("all_to_all" in text)
        assert _rel(lowered.compile()(state, x), want) <= 1e-5, dispatch
    split = (("batch", ("data", "fsdp", "expert")), *shd.DEFAULT_RULES[1:])
    assert shd.DEFAULT_RULES[0][0] == "batch"
    assert not moe.choose_all_to_all("auto", shd.DEFAULT_RULES, ("expert",))
    assert moe.choose_all_to_all("auto", split, ("expert",))
    assert moe.choose_all_to_all("all_to_all", shd.DEFAULT_RULES, ("expert",))
    assert not moe.choose_all_to_all("all_gather", split, ("expert",))
    with pytest.raises(ValueError, match="moe_dispatch='scatter'"):
        qwen_vl.tiny("qwen3_vl", moe=True).replace(moe_dispatch="scatter")
    with pytest.raises(ValueError, match="dispatch='scatter'"):
        block.use_mesh(None, dispatch="scatter")


def test_qwen35_moe_model_with_tokens_split_over_experts_equals_one_device():
    """The whole tiny Qwen3.5-MoE (Gated DeltaNet + attention layers, every MLP sparse) on
    expert=4 under rules that split the batch over the expert axis too (where "auto" picks
    all_to_all): logits and the recorded routes equal one device's, with routing replay."""
    cfg = qwen_vl.tiny_qwen35_moe(vocab_size=128)
    model = qwen_vl.init_random(cfg, seed=3)
    ids = np.random.default_rng(0).integers(0, 100, size=(4, 8))
    fwd = jax.jit(
        lambda s, ids, routes, g: nnx.merge(g, s)(ids, routes=routes, return_routing=True),
        static_argnums=3,
    )
    graphdef, state = nnx.split(model)
    ref, routing = fwd(state, ids, None, graphdef)
    split = (("batch", ("data", "fsdp", "expert")), *shd.DEFAULT_RULES[1:])
    sharded = nnx.clone(model)
    shd.shard_model(sharded, _mesh(expert=4), split)
    blocks = [m for _, m in nnx.iter_modules(sharded) if isinstance(m, moe.SparseMoeBlock)]
    assert blocks and all(moe.choose_all_to_all(b.dispatch, b.rules, ("expert",)) for b in blocks)
    graphdef, state = nnx.split(sharded)
    got, got_routing = fwd(state, ids, routing.experts, graphdef)
    np.testing.assert_array_equal(np.asarray(got_routing.experts), np.asarray(routing.experts))
    assert _rel(got, ref) <= 1e-5


@pytest.mark.skipif(
    not os.environ.get("CUA_LONG_TESTS"),
    reason="~10 s of libtpu compile on CPU: set CUA_LONG_TESTS=1",
)
def test_all_to_all_compiles_for_tpu_with_the_ragged_op():
    """On a TPU v5e-8 topology (ahead of time, libtpu) the all-to-all dispatch, forward and
    backward, compiles to ragged-all-to-alls (the CPU tests run the dense emulation), and no
    all-reduce of activations is left: only the router's gradient and the int32 counts."""
    from cua_jax import plan

    try:
        devices = plan.abstract_devices(plan.get_topology("v5e-8"))
    except plan.PlanInputError as e:
        pytest.skip(f"no libtpu: {e}")
    mesh = shd.make_mesh(1, 1, 1, devices=devices, expert=8)
    cfg = qwen_vl.tiny("qwen3_vl", moe=True).replace(param_dtype="bfloat16", dtype="bfloat16")
    block = nnx.eval_shape(lambda: moe.SparseMoeBlock(cfg, rngs=nnx.Rngs(0)))
    block.use_mesh(mesh, dispatch="all_to_all")
    graphdef, state = nnx.split(block)

    state = plan.with_shardings(state, shd.param_shardings(state, mesh))  # abstract, placed
    x_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert"))
    x = jax.ShapeDtypeStruct((8, 16, cfg.text.hidden_size), jnp.bfloat16, sharding=x_sharding)

    def grads(state, x):
        def loss(state, x):
            y, _, _ = nnx.merge(graphdef, state)(x)
            return jnp.sum(jnp.square(y.astype(jnp.float32)))

        return jax.grad(loss, argnums=(0, 1))(state, x)

    text = jax.jit(grads).trace(state, x).lower().compile().as_text()
    assert text.count("ragged-all-to-all-start(") == 4  # out and back, forward and backward
    D, E = cfg.text.hidden_size, cfg.text.num_experts
    for line in text.splitlines():
        if " all-reduce(" in line or "all-reduce-start(" in line:
            assert f"[{D},{E}]" in line or "s32" in line, line


def test_replay_weights_of_experts_far_from_the_router():
    """Replayed experts whose probabilities all underflow in f32 get the softmax of their
    logits (finite, with a finite router gradient); elsewhere the router's own renormalised
    top-k weights, bit for bit."""
    logits = jnp.asarray([[200.0, 0.0, 1.0, 150.0], [0.3, -0.2, 1.1, 0.5]], jnp.float32)
    e = jnp.asarray([[1, 2], [2, 3]], jnp.int32)

    @jax.jit
    def weights_grad_route(lg):
        g = jax.grad(lambda lg: jnp.sum(moe.replay_weights(lg, e)[:, 0]))(lg)
        return moe.replay_weights(lg, e), g, moe.route(lg[1:], 2)

    w, g, (own_w, own_e) = jax.tree.map(np.asarray, weights_grad_route(logits))
    np.testing.assert_allclose(w[0], np.exp([0.0, 1.0]) / np.exp([0.0, 1.0]).sum(), rtol=1e-6)
    assert np.array_equal(own_e, [[2, 3]])
    np.testing.assert_array_equal(w[1:], own_w)
    assert np.all(np.isfinite(g)) and np.abs(g[0]).max() > 0.1
