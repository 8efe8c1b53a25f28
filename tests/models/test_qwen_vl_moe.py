"""Qwen3-VL-MoE: parity with transformers' `Qwen3VLMoeForConditionalGeneration` (f32, tiny random
model: hidden 64, 2 layers, 8 experts, top-2), HF import/export in both expert layouts, the
grouped-matmul dispatch against a dense all-experts reference, and expert parallelism on the 8
forced host devices (expert x fsdp, expert x tensor) against one device.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cua_jax import sharding as shd  # noqa: E402
from cua_jax.models import lora, qwen_vl  # noqa: E402
from cua_jax.models.qwen_vl import moe  # noqa: E402
from cua_jax.models.qwen_vl.config import QwenVLConfig  # noqa: E402
from tests.models.hf_tiny import (  # noqa: E402
    hf_config,
    hf_logits,
    image_inputs,
    make_hf_model,
    prompt_ids,
)

FAM = "qwen3_vl_moe"
RTOL = 1e-4  # relative to the largest |logit|


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = make_hf_model(FAM, seed=1)
    d = tmp_path_factory.mktemp("hf_moe")
    hf.save_pretrained(str(d))
    return hf, qwen_vl.from_pretrained(str(d)), d


# ---------------------------------------------------------------------------------- config
def test_config_from_hf_round_trip_and_errors():
    d = hf_config(FAM, mlp_only_layers=[1], decoder_sparse_step=1).to_dict()
    cfg = QwenVLConfig.from_hf_dict(d)
    t = cfg.text
    assert (cfg.family, cfg.model_type) == ("qwen3_vl", "qwen3_vl_moe")
    assert (t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size) == (8, 2, 48)
    assert t.mlp_only_layers == (1,) and [t.is_sparse_layer(i) for i in (0, 1)] == [True, False]
    assert QwenVLConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    assert type(hf_cfg).__name__ == "Qwen3VLMoeConfig"
    assert hf_cfg.text_config.num_experts == 8 and hf_cfg.text_config.mlp_only_layers == [1]
    step2 = dataclasses.replace(t, decoder_sparse_step=2, mlp_only_layers=())
    assert [step2.is_sparse_layer(i) for i in range(4)] == [False, True, False, True]
    tiny = qwen_vl.tiny("qwen3_vl", moe=dict(num_experts=4))
    assert tiny.model_type == "qwen3_vl_moe" and tiny.text.num_experts == 4
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        qwen_vl.tiny("qwen3_vl", moe=dict(num_experts_per_tok=9))
    with pytest.raises(ValueError, match="mlp_only_layers has 5"):
        qwen_vl.tiny("qwen3_vl", moe=dict(mlp_only_layers=(5,)))
    with pytest.raises(ValueError, match="qwen3_vl only"):
        qwen_vl.tiny("qwen2_5_vl", moe=True)
    bad = json.loads(json.dumps(d))
    bad["text_config"].pop("num_experts", None)
    bad["text_config"].pop("num_local_experts", None)
    with pytest.raises(ValueError, match=r"text_config\.num_experts is missing"):
        QwenVLConfig.from_hf_dict(bad)


# ---------------------------------------------------------------------------------- parity
def test_text_logits(pair):
    hf, ours, _ = pair
    ids = np.stack([prompt_ids(None, [24], seed=s) for s in (0, 1)])
    ref = hf_logits(hf, ids)
    assert np.abs(ref).max() > 1.0
    assert _rel(ours(ids), ref) <= RTOL


def test_one_image_logits(pair):
    hf, ours, _ = pair
    pv, grid = image_inputs(FAM, [(84, 112)], seed=2)
    ids = prompt_ids(grid, [6, 5], seed=3)[None]
    ref = hf_logits(hf, ids, pixel_values=pv, image_grid_thw=grid)
    assert _rel(ours(ids, pixel_values=pv, image_grid_thw=grid), ref) <= RTOL


def test_two_images_odd_sizes(pair):
    hf, ours, _ = pair
    pv, grid = image_inputs(FAM, [(150, 60), (60, 130)], seed=4)
    ids = prompt_ids(grid, [4, 3, 5], seed=5)[None]
    ref = hf_logits(hf, ids, pixel_values=pv, image_grid_thw=grid)
    assert _rel(ours(ids, pixel_values=pv, image_grid_thw=grid), ref) <= RTOL


def test_padded_batch(pair):
    """Row 0 left-padded, row 1 right-padded, both with an image; real tokens compared."""
    hf, ours, _ = pair
    pv, grid = image_inputs(FAM, [(56, 84), (84, 56)], seed=6)
    a = prompt_ids(grid[:1], [3, 2], seed=7)
    b = prompt_ids(grid[1:], [5, 4], seed=8)
    T = max(len(a), len(b)) + 3
    ids = np.full((2, T), 505, np.int64)
    mask = np.zeros((2, T), np.int64)
    ids[0, T - len(a) :], mask[0, T - len(a) :] = a, 1
    ids[1, : len(b)], mask[1, : len(b)] = b, 1
    ref = hf_logits(hf, ids, mask, pv, grid)
    got = np.asarray(ours(ids, attention_mask=mask, pixel_values=pv, image_grid_thw=grid))
    real = mask.astype(bool)
    assert _rel(got[real], ref[real]) <= RTOL


def test_mlp_only_layers_and_sparse_step(tmp_path):
    """A dense layer among sparse ones (mlp_only_layers) and decoder_sparse_step=2 build the
    same layer kinds as transformers and give its logits."""
    ids = np.stack([prompt_ids(None, [20], seed=s) for s in (2, 3)])
    for i, kw in enumerate([dict(mlp_only_layers=[0]), dict(decoder_sparse_step=2)]):
        hf = make_hf_model(FAM, seed=2, **kw)
        hf.save_pretrained(str(tmp_path / str(i)))
        ours = qwen_vl.from_pretrained(str(tmp_path / str(i)))
        kinds = [type(layer.mlp).__name__ for layer in ours.model.language_model.layers]
        ref_kinds = [type(layer.mlp).__name__ for layer in hf.model.language_model.layers]
        assert kinds == ["MLP", "SparseMoeBlock"]
        assert ref_kinds == ["Qwen3VLMoeTextMLP", "Qwen3VLMoeTextSparseMoeBlock"]
        assert _rel(ours(ids), hf_logits(hf, ids)) <= RTOL


# ------------------------------------------------------------------------------ import/export
def test_export_round_trip_reloads_in_transformers(pair, tmp_path):
    hf, ours, _ = pair
    down = ours.model.language_model.layers[0].mlp.experts.down_proj
    orig = down[...]
    down[...] = orig * 1.5  # export our weights, not a copy of the source files
    try:
        qwen_vl.save_pretrained(ours, str(tmp_path))
        cls = transformers.Qwen3VLMoeForConditionalGeneration
        back, info = cls.from_pretrained(str(tmp_path), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert not info["mismatched_keys"], info
        back = back.to(torch.float32).eval()
        back.config._attn_implementation = "eager"
        ids = np.stack([prompt_ids(None, [16], seed=s) for s in (4, 5)])
        assert _rel(ours(ids), hf_logits(back, ids)) <= RTOL
        assert _rel(qwen_vl.from_pretrained(str(tmp_path))(ids), hf_logits(back, ids)) <= 1e-6
    finally:
        down[...] = orig


def test_published_expert_layout_loads(pair, tmp_path):
    """The published checkpoints store experts as [E, D, 2F] / [E, F, D] (transformers
    transposes them on load); the same weights in that layout load to the same model."""
    from safetensors.numpy import load_file, save_file

    hf, ours, d = pair
    tensors = load_file(str(d / "model.safetensors"))
    for k in list(tensors):
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[k] = np.ascontiguousarray(tensors[k].transpose(0, 2, 1))
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    again = qwen_vl.from_pretrained(str(tmp_path))
    for a, b in zip(
        jax.tree.leaves(nnx.state(again, nnx.Param)),
        jax.tree.leaves(nnx.state(ours, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------- dispatch
def _dense_reference(x_ND, w_NK, e_NK, gate_up, down):
    """Every expert on every token (one-hot combine): the all-experts einsum."""
    h = jnp.einsum("nd,edxf->nexf", x_ND, gate_up)
    y = jnp.einsum("nef,efd->ned", jax.nn.silu(h[:, :, 0]) * h[:, :, 1], down)
    comb_NE = jnp.sum(jax.nn.one_hot(e_NK, gate_up.shape[0]) * w_NK[..., None], axis=1)
    return jnp.einsum("ned,ne->nd", y, comb_NE)


def test_grouped_dispatch_equals_dense_reference_and_splits_by_expert():
    rng = np.random.default_rng(0)
    N, D, E, K, F = 13, 8, 6, 3, 5
    x = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    gu = jnp.asarray(rng.normal(size=(E, D, 2, F)), jnp.float32)
    dn = jnp.asarray(rng.normal(size=(E, F, D)), jnp.float32)
    logits = jnp.asarray(rng.normal(size=(N, E)), jnp.float32)
    w, e = moe.route(logits, K)
    np.testing.assert_allclose(np.sum(np.asarray(w), -1), 1.0, rtol=1e-6)
    probs = np.asarray(jax.nn.softmax(logits, -1))
    top = np.argsort(-probs, -1)[:, :K]
    np.testing.assert_array_equal(np.asarray(e), top)
    ref = _dense_reference(x, w, e, gu, dn)
    got = moe.expert_mlp(x, w, e, {"gate_up": gu, "down": dn}, 0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    # experts split in two halves (as two expert-parallel devices) sum to the whole
    halves = [
        moe.expert_mlp(x, w, e, {"gate_up": gu[s : s + 3], "down": dn[s : s + 3]}, s)
        for s in (0, 3)
    ]
    np.testing.assert_allclose(np.asarray(halves[0] + halves[1]), np.asarray(ref), atol=1e-5)
    # unnormalised top-k keeps the raw probabilities
    w_raw, _ = moe.route(logits, K, norm_topk_prob=False)
    np.testing.assert_allclose(np.asarray(w_raw), np.take_along_axis(probs, top, -1), rtol=1e-6)


# --------------------------------------------------------------------- expert parallelism
EP_CFG = qwen_vl.tiny("qwen3_vl", vocab_size=128, moe=dict(num_experts=8, mlp_only_layers=(1,)))
EP_CFG = EP_CFG.replace(text=dataclasses.replace(EP_CFG.text, moe_intermediate_size=32))


def test_expert_weight_partition_specs_golden():
    model = nnx.eval_shape(lambda: qwen_vl.QwenVL(EP_CFG, rngs=nnx.Rngs(0)))
    specs = shd.param_specs(nnx.state(model, nnx.Param), shd.DEFAULT_RULES)
    pre = "model.language_model.layers.0.mlp."
    assert specs[pre + "experts.gate_up_proj"] == P("expert", "fsdp", None, "tensor")
    assert specs[pre + "experts.down_proj"] == P("expert", "tensor", "fsdp")
    assert specs[pre + "gate.kernel"] == P("fsdp", None)
    dense = "model.language_model.layers.1.mlp."
    assert specs[dense + "gate_proj.kernel"] == P("fsdp", "tensor")
    assert not any(k.startswith(dense + "experts") for k in specs)


@jax.jit
def _jit_forward(graphdef, state, ids):
    return nnx.merge(graphdef, state)(ids)


def _forward(model, ids):
    """Jitted logits; models with the same structure (and mesh) share one compile."""
    graphdef, state = nnx.split(model)
    return np.asarray(_jit_forward(graphdef, state, ids))


@pytest.fixture(scope="module")
def ep_reference():
    ids = np.stack([prompt_ids(None, [12], seed=s) % 100 for s in (6, 7, 8, 9)])
    model = qwen_vl.init_random(EP_CFG, seed=3)
    # larger expert weights so routing and expert outputs move the logits
    for layer in model.model.language_model.layers:
        if isinstance(layer.mlp, moe.SparseMoeBlock):
            layer.mlp.gate.kernel[...] = layer.mlp.gate.kernel[...] * 50.0
            layer.mlp.experts.down_proj[...] = layer.mlp.experts.down_proj[...] * 20.0
    return ids, model, _forward(model, ids)


@pytest.mark.parametrize(
    "axes",
    [dict(expert=4, fsdp=2, tensor=1), dict(expert=4, fsdp=1, tensor=2)],
    ids=["expert4xfsdp2", "expert4xtensor2"],
)
def test_expert_parallel_forward_equals_one_device(ep_reference, axes):
    ids, ref_model, ref = ep_reference
    model = nnx.clone(ref_model)
    mesh = shd.make_mesh(data=1, **axes)
    shd.shard_model(model, mesh)
    blocks = [m for _, m in nnx.iter_modules(model) if isinstance(m, moe.SparseMoeBlock)]
    assert blocks and all(b.mesh is mesh for b in blocks)
    gu = blocks[0].experts.gate_up_proj.get_value()
    assert gu.sharding.spec == P("expert", "fsdp", None, "tensor")
    assert gu.addressable_shards[0].data.shape[0] == 2  # 8 experts over 4 devices
    got = _forward(model, ids)
    assert _rel(got, ref) <= 1e-5


def _block_grads(block, x):
    graphdef, state = nnx.split(block)

    @jax.jit
    def f(state, x):
        def loss(state, x):
            return jnp.sum(jnp.sin(nnx.merge(graphdef, state)(x)[0]))

        return jax.grad(loss, argnums=(0, 1))(state, x)

    g_state, g_x = f(state, x)
    flat = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(g_state)}
    return flat, np.asarray(g_x)


def test_expert_parallel_gradients_equal_one_device():
    """Gradients through the shard_map dispatch (expert x fsdp x tensor) of the router, the
    experts and the tokens equal the one-device gradients."""
    block = moe.SparseMoeBlock(EP_CFG, rngs=nnx.Rngs(4))
    block.gate.kernel[...] = block.gate.kernel[...] * 50.0
    x = jax.random.normal(jax.random.key(5), (4, 6, EP_CFG.text.hidden_size))
    ref, ref_x = _block_grads(block, x)
    sharded = nnx.clone(block)
    shd.shard_model(sharded, shd.make_mesh(data=1, fsdp=2, tensor=2, expert=2))
    got, got_x = _block_grads(sharded, x)
    assert set(got) == {"gate.kernel", "experts.gate_up_proj", "experts.down_proj"}
    assert _rel(got_x, ref_x) <= 1e-5
    for k in ref:
        assert _rel(got[k], ref[k]) <= 1e-5, k


# ------------------------------------------------------------------------------------ LoRA
def _randomize_adapters(model, seed):
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        var.set_value(jnp.asarray(0.05 * rng.normal(size=var.get_value().shape), jnp.float32))


def test_lora_on_experts_merge_and_expert_parallel(ep_reference):
    """LoRA wraps attention, dense MLP and expert projections (not the router); B = 0 is the
    base model; merged weights give the adapted logits; the adapted forward under expert x
    tensor parallelism equals one device."""
    ids, base, ref = ep_reference
    model = nnx.clone(base)
    paths = lora.apply_lora(model, 4, 8.0, lora.MOE_TARGETS, rngs=nnx.Rngs(2))
    assert "model.language_model.layers.0.mlp.experts" in paths
    assert not any(p.endswith("mlp.gate") for p in paths)
    assert len(paths) == 4 + 1 + 4 + 3  # layer 0: attention + experts; layer 1: + dense MLP
    ad = model.model.language_model.layers[0].mlp.experts.gate_up_lora
    assert ad.lora_a.get_metadata()["out_sharding"] == ("expert", "embed", None)
    assert ad.lora_b.get_metadata()["out_sharding"] == ("expert", None, None, "mlp")
    assert _rel(_forward(model, ids), ref) <= 1e-6  # B = 0
    _randomize_adapters(model, 3)
    adapted = _forward(model, ids)
    assert _rel(adapted, ref) > 1e-2
    off = nnx.clone(model)
    nnx.update(off, lora.adapters_off(nnx.state(off, nnx.LoRAParam)))
    assert _rel(_forward(off, ids), ref) <= 1e-6
    sharded = nnx.clone(model)
    shd.shard_model(sharded, shd.make_mesh(data=1, fsdp=1, tensor=2, expert=4))
    assert _rel(_forward(sharded, ids), adapted) <= 1e-5
    merged = lora.merge_lora(nnx.clone(model))
    assert not lora.has_lora(merged)
    assert isinstance(merged.model.language_model.layers[0].mlp.experts, moe.Experts)
    assert _rel(_forward(merged, ids), adapted) <= 1e-5


# --------------------------------------------------------------- routing record, replay, aux
def test_routing_record_and_aux_loss_match_transformers(pair):
    hf, ours, _ = pair
    ids = np.stack([prompt_ids(None, [10], seed=s) for s in (11, 12)])
    mask = np.ones_like(ids)
    mask[0, :3] = 0  # left padding in row 0
    with torch.no_grad():
        out = hf(
            input_ids=torch.as_tensor(ids),
            attention_mask=torch.as_tensor(mask),
            output_router_logits=True,
        )
    ref_logits = np.stack([r.numpy().reshape(2, 10, -1) for r in out.router_logits])
    logits, routing = ours(ids, attention_mask=mask, return_routing=True)
    assert routing.router_logits.shape == (2, 2, 10, 8) and routing.experts.shape == (2, 2, 10, 2)
    assert _rel(routing.router_logits, ref_logits) <= RTOL
    ref_top = np.argsort(-ref_logits, -1)[..., :2]
    np.testing.assert_array_equal(np.sort(routing.experts, -1), np.sort(ref_top, -1))
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    for m in (None, mask):
        ref_aux = load_balancing_loss_func(
            out.router_logits, 8, 2, None if m is None else torch.as_tensor(m)
        )
        aux = moe.load_balancing_loss(routing.router_logits, 2, m)
        np.testing.assert_allclose(float(aux), float(ref_aux), rtol=1e-5)
    assert _rel(logits, ours(ids, attention_mask=mask)) <= 1e-6


def test_routing_replay(pair):
    """Replaying a forward's own experts gives its logits; replaying another policy's experts
    routes exactly those experts (weights from the current router, which keeps a gradient)."""
    _, ours, _ = pair
    ids = np.stack([prompt_ids(None, [10], seed=s) for s in (13, 14)])
    logits, routing = ours(ids, return_routing=True)
    assert _rel(ours(ids, routes=routing.experts), logits) <= 1e-6
    other = nnx.clone(ours)
    gate = other.model.language_model.layers[1].mlp.gate.kernel
    gate[...] = gate[...] + 0.5 * jax.random.normal(jax.random.key(0), gate[...].shape)
    _, other_routing = other(ids, return_routing=True)
    assert np.mean(np.asarray(other_routing.experts) != np.asarray(routing.experts)) > 0.1
    replayed, again = ours(ids, routes=other_routing.experts, return_routing=True)
    np.testing.assert_array_equal(np.asarray(again.experts), np.asarray(other_routing.experts))
    assert _rel(replayed, logits) > 1e-3
    share = float(moe.routing_mismatch(routing.experts, other_routing.experts))
    assert share == pytest.approx(
        np.mean(np.any(np.sort(routing.experts, -1) != np.sort(other_routing.experts, -1), -1))
    )
    assert share > 0.05 and float(moe.routing_mismatch(routing.experts, routing.experts)) == 0
    # unrecorded tokens (negative ids) route by the current router
    partial = np.asarray(other_routing.experts).copy()
    partial[:, :, 5:] = -1
    _, mixed = ours(ids, routes=partial, return_routing=True)
    want = np.concatenate([partial[:, :, :5], np.asarray(routing.experts)[:, :, 5:]], axis=2)
    np.testing.assert_array_equal(np.asarray(mixed.experts)[:, :, :5], want[:, :, :5])
    np.testing.assert_array_equal(np.asarray(mixed.experts)[0, :, 5:], want[0, :, 5:])

    grads = nnx.grad(lambda m: jnp.sum(m(ids, routes=other_routing.experts)[..., 0]))(ours)
    g = grads["model"]["language_model"]["layers"][1]["mlp"]["gate"]["kernel"].get_value()
    assert np.abs(np.asarray(g)).max() > 0
    with pytest.raises(ValueError, match="sparse layers"):
        ours(ids, routes=other_routing.experts[:1])


def test_from_pretrained_on_expert_mesh(pair):
    """Loading onto an expert x fsdp mesh places each device's experts from the file and runs
    the blocks expert-parallel, with the one-device logits."""
    hf, ours, d = pair
    mesh = shd.make_mesh(data=1, fsdp=2, expert=4)
    model = qwen_vl.from_pretrained(str(d), mesh=mesh)
    block = model.model.language_model.layers[0].mlp
    assert block.mesh is mesh
    gu = block.experts.gate_up_proj.get_value()
    assert gu.sharding.spec == P("expert", "fsdp", None, "tensor")
    assert gu.addressable_shards[0].data.shape == (2, 32, 2, 48)
    ids = np.stack([prompt_ids(None, [12], seed=s) for s in (15, 16)])
    assert _rel(_forward(model, ids), ours(ids)) <= 1e-5


def test_expert_parallel_block_compiles_for_tpu():
    """The shard_map dispatch with ragged_dot, forward and backward, on an expert x fsdp mesh of
    a TPU v5e-8 compiles with libtpu (ahead of time, on this CPU)."""
    from cua_jax import plan

    try:
        devices = plan.abstract_devices(plan.get_topology("v5e-8"))
    except plan.PlanInputError as e:
        pytest.skip(f"no libtpu: {e}")
    mesh = shd.make_mesh(1, 2, 1, devices=devices, expert=4)
    cfg = EP_CFG.replace(param_dtype="bfloat16", dtype="bfloat16")
    block = nnx.eval_shape(lambda: moe.SparseMoeBlock(cfg, rngs=nnx.Rngs(0)))
    block.use_mesh(mesh)
    graphdef, state = nnx.split(block)

    state = plan.with_shardings(state, shd.param_shardings(state, mesh))  # abstract, placed
    x_sharding = jax.sharding.NamedSharding(mesh, P("fsdp", None, None))
    x = jax.ShapeDtypeStruct((8, 64, cfg.text.hidden_size), jnp.bfloat16, sharding=x_sharding)

    def grads(state, x):
        def loss(state, x):
            y, _, _ = nnx.merge(graphdef, state)(x)
            return jnp.sum(jnp.square(y.astype(jnp.float32)))

        return jax.grad(loss)(state, x)

    text = jax.jit(grads).trace(state, x).lower().compile().as_text()
    assert "ragged" in text and "all-reduce" in text
