"""Every real preset's mesh and sharding rules divide the real checkpoint's shapes.

The shapes are those of the published `config.json` files (text and vision towers), listed in
`qwen_vl.published_config`; the model is built abstractly (`nnx.eval_shape`, no memory), so a 72B
layout is checked on a laptop. A preset whose tensor-parallel size does not divide a weight would
otherwise fail only on the TPU slice, at `shard_model`, after the checkpoint download.
"""

import jax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

from configs import qwen3vl_grpo, qwen25vl_grpo
from cua_jax import sharding as shd
from cua_jax.models import qwen_vl

REAL = qwen_vl.PUBLISHED  # the published config.json dims (cua_jax/models/qwen_vl/config.py)
MODULES = {"qwen2_5_vl": qwen25vl_grpo, "qwen3_vl": qwen3vl_grpo}


def real_config(family: str, size: str) -> qwen_vl.QwenVLConfig:
    return qwen_vl.published_config(family, size)


def test_every_real_preset_is_listed():
    listed = {(f, p) for f, m in MODULES.items() for p in m.PRESETS if p != "smoke"}
    assert listed == set(REAL)


@pytest.mark.parametrize("family,size", sorted(REAL))
@pytest.mark.parametrize("fsdp", [8, 32])
def test_preset_mesh_divides_the_real_model(family, size, fsdp):
    config = MODULES[family].get_config(size)
    rules = tuple(shd.DEFAULT_RULES) + tuple(tuple(r) for r in config.mesh.rules)
    mesh = AbstractMesh((config.mesh.data, fsdp, config.mesh.tensor), shd.MESH_AXES)
    cfg = real_config(family, size)
    model = nnx.eval_shape(lambda: qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    specs = shd.param_specs(state, rules)
    shapes = {".".join(map(str, p)): v.get_value().shape for p, v in nnx.to_flat_state(state)}
    assert specs.keys() == shapes.keys()
    for path, spec in specs.items():
        shd._check_divisible(path, shapes[path], spec, mesh)
    n = sum(x.size for x in jax.tree.leaves(state))
    assert 1e9 < n < 1e11  # the model really is the checkpoint's size
