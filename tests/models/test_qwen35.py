"""Qwen3.5 (dense and MoE) against transformers' `Qwen3_5ForConditionalGeneration` /
`Qwen3_5MoeForConditionalGeneration` on tiny random models built locally, f32, within 1e-4.

Each HF model is written with transformers' own config classes (not cua_jax's), every weight
re-drawn (the zero-centred norms, A_log and dt_bias included), `save_pretrained` to a temp dir
and loaded with `qwen_vl.from_pretrained`. The dense model has a layer pattern other than the
default interval (full attention first, then two Gated DeltaNet layers); the MoE model takes
transformers' default pattern from `full_attention_interval`. Widths differ from one another
(hidden 128, q_proj 256, experts 48, shared expert 96) so a transposed kernel fails.
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from cua_jax import sharding as shd  # noqa: E402
from cua_jax.models import qwen_vl  # noqa: E402
from cua_jax.models.qwen_vl import qwen35  # noqa: E402
from cua_jax.models.qwen_vl.text import (  # noqa: E402
    dense_attention,
    make_attention_mask,
    make_dense_attn_fn,
)
from tests.models.hf_tiny import (  # noqa: E402
    IMAGE_TOKEN,
    VISION_END,
    VISION_START,
    VOCAB,
    hf_logits,
    image_inputs,
    prompt_ids,
)

TOL = 1e-4
# The MoE model's long-text, image, packed-row and decode-step checks repeat the dense model's
# code paths (same tower, same linear layers) with a routed MLP (per token, so padding and
# packing cannot change it); they cost ~25 s of CPU more and run when CUA_LONG_TESTS=1
# (BENCHMARKS lists the run). By default the MoE model is checked against transformers by
# `test_routing_replay_and_router_logits_on_moe` (logits and router logits) and the export.
LONG = os.environ.get("CUA_LONG_TESTS") == "1"
PAD = VOCAB - 7
DENSE_LAYERS = ["full_attention", "linear_attention", "linear_attention"]


def hf_config(moe: bool):
    text = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        eos_token_id=VOCAB - 8,
        pad_token_id=PAD,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
            "partial_rotary_factor": 0.5,
        },
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )
    vision = dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        out_hidden_size=128,
        hidden_act="gelu_pytorch_tanh",
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        num_position_embeddings=16,
    )
    ids = dict(
        image_token_id=IMAGE_TOKEN,
        video_token_id=VOCAB - 3,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    if moe:  # Qwen3.5-MoE's config has no dense intermediate_size (every layer is sparse)
        text.pop("intermediate_size")
        text.update(
            num_hidden_layers=2,
            full_attention_interval=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
        )
        return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, **ids)
    text.update(num_hidden_layers=3, layer_types=DENSE_LAYERS)
    return transformers.Qwen3_5Config(text_config=text, vision_config=vision, **ids)


def make_hf(moe: bool, seed: int = 1):
    torch.manual_seed(seed)
    cfg = hf_config(moe)
    cfg._attn_implementation = "eager"
    cls = (
        transformers.Qwen3_5MoeForConditionalGeneration
        if moe
        else transformers.Qwen3_5ForConditionalGeneration
    )
    model = cls(cfg).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm scales (zero-centred in the decoder), biases, A_log, dt_bias
                plain_norm = "visual" in name and "norm" in name and name.endswith("weight")
                p.copy_(0.2 * torch.randn(p.shape, generator=g) + (1.0 if plain_norm else 0.0))
            else:  # HF stores expert weights [E, out, in]: the fan-in is the last dim
                fan_in = p.shape[-1] if "experts" in name else int(np.prod(p.shape[1:]))
                std = 0.5 if "embed_tokens" in name or "pos_embed" in name else fan_in**-0.5
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request, tmp_path_factory):
    moe = request.param == "moe"
    hf = make_hf(moe)
    d = tmp_path_factory.mktemp(f"hf_qwen35_{request.param}")
    hf.save_pretrained(str(d))
    return hf, qwen_vl.from_pretrained(str(d)), str(d)


@nnx.jit
def _jit_forward(model, ids, mask, pv, meta, pos, seg):
    return model(
        ids,
        attention_mask=mask,
        pixel_values=pv,
        position_ids=pos,
        segment_ids=seg,
        vision_meta=meta,
    )


def run(model, ids, mask=None, pv=None, grid=None, pos=None, seg=None) -> np.ndarray:
    """`model(...)` under one jit per shape (eager dispatch compiles every op of every new
    shape, ~3x the CPU of one jit): positions and the vision layout computed on the host as
    `__call__` does."""
    if pos is None:
        pos = model.position_ids_for(ids, mask, grid if pv is not None else None)
    meta = None if pv is None else qwen_vl.vision_metadata(model.config, np.asarray(grid))
    return np.asarray(_jit_forward(model, ids, mask, pv, meta, pos, seg))


def _long_for_moe(model) -> None:
    if model.config.text.is_moe and not LONG:
        pytest.skip("MoE repeat of a dense check: set CUA_LONG_TESTS=1")


def _maxdiff(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b)))


def test_config_is_read_as_transformers_reads_it(pair):
    hf, ours, _ = pair
    c, t = ours.config, hf.config.text_config
    assert c.family == "qwen3_5" and c.model_type == hf.config.model_type
    assert list(c.text.layer_types) == list(t.layer_types)
    assert c.text.rotary_dim == 16 and c.text.is_moe == (c.model_type == "qwen3_5_moe")
    assert not c.vision.deepstack_visual_indexes
    # transformers' default pattern when config.json has no layer_types
    d = c.to_hf_dict()
    d["text_config"].pop("layer_types")
    d["text_config"]["num_hidden_layers"] = 8
    want = transformers.Qwen3_5TextConfig(num_hidden_layers=8).layer_types
    assert list(qwen_vl.QwenVLConfig.from_hf_dict(d).text.layer_types) == want
    # the published checkpoints' dims (abstract builds: 27.36e9 and 35.11e9 parameters, the
    # checkpoints' sizes less their multi-token-prediction heads)
    big = qwen_vl.published_config("qwen3_5", "35b-a3b")
    assert big.model_type == "qwen3_5_moe" and big.text.layer_types.count("full_attention") == 10
    assert qwen_vl.published_config("qwen3_5", "27b").text.linear_num_value_heads == 48


def test_text_only_logits(pair):
    hf, ours, _ = pair
    _long_for_moe(ours)
    ids = np.stack([prompt_ids(None, [70], seed=s) for s in (0, 1)])  # > one 64-token chunk
    ref = hf_logits(hf, ids)
    assert np.abs(ref).max() > 1.0  # non-trivial scale, so 1e-4 is a real check
    assert _maxdiff(run(ours, ids), ref) <= TOL


def test_images_of_odd_sizes_with_left_and_right_padding(pair):
    """Row 0: one image, left-padded; row 1: two images (tall, wide), right-padded."""
    hf, ours, _ = pair
    _long_for_moe(ours)
    pv, grid = image_inputs("qwen3_5", [(84, 112), (150, 60), (60, 130)], seed=2)
    a = prompt_ids(grid[:1], [6, 5], seed=3)
    b = prompt_ids(grid[1:], [4, 3, 5], seed=4)
    T = max(len(a), len(b)) + 3
    ids = np.full((2, T), PAD, np.int64)
    mask = np.zeros((2, T), np.int64)
    ids[0, T - len(a) :], mask[0, T - len(a) :] = a, 1
    ids[1, : len(b)], mask[1, : len(b)] = b, 1
    ref = hf_logits(hf, ids, mask, pv, grid)
    got = run(ours, ids, mask, pv, grid)
    real = mask.astype(bool)
    assert _maxdiff(got[real], ref[real]) <= TOL


def test_export_loads_back_in_transformers_with_equal_logits(pair, tmp_path):
    hf, ours, _ = pair
    qwen_vl.save_pretrained(ours, str(tmp_path))
    back = transformers.AutoModelForImageTextToText.from_pretrained(str(tmp_path))
    assert type(back) is type(hf)
    back = back.to(torch.float32).eval()
    pv, grid = image_inputs("qwen3_5", [(84, 112)], seed=5)
    ids = prompt_ids(grid, [6, 5], seed=6)[None]
    ref = hf_logits(hf, ids, pixel_values=pv, image_grid_thw=grid)
    # (the reload runs transformers' default sdpa attention, the original eager: ~1e-5 apart)
    assert _maxdiff(hf_logits(back, ids, pixel_values=pv, image_grid_thw=grid), ref) <= TOL
    # and our export of the reload is the same directory, tensor for tensor
    again = qwen_vl.from_pretrained(str(tmp_path))
    for (p, a), (_, b) in zip(
        nnx.to_flat_state(nnx.state(ours, nnx.Param)),
        nnx.to_flat_state(nnx.state(again, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), p)


def test_packed_row_gives_each_sample_its_logits_alone(pair):
    """Two samples in one row (segment ids 1, 2, then padding 0): each sample's logits equal
    running it alone, so the linear layers' state restarts at the boundary (without the reset
    sample 2 would see sample 1 through the recurrent state)."""
    hf, ours, _ = pair
    _long_for_moe(ours)
    pv, grid = image_inputs("qwen3_5", [(60, 90)], seed=7)
    a = prompt_ids(grid, [5, 9], seed=8)  # with an image
    b = prompt_ids(None, [23], seed=9)
    pos_a = ours.position_ids_for(a[None], None, grid)
    pos_b = ours.position_ids_for(b[None])
    n = len(a) + len(b)
    T = n + 4
    ids = np.full((1, T), PAD, np.int64)
    ids[0, :n] = np.r_[a, b]
    seg = np.zeros((1, T), np.int32)
    seg[0, : len(a)], seg[0, len(a) : n] = 1, 2
    pos = np.zeros((3, 1, T), np.int32)
    pos[:, :, : len(a)], pos[:, :, len(a) : n] = pos_a, pos_b
    packed = run(ours, ids, pv=pv, grid=grid, pos=pos, seg=seg)
    alone_a = run(ours, a[None], pv=pv, grid=grid)
    alone_b = run(ours, b[None])
    assert _maxdiff(packed[0, : len(a)], alone_a[0]) <= 1e-5
    assert _maxdiff(packed[0, len(a) : n], alone_b[0]) <= 1e-5
    # the reset matters: the same row read as one sample differs on sample 2
    joined = run(ours, ids, pv=pv, grid=grid, pos=pos, seg=(seg > 0).astype(np.int32))
    assert _maxdiff(joined[0, len(a) : n], alone_b[0]) > 1e-2
    assert _maxdiff(alone_b, hf_logits(hf, b[None])) <= TOL


def test_prefill_then_decode_steps_equal_one_forward(pair):
    """The decode-step form a hybrid-cache sampler uses: prefill with the linear states and a
    K/V cache for the full-attention layers, then one token at a time (the linear layers in
    their recurrent form); every step's logits equal the full forward's."""
    hf, ours, _ = pair
    _long_for_moe(ours)
    ids = prompt_ids(None, [35], seed=10)[None]
    P, T = 33, ids.shape[1]

    @nnx.jit
    def prefill_then_steps(model, ids):
        cache: dict[int, tuple[jax.Array, jax.Array]] = {}

        def attn_fn(layer_idx, q, k, v):
            assert layer_idx in qwen35.full_attention_layers(model.config)
            if layer_idx in cache:
                k = jnp.concatenate([cache[layer_idx][0], k], axis=1)
                v = jnp.concatenate([cache[layer_idx][1], v], axis=1)
            cache[layer_idx] = (k, v)
            n, S = q.shape[1], k.shape[1]
            mask = make_attention_mask(1, S)[:, S - n :]  # the new rows of the causal mask
            return dense_attention(q, k, v, mask)

        def step(tok, start, states):
            emb, _, _ = model.embed(tok)
            n = tok.shape[1]
            pos = jnp.broadcast_to(jnp.arange(start, start + n)[None, None], (3, 1, n))
            h, states = model.decode(
                emb, pos, attn_fn, linear_states=states, return_linear_states=True
            )
            return model.logits(h), states

        out, states = step(ids[:, :P], 0, qwen_vl.initial_linear_states(model.config, 1))
        outs = [out]
        for t in range(P, T):
            out, states = step(ids[:, t : t + 1], t, states)
            outs.append(out)
        return jnp.concatenate(outs, axis=1), states

    with pytest.raises(ValueError, match="needs linear_states"):  # a sampler must carry them
        ours.decode(*ours.embed(ids)[:1], ours.position_ids_for(ids), make_dense_attn_fn())
    got, states = prefill_then_steps(ours, ids)
    assert len(states) == len(qwen35.linear_attention_layers(ours.config))
    assert _maxdiff(got, run(ours, ids)) <= 1e-5


@nnx.jit
def _routed(model, ids, routes):
    return model(ids, position_ids=model.position_ids_for(ids), routes=routes, return_routing=True)


def test_routing_replay_and_router_logits_on_moe(pair):
    hf, ours, _ = pair
    if not ours.config.text.is_moe:
        pytest.skip("dense model")
    ids = prompt_ids(None, [20], seed=11)[None]
    logits, info = _routed(ours, ids, None)
    assert info.router_logits.shape == (2, 1, 20, 8) and info.experts.shape == (2, 1, 20, 2)
    assert np.abs(np.asarray(logits)).max() > 1.0
    replayed, again = _routed(ours, ids, info.experts)
    assert _maxdiff(replayed, logits) == 0.0
    np.testing.assert_array_equal(again.experts, info.experts)
    with torch.no_grad():
        out = hf(input_ids=torch.as_tensor(ids), output_router_logits=True)
    assert _maxdiff(logits, out.logits.float().numpy()) <= TOL
    ref = np.stack([r.float().numpy() for r in out.router_logits])
    assert _maxdiff(np.asarray(info.router_logits)[:, 0], ref) <= TOL


# ------------------------------------------------------------------- presets and sharding
def test_tiny_presets_build_and_have_the_hybrid_layout():
    for cfg in (qwen_vl.tiny_qwen35(), qwen_vl.tiny_qwen35_moe()):
        model = nnx.eval_shape(lambda cfg=cfg: qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(0)))
        layers = model.model.language_model.layers
        assert layers[0].linear_attn is not None and layers[0].self_attn is None
        assert layers[1].self_attn is not None and layers[1].linear_attn is None
        assert isinstance(layers[1].mlp, qwen35.SharedExpertMoeBlock) == cfg.text.is_moe
    with pytest.raises(ValueError, match="layer_types has 1 entries"):
        qwen_vl.tiny("qwen3_5", layer_types=("full_attention",))
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        qwen_vl.tiny("qwen3_5", moe=dict(shared_expert_intermediate_size=0))


# One of each kind of parameter; the rules are cua_jax.sharding.DEFAULT_RULES.
GOLDEN = {
    "model.language_model.layers.0.linear_attn.in_proj_qkv.kernel": ("fsdp", "tensor"),
    "model.language_model.layers.0.linear_attn.in_proj_z.kernel": ("fsdp", "tensor"),
    "model.language_model.layers.0.linear_attn.in_proj_b.kernel": ("fsdp", "tensor"),
    "model.language_model.layers.0.linear_attn.in_proj_a.kernel": ("fsdp", "tensor"),
    "model.language_model.layers.0.linear_attn.conv1d.weight": ("tensor", None, None),
    "model.language_model.layers.0.linear_attn.A_log": ("tensor",),
    "model.language_model.layers.0.linear_attn.dt_bias": ("tensor",),
    "model.language_model.layers.0.linear_attn.norm.weight": (None,),
    "model.language_model.layers.0.linear_attn.out_proj.kernel": ("tensor", "fsdp"),
    "model.language_model.layers.1.self_attn.q_proj.kernel": ("fsdp", "tensor"),
    "model.language_model.layers.1.self_attn.k_proj.kernel": ("fsdp", "tensor"),
    "model.language_model.layers.1.self_attn.o_proj.kernel": ("tensor", "fsdp"),
    "model.language_model.layers.1.self_attn.q_norm.weight": (None,),
    "model.language_model.layers.1.input_layernorm.weight": (None,),
    "model.language_model.embed_tokens.weight": ("tensor", "fsdp"),
    "lm_head.kernel": ("fsdp", "tensor"),
    "model.visual.blocks.0.attn.qkv.kernel": ("fsdp", "tensor"),
}
GOLDEN_DENSE_MLP = {
    "model.language_model.layers.1.mlp.gate_proj.kernel": ("fsdp", "tensor"),
    "model.language_model.layers.1.mlp.down_proj.kernel": ("tensor", "fsdp"),
}
GOLDEN_MOE = {
    "model.language_model.layers.1.mlp.gate.kernel": ("fsdp", None),
    "model.language_model.layers.1.mlp.experts.gate_up_proj": ("expert", "fsdp", None, "tensor"),
    "model.language_model.layers.1.mlp.experts.down_proj": ("expert", "tensor", "fsdp"),
    "model.language_model.layers.1.mlp.shared_expert.up_proj.kernel": ("fsdp", "tensor"),
    "model.language_model.layers.1.mlp.shared_expert.down_proj.kernel": ("tensor", "fsdp"),
    "model.language_model.layers.1.mlp.shared_expert_gate.kernel": ("fsdp", None),
}


@pytest.mark.parametrize("moe", [False, True])
def test_golden_partition_specs(moe):
    cfg = qwen_vl.tiny("qwen3_5", moe=moe)
    model = nnx.eval_shape(lambda: qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(0)))
    specs = shd.param_specs(nnx.state(model, nnx.Param))
    golden = {**GOLDEN, **(GOLDEN_MOE if moe else GOLDEN_DENSE_MLP)}
    got = {k: tuple(specs[k]) for k in golden}
    assert got == {k: tuple(v) for k, v in golden.items()}
    unnamed = [k for k, s in specs.items() if s is None]
    assert not unnamed  # every parameter carries logical axis names


def test_moe_loaded_onto_an_8_device_mesh_equals_one_device(pair):
    """`from_pretrained(mesh=fsdp 2 x tensor 2 x expert 2)`: each tensor (the per-expert ones
    stacked first) placed from per-device slices; Gated DeltaNet projections, conv and heads
    split over `tensor`, experts over `expert` inside the MoE block's shard_map, the shared
    expert a plain sharded MLP. The same logits as on one device."""
    hf, ours, d = pair
    if not ours.config.text.is_moe:
        pytest.skip("the MoE model covers the dense layers too")
    if not LONG:
        pytest.skip("~15 s of CPU (a sharded compile): set CUA_LONG_TESTS=1")
    assert len(jax.devices()) == 8
    eight = qwen_vl.from_pretrained(d, mesh=shd.make_mesh(1, 2, 2, expert=2))
    k = eight.model.language_model.layers[0].linear_attn.in_proj_qkv.kernel[...]
    assert k.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    gu = eight.model.language_model.layers[0].mlp.experts.gate_up_proj[...]
    assert gu.sharding.spec == jax.sharding.PartitionSpec("expert", "fsdp", None, "tensor")
    ids = np.stack([prompt_ids(None, [24], seed=s) for s in (12, 13)])
    assert _maxdiff(run(eight, ids), run(ours, ids)) <= 1e-5


def test_checkpoint_extras_and_gaps_are_named(pair, tmp_path):
    """mtp.* (the multi-token-prediction head) is skipped as transformers skips it; a missing
    per-expert tensor is named."""
    from safetensors.numpy import load_file, save_file

    _, ours, d = pair
    tensors = load_file(os.path.join(d, "model.safetensors"))
    tensors["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    name = "model.language_model.layers.1.mlp.experts.3.up_proj.weight"
    if ours.config.text.is_moe:
        del tensors[name]
    with open(os.path.join(d, "config.json")) as src, open(tmp_path / "config.json", "w") as dst:
        dst.write(src.read())
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    if not ours.config.text.is_moe:
        qwen_vl.from_pretrained(str(tmp_path))  # loads: mtp.* skipped
        return
    with pytest.raises(ValueError, match=r"missing 1 per-expert tensor.*'3\.up_proj'"):
        qwen_vl.from_pretrained(str(tmp_path))


@pytest.mark.parametrize(
    "size,axes,params",
    [
        ("27b", dict(fsdp=8, tensor=4), 27.36e9),
        ("35b-a3b", dict(fsdp=4, tensor=2, expert=8), 35.11e9),
    ],
)
def test_published_sizes_divide_over_a_mesh(size, axes, params):
    """The published checkpoints' shapes (abstract builds) under DEFAULT_RULES on a mesh a
    preset would use: every parameter divides; the parameter count is the checkpoint's (less
    its multi-token-prediction layer, which the policy does not load)."""
    from jax.sharding import AbstractMesh

    cfg = qwen_vl.published_config("qwen3_5", size)
    state = nnx.state(nnx.eval_shape(lambda: qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    mesh = AbstractMesh(tuple(axes.get(a, 1) for a in shd.MESH_AXES), shd.MESH_AXES)
    specs = shd.param_specs(state)
    for path, var in nnx.to_flat_state(state):
        name = ".".join(map(str, path))
        shd._check_divisible(name, var.get_value().shape, specs[name], mesh)
    n = sum(x.size for x in jax.tree.leaves(state))
    assert n == pytest.approx(params, rel=1e-3)
