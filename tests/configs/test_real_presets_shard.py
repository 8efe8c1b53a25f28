"""Every real preset's mesh and sharding rules divide the real checkpoint's shapes.

The shapes are those of the published `config.json` files (text and vision towers), listed in
`qwen_vl.published_config`; the model is built abstractly (`nnx.eval_shape`, no memory), so a 72B
layout is checked on a laptop. A preset whose tensor-parallel size does not divide a weight would
otherwise fail only on the TPU slice, at `shard_model`, after the checkpoint download.
"""

import re

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
    sizes = {"data": config.mesh.data, "fsdp": fsdp, "tensor": config.mesh.tensor}
    mesh = AbstractMesh(tuple(sizes.get(a, 1) for a in shd.MESH_AXES), shd.MESH_AXES)
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


@pytest.mark.parametrize("family,size", sorted(REAL))
def test_every_real_preset_names_a_slice_its_mesh_fits(family, size):
    from cua_jax import plan

    module = MODULES[family]
    topo = plan.get_topology(module.TOPOLOGY[size])  # a known slice (tools/plan.py's table)
    line = re.compile(rf"^\s+{size}\s+{re.escape(topo.name)}\s", re.M)
    assert line.search(module.__doc__), (
        f"{module.__name__}'s docstring does not name {size}'s slice"
    )
    config = module.get_config(size)
    m = config.mesh
    fixed = m.data * m.tensor * m.expert * (m.fsdp if m.fsdp > 0 else 1)
    assert topo.num_chips % fixed == 0, (size, topo.name, dict(m))
    rows = config.rl.rows_per_step
    fsdp = m.fsdp if m.fsdp > 0 else topo.num_chips // (m.data * m.tensor * m.expert)
    # the learner packs rows in multiples of micro-batches x the batch axes
    rules = tuple(shd.DEFAULT_RULES) + tuple(tuple(r) for r in m.rules)
    sizes = {"data": m.data, "fsdp": fsdp, "expert": m.expert, "tensor": m.tensor}
    batch = 1
    for a in shd.batch_axes(rules):
        batch *= sizes[a]
    assert rows % (config.rl.num_substeps * batch) == 0, (size, rows, batch)
    # one sequence of max_seq_len fits the KV pool (the engine refuses otherwise)
    pages_per_seq = -(-config.sampler.max_seq_len // config.sampler.page_size)
    assert config.sampler.num_pages > pages_per_seq
