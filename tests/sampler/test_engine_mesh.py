"""The Engine on a mesh of forced host devices (tests/conftest.py forces 8) == on one device.

* colocated: the learner's sharded parameters (fsdp x tensor for Qwen2.5-VL, data x tensor for
  Qwen3-VL) are used in place,
  K/V pages are split by kv head over `tensor`, and greedy and sampled outputs (text, images, a
  second turn reusing the session's cached K/V) are token-identical to a 1-device Engine;
* disaggregated: an Engine on its own 2-device sub-mesh takes parameters that live on another
  mesh, at construction and in update_params (resharded onto its devices);
* the randomized multi-turn stress workload (GRPO groups, preemption, weight updates) on a
  4-device mesh gives every turn what the same workload gives on one device.
"""

import asyncio

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

pytest.importorskip("torch")
pytest.importorskip("transformers")

from cua_jax import sharding as shd  # noqa: E402
from cua_jax.models import qwen_vl  # noqa: E402
from cua_jax.sampler import Engine, SamplingParams  # noqa: E402
from tests.models.hf_tiny import image_inputs, prompt_ids  # noqa: E402
from tests.sampler import test_engine_stress as stress  # noqa: E402

KW = dict(max_slots=4, page_size=8, num_pages=64, max_seq_len=128, decode_chunk=4)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_new_tokens=6)


def _model(family: str, mesh=None):
    model = qwen_vl.init_random(qwen_vl.tiny(family), seed=1)
    return shd.shard_model(model, mesh) if mesh is not None else model


def _run(engine, family):
    """Two text prompts (one sampled), then a two-turn session with a screenshot per turn."""
    pv, grid = image_inputs(family, [(56, 56), (56, 56)], seed=4)
    per = int(np.prod(grid[0]))
    p1 = prompt_ids(grid[:1], [5, 4], seed=1)
    outs = engine.generate_batch(
        [
            dict(prompt_ids=prompt_ids(None, [5], seed=2), params=GREEDY),
            dict(prompt_ids=prompt_ids(None, [13], seed=3), params=SAMPLED),
            dict(
                prompt_ids=p1,
                pixel_values=pv[:per],
                image_grid_thw=grid[:1],
                params=GREEDY,
                session_id="ep",
            ),
        ]
    )
    p2 = np.concatenate([p1, outs[2].tokens, prompt_ids(grid[1:], [3, 4], seed=5)])
    (turn2,) = engine.generate_batch(
        [dict(prompt_ids=p2, pixel_values=pv, image_grid_thw=grid, params=GREEDY, session_id="ep")]
    )
    assert turn2.num_cached_tokens == len(p1) + len(outs[2].tokens) - 1
    engine.drop_session("ep")
    engine.check_pages()
    return [*outs, turn2]


def _assert_same(outs, want):
    for o, w in zip(outs, want, strict=True):
        assert (o.tokens, o.finish_reason) == (w.tokens, w.finish_reason)
        np.testing.assert_allclose(o.logprobs, w.logprobs, atol=1e-5)
        np.testing.assert_allclose(o.model_logprobs, w.model_logprobs, atol=1e-5)


@pytest.fixture(scope="module")
def reference():
    """Outputs of `_run` on one device, per family (computed on first use)."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = _run(Engine(_model(family), **KW), family)
        return cache[family]

    return get


def _check_placement(engine, model, mesh):
    for k in engine.cache.k:  # pages split by kv head over `tensor`, replicated elsewhere
        assert k.sharding.mesh == mesh and k.sharding.spec == PartitionSpec("tensor")
        assert k.addressable_shards[0].data.shape[0] == model.config.text.num_key_value_heads // 2


# Both families and both colocated mesh shapes are covered with one Engine each (compiles are
# what costs time here), plus a sampler on its own sub-mesh.
@pytest.mark.parametrize(
    "family,axes",
    [("qwen2_5_vl", (1, 4, 2)), ("qwen3_vl", (4, 1, 2))],
    ids=["qwen2_5_vl-fsdp4xtensor2", "qwen3_vl-data4xtensor2"],
)
def test_colocated_mesh_equals_one_device(reference, family, axes):
    mesh = shd.make_mesh(*axes)
    model = _model(family, mesh)
    if family == "qwen3_vl":
        # Without mesh= the parameters' own mesh is used (before, the K/V pool went to device 0
        # and every call failed with "incompatible devices").
        engine = Engine(model, **KW)
        assert engine.mesh == mesh
    else:
        engine = Engine(model, mesh=mesh, **KW)
    # The learner's arrays themselves: no gather, no copy.
    theirs = jax.tree.leaves(nnx.state(model, nnx.Param))
    for mine, their in zip(jax.tree.leaves(engine._state), theirs, strict=True):
        assert mine is their
    assert any(x.sharding.spec != PartitionSpec() for x in theirs)
    _check_placement(engine, model, mesh)
    _assert_same(_run(engine, family), reference(family))


def test_disaggregated_sampler_mesh_reshards_updates(reference):
    """Learner on devices 0-3 (fsdp 2 x tensor 2), sampler on devices 4-5 (tensor 2). The
    sampler starts from other weights; update_params brings the learner's, resharded onto the
    sampler's devices, and the outputs then equal the 1-device run of the learner's weights."""
    family = "qwen3_vl"
    devices = jax.devices()
    learner_mesh = shd.make_mesh(1, 2, 2, devices=devices[:4])
    sampler_mesh = shd.make_mesh(1, 1, 2, devices=devices[4:6])
    start = shd.shard_model(qwen_vl.init_random(qwen_vl.tiny(family), seed=9), learner_mesh)
    engine = Engine(start, mesh=sampler_mesh, **KW)
    on_sampler = {d.id for d in devices[4:6]}
    assert all({d.id for d in x.devices()} <= on_sampler for x in jax.tree.leaves(engine._state))
    engine.update_params(_model(family, learner_mesh), version=5)
    outs = _run(engine, family)
    assert all(o.version == 5 for o in outs)
    assert all({d.id for d in x.devices()} <= on_sampler for x in jax.tree.leaves(engine._state))
    _check_placement(engine, start, sampler_mesh)
    _assert_same(outs, reference(family))


def _logged(log):
    """{(prompt, sampling params): output} of a stress workload's turns."""
    out = {}
    for ids, _, _, p, o in log:
        assert (tuple(ids), p) not in out
        out[tuple(ids), p] = o
    return out


