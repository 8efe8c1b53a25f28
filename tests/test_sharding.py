"""Sharding: mesh construction, logical rules, golden PartitionSpecs, 8-device == 1-device."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from cua_jax import sharding as shd
from cua_jax.models import qwen_vl

FS, TP = "fsdp", "tensor"
IN, OUT = (FS, TP), (TP, FS)  # kernels into / out of a tensor-parallel dimension
NORM = (None,)

_TEXT_LAYER = {
    "input_layernorm.weight": NORM,
    "post_attention_layernorm.weight": NORM,
    "mlp.gate_proj.kernel": IN,
    "mlp.up_proj.kernel": IN,
    "mlp.down_proj.kernel": OUT,
    "self_attn.q_proj.kernel": IN,
    "self_attn.k_proj.kernel": IN,
    "self_attn.v_proj.kernel": IN,
    "self_attn.o_proj.kernel": OUT,
}
_Q25_TEXT_EXTRA = {f"self_attn.{p}_proj.bias": (TP,) for p in "qkv"}
_Q3_TEXT_EXTRA = {"self_attn.q_norm.weight": NORM, "self_attn.k_norm.weight": NORM}
_VIS_BLOCK = {
    "attn.qkv.kernel": IN,
    "attn.qkv.bias": (TP,),
    "attn.proj.kernel": OUT,
    "attn.proj.bias": (FS,),
}
_Q25_VIS_BLOCK = {
    "norm1.weight": NORM,
    "norm2.weight": NORM,
    "mlp.gate_proj.kernel": IN,
    "mlp.gate_proj.bias": (TP,),
    "mlp.up_proj.kernel": IN,
    "mlp.up_proj.bias": (TP,),
    "mlp.down_proj.kernel": OUT,
    "mlp.down_proj.bias": (FS,),
}
_Q3_VIS_BLOCK = {
    "norm1.weight": NORM,
    "norm1.bias": NORM,
    "norm2.weight": NORM,
    "norm2.bias": NORM,
    "mlp.linear_fc1.kernel": IN,
    "mlp.linear_fc1.bias": (TP,),
    "mlp.linear_fc2.kernel": OUT,
    "mlp.linear_fc2.bias": (FS,),
}
_Q3_MERGER = {
    "norm.weight": NORM,
    "norm.bias": NORM,
    "linear_fc1.kernel": IN,
    "linear_fc1.bias": (TP,),
    "linear_fc2.kernel": OUT,
    "linear_fc2.bias": (FS,),
}


def golden(family: str) -> dict[str, tuple]:
    g = {
        "lm_head.kernel": (FS, TP),
        "model.language_model.embed_tokens.weight": (TP, FS),
        "model.language_model.norm.weight": NORM,
        "model.visual.patch_embed.proj.kernel": (None, FS),
    }
    q3 = family == "qwen3_vl"
    for i in range(2):
        layer = {**_TEXT_LAYER, **(_Q3_TEXT_EXTRA if q3 else _Q25_TEXT_EXTRA)}
        g.update({f"model.language_model.layers.{i}.{k}": v for k, v in layer.items()})
        block = {**_VIS_BLOCK, **(_Q3_VIS_BLOCK if q3 else _Q25_VIS_BLOCK)}
        g.update({f"model.visual.blocks.{i}.{k}": v for k, v in block.items()})
    if q3:
        g["model.visual.patch_embed.proj.bias"] = (FS,)
        g["model.visual.pos_embed.weight"] = (None, FS)
        g.update({f"model.visual.merger.{k}": v for k, v in _Q3_MERGER.items()})
        for j in range(2):
            g.update(
                {f"model.visual.deepstack_merger_list.{j}.{k}": v for k, v in _Q3_MERGER.items()}
            )
    else:
        g.update(
            {
                "model.visual.merger.ln_q.weight": NORM,
                "model.visual.merger.mlp.0.kernel": IN,
                "model.visual.merger.mlp.0.bias": (TP,),
                "model.visual.merger.mlp.2.kernel": OUT,
                "model.visual.merger.mlp.2.bias": (FS,),
            }
        )
    return g


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_golden_partition_specs(family):
    model = nnx.eval_shape(lambda: qwen_vl.QwenVL(qwen_vl.tiny(family), rngs=nnx.Rngs(0)))
    specs = shd.param_specs(nnx.state(model, nnx.Param), shd.DEFAULT_RULES)
    want = {k: P(*v) for k, v in golden(family).items()}
    assert set(specs) == set(want), set(specs) ^ set(want)
    for k in want:
        assert specs[k] == want[k], (k, specs[k], want[k])


def test_make_mesh_axes_and_errors():
    mesh = shd.make_mesh(fsdp=4, tensor=2)
    assert mesh.axis_names == ("data", "fsdp", "expert", "tensor")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2}
    assert dict(shd.make_mesh().shape) == {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}
    assert dict(shd.make_mesh(fsdp=-1, expert=4).shape) == {
        "data": 1,
        "fsdp": 2,
        "expert": 4,
        "tensor": 1,
    }
    with pytest.raises(ValueError, match="needs 6 devices"):
        shd.make_mesh(data=1, fsdp=3, tensor=2)
    with pytest.raises(ValueError, match="at most one"):
        shd.make_mesh(data=-1, fsdp=-1)


def test_logical_to_spec_rules():
    assert shd.logical_to_spec(("embed", "heads")) == P("fsdp", "tensor")
    assert shd.logical_to_spec(("batch", None)) == P(("data", "fsdp"), None)
    # one mesh axis is used at most once per array
    assert shd.logical_to_spec(("embed", "vision_embed")) == P("fsdp", None)
    with pytest.raises(KeyError, match="'nonsense'"):
        shd.logical_to_spec(("embed", "nonsense"))
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        shd.logical_to_spec(("embed",), (("embed", "model"),))
    custom = (*shd.DEFAULT_RULES, ("embed", None))  # later rules override earlier ones
    assert shd.logical_to_spec(("embed", "mlp"), custom) == P(None, "tensor")


def test_indivisible_dimension_raises():
    mesh = shd.make_mesh(fsdp=8)
    with pytest.raises(ValueError, match="not divisible"):
        shd.named_sharding(("embed",), (12,), mesh, path="w")


def test_sharded_forward_equals_single_device():
    """fsdp=4 x tensor=2 forward (jit, params sharded) == single-device forward."""
    from tests.models.hf_tiny import IMAGE_TOKEN, VISION_END, VISION_START

    cfg = qwen_vl.tiny("qwen3_vl")
    ref_model = qwen_vl.init_random(cfg, seed=3)
    sharded = qwen_vl.init_random(cfg, seed=3)
    mesh = shd.make_mesh(fsdp=4, tensor=2)
    shd.shard_model(sharded, mesh)
    kernel = sharded.model.language_model.layers[0].mlp.gate_proj.kernel.get_value()
    assert kernel.sharding.spec == P("fsdp", "tensor")
    assert len(kernel.addressable_shards) == 8

    rng = np.random.default_rng(0)
    grid = np.array([[1, 4, 6]])
    C = 3 * 2 * 16 * 16
    pv = rng.standard_normal((24, C)).astype(np.float32)
    ids = np.concatenate([rng.integers(0, 400, 5), [VISION_START], [IMAGE_TOKEN] * 6, [VISION_END]])
    ids = np.stack([ids, *rng.integers(0, 400, (3, len(ids)))])  # rows 1-3: text only

    pos = ref_model.position_ids_for(ids, None, grid)
    meta = qwen_vl.vision_metadata(cfg, grid)
    ref = np.asarray(ref_model(ids, pixel_values=pv, position_ids=pos, vision_meta=meta))

    @nnx.jit
    def fwd(model, ids, pv, pos, meta):
        return model(ids, pixel_values=pv, position_ids=pos, vision_meta=meta)

    batch = jax.sharding.NamedSharding(mesh, shd.logical_to_spec(("batch", None)))
    out = fwd(sharded, jax.device_put(ids, batch), pv, pos, meta)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=0)