def test_stress_workload_on_a_4_device_mesh():
    """test_engine_stress's randomized workload (preemption, session reuse, GRPO groups, weight
    updates) on an fsdp 2 x tensor 2 mesh gives every turn exactly what the same workload gives
    on one device (where test_engine_stress shows each turn equals that turn run alone)."""
    images = [
        image_inputs(stress.FAM, [s], seed=i) for i, s in enumerate([(56, 56), (56, 84), (84, 56)])
    ]
    mesh = shd.make_mesh(1, 2, 2, devices=jax.devices()[:4])
    logs = []
    for m in (mesh, None):
        model = _model(stress.FAM, m)
        engine = Engine(
            model, max_slots=4, page_size=2, num_pages=18, max_seq_len=34, decode_chunk=5, mesh=m
        )
        logs.append(_logged(asyncio.run(stress._workload(engine, model, images, 20))))
        engine.check_pages()
        assert engine.stats["preemptions"] > 0 and engine.stats["cached_tokens"] > 0
        assert engine.version == 3
    on_mesh, alone = logs
    assert on_mesh.keys() == alone.keys() and len(alone) > 8
    _assert_same([on_mesh[k] for k in alone], list(alone.values()))


def test_step_functions_lower_from_abstract_shapes_on_a_mesh():
    """The AOT recipe of /tmp/coord/engine_api.md (tools/plan.py's use): every step function
    lowers from ShapeDtypeStructs alone, with the params' and pages' shardings in the program."""
    from cua_jax.sampler import placement, steps

    cfg = qwen_vl.tiny("qwen3_vl")
    mesh = shd.make_mesh(1, 4, 2)
    abstract_model = nnx.eval_shape(lambda: qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(0)))
    model_def, params = steps.ModelDef.of(abstract_model)
    param_sh = placement.target_shardings(params, mesh, shd.DEFAULT_RULES)
    params = jax.tree.map(
        lambda sh, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), param_sh, params
    )
    step_cfg = steps.StepConfig(page_size=16, decode_chunk=4, head_dim=cfg.text.head_dim, mesh=mesh)
    sh = steps.StepShardings(
        jax.tree.map(lambda x: x.sharding, params),
        placement.kv_sharding(mesh),
        placement.replicated(mesh),
    )
    t = cfg.text
    fns = steps.build_step_fns(model_def, step_cfg, sh, t.num_hidden_layers)
    cache = steps.abstract_cache(
        t.num_hidden_layers, t.num_key_value_heads, 64, 16, t.head_dim, cfg.dtype, sh.cache
    )
    for fn, args in [
        (fns.decode_paged, steps.decode_arg_shapes(8, 4)),
        (fns.decode_contiguous, steps.decode_arg_shapes(8, 4)),
        (fns.prefill(()), steps.prefill_arg_shapes(4, 32, 4)),
    ]:
        text = fn.lower(params, cache, *args).as_text()  # Shardy's dialect
        assert '<@mesh, [{"tensor"}, {}, {}, {}]>' in text  # pages: kv heads over tensor
        assert '[{"fsdp"}, {"tensor"}]' in text  # the params' own shardings
        # K/V write + attention of each layer under shard_map (a manual computation).
        assert text.count("sdy.manual_computation") == t.num_hidden_layers
