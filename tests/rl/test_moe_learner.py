"""The MoE learner: routing replay, the routing-mismatch metric, the router's auxiliary loss.

Episodes are sampled by the agent loop on a real Engine over a tiny Qwen3-VL-MoE (f32), so the
routes and behaviour log-probs are the sampler's own. References are the model's plain forward
(`model(..., routes=...)`) and a numpy load-balancing loss, not the learner's code path.
"""

import asyncio

import jax
import numpy as np
import pytest
from flax import nnx

from cua_jax.data.processor import QwenVLProcessor
from cua_jax.models import qwen_vl
from cua_jax.rl.learner import Learner, LossConfig
from cua_jax.rl.packing import pack
from cua_jax.rl.rollout import AgentLoop, RolloutSettings
from cua_jax.rl.trajectory import Sample, rope_position_fn, trajectory_to_samples
from cua_jax.sampler import Engine
from tests.rl.test_rollout import TASK, Pool

BUCKET = (256,)  # the compact prompt: a two-turn episode is ~220 tokens


@pytest.fixture(scope="module")
def episode():
    """(config, samples of two sampled episodes)."""
    proc = QwenVLProcessor.default("qwen3_vl", max_pixels=64 * 64, min_pixels=32 * 32)
    tok = proc.tokenizer
    cfg = qwen_vl.tiny("qwen3_vl", vocab_size=tok.vocab_size, moe=True, **tok.vision_token_ids())
    engine = Engine(
        qwen_vl.init_random(cfg, seed=0),
        max_slots=2,
        page_size=16,
        num_pages=256,
        max_seq_len=512,
    )
    settings = RolloutSettings(max_turns=2, max_new_tokens=8, system_prompt="compact")
    loop = AgentLoop(engine, proc, settings)
    trajs = asyncio.run(loop.run_group(Pool(2), TASK, 2, seed=3, group_id="g"))
    samples = []
    for i, t in enumerate(trajs):
        for s in trajectory_to_samples(t, 1.0 - 2.0 * i, rope_position_fn(cfg)):
            s.episode = i
            samples.append(s)
    assert all(s.routes is not None for s in samples)
    return cfg, samples


def _learner(cfg, **loss):
    model = qwen_vl.init_random(cfg, seed=0)  # the sampler's weights
    return Learner(model, loss=LossConfig(**loss), seq_len_buckets=BUCKET, donate=False)


def _tampered(samples, num_experts):
    """The samples with layer 0's recorded experts changed on every other recorded token, and
    how many (token, layer) pairs now differ from what the sampler chose."""
    out, changed = [], 0
    for s in samples:
        routes = s.routes.copy()
        rec = np.flatnonzero(np.all(routes >= 0, axis=(1, 2)))
        for t in rec[::2]:
            new = (routes[t, 0] + 1) % num_experts
            changed += int(set(new.tolist()) != set(routes[t, 0].tolist()))
            routes[t, 0] = new
        out.append(Sample(**{**s.__dict__, "routes": routes}))
    return out, changed


def _reference(model, s: Sample, routes=None):
    """Plain forward over one sample: (log π(token t | < t) f32[T] (0 at t=0), RoutingInfo)."""
    logits, info = model(
        s.input_ids[None],
        pixel_values=s.pixel_values,
        image_grid_thw=s.image_grid_thw,
        position_ids=s.position_ids[:, None],
        routes=None if routes is None else np.transpose(routes, (1, 0, 2))[:, None],
        return_routing=True,
    )
    lp = np.asarray(jax.nn.log_softmax(np.asarray(logits[0], np.float64), axis=-1))
    tok = np.asarray(s.input_ids)
    return np.concatenate([[0.0], lp[np.arange(len(tok) - 1), tok[1:]]]), info


def _recorded(samples, layers):
    return sum(int(np.all(s.routes >= 0, axis=(1, 2)).sum()) for s in samples) * layers


def test_packed_routes_are_token_aligned(episode):
    _, samples = episode
    dense = Sample(**{**samples[0].__dict__, "routes": None, "episode": 7})
    batch = pack([*samples, dense], seq_len_buckets=BUCKET)
    assert batch.routes.shape == (*batch.shape, 2, 2)
    for s in samples:
        rows, cols = _locate(batch, s, s.routes)
        np.testing.assert_array_equal(batch.routes[rows, cols], s.routes)
    _locate(batch, dense, np.full_like(samples[0].routes, -1))  # a sample without routes: -1
    assert (batch.routes[batch.segment_ids == 0] == -1).all()  # padding
    assert pack([dense], seq_len_buckets=BUCKET).routes is None  # dense: no routes array


def test_replay_reproduces_the_samplers_logprobs(episode):
    cfg, samples = episode
    layers = 2
    learner = _learner(cfg, routing_replay=True)
    batch = learner.pack(samples)
    mask = batch.loss_mask
    lp = learner.token_logprobs(batch)
    np.testing.assert_allclose(lp[mask], batch.behaviour_logprobs[mask], atol=1e-5, rtol=0)
    metrics, _ = learner.loss_and_grads(batch)
    assert metrics["routing_recorded"] == _recorded(samples, layers) > 0
    assert metrics["routing_mismatch"] == 0.0  # same weights: the learner's router agrees

    # Changed routes: the learner's log-probs follow them (the plain forward replaying the same
    # routes is the reference), so they now differ from the sampler's.
    bad, changed = _tampered(samples, cfg.text.num_experts)
    assert changed > 0
    bad_batch = learner.pack(bad)
    lp_bad = learner.token_logprobs(bad_batch)
    ref_model = qwen_vl.init_random(cfg, seed=0)
    differ = recorded = 0
    for s in bad:
        ref_lp, info = _reference(ref_model, s, s.routes)
        rows, cols = _locate(bad_batch, s, s.routes)
        np.testing.assert_allclose(lp_bad[rows, cols], ref_lp, atol=1e-5, rtol=0)
        own = np.sort(np.asarray(jax.lax.top_k(info.router_logits[:, 0], 2)[1]), -1)  # [L,T,K]
        rec = np.all(s.routes >= 0, axis=(1, 2))
        replayed = np.sort(np.transpose(s.routes, (1, 0, 2)), -1)
        differ += int(np.any(own != replayed, -1)[:, rec].sum())
        recorded += int(rec.sum()) * layers
    m = bad_batch.loss_mask
    assert np.abs(lp_bad[m] - bad_batch.behaviour_logprobs[m]).max() > 1e-3
    metrics, _ = learner.loss_and_grads(bad_batch)
    assert differ > 0 and metrics["routing_recorded"] == recorded
    np.testing.assert_allclose(metrics["routing_mismatch"], differ / recorded, rtol=1e-6)


def test_without_replay_the_mismatch_is_reported(episode):
    cfg, samples = episode
    learner = _learner(cfg)
    bad, changed = _tampered(samples, cfg.text.num_experts)
    batch = learner.pack(bad)
    m = batch.loss_mask
    lp = learner.token_logprobs(batch)  # routes are not used: the sampler's computation
    np.testing.assert_allclose(lp[m], batch.behaviour_logprobs[m], atol=1e-5, rtol=0)
    metrics, _ = learner.loss_and_grads(batch)
    # the learner routes as the sampler did, so exactly the changed pairs differ
    np.testing.assert_allclose(
        metrics["routing_mismatch"], changed / _recorded(samples, 2), rtol=1e-6
    )
    assert "router_aux_loss" not in metrics


def _np_load_balancing(router_logits_LTE, top_k, mask_T):
    """Switch-Transformer aux loss in plain numpy: E * sum_e f_e * P_e over masked tokens."""
    x = np.asarray(router_logits_LTE, np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    E = p.shape[-1]
    top = np.argsort(-p, axis=-1)[..., :top_k]
    counts = np.zeros_like(p)
    np.put_along_axis(counts, top, 1.0, axis=-1)
    m = np.asarray(mask_T, bool)
    f = counts[:, m].sum((0, 1)) / (m.sum() * p.shape[0])
    P = p[:, m].sum((0, 1)) / (m.sum() * p.shape[0])
    return E * float((f * P).sum())


def _locate(batch, s, routes=None):
    """(rows, cols) of sample `s`'s tokens in a packed batch (with these routes, if given)."""
    for r in range(batch.shape[0]):
        for k in range(1, batch.segment_ids[r].max() + 1):
            cols = np.flatnonzero(batch.segment_ids[r] == k)
            if np.array_equal(batch.input_ids[r, cols], s.input_ids) and (
                routes is None or np.array_equal(batch.routes[r, cols], routes)
            ):
                return np.full(cols.size, r), cols
    raise AssertionError("sample not in the batch")


def test_router_aux_loss_equals_a_numpy_reference(episode):
    cfg, samples = episode
    coef = 0.25
    plain = _learner(cfg)
    aux = _learner(cfg, router_aux_coef=coef)
    batch = plain.pack(samples)
    m_plain, _ = plain.loss_and_grads(batch)
    m_aux, _ = aux.loss_and_grads(batch)
    # reference: one load-balancing loss over every trained token of the batch (one
    # micro-batch), from the plain forward's router logits
    ref_model = qwen_vl.init_random(cfg, seed=0)
    logits, masks = [], []
    for s in samples:
        _, info = _reference(ref_model, s)
        logits.append(np.asarray(info.router_logits[:, 0]))
        masks.append(s.loss_mask)
    want = _np_load_balancing(np.concatenate(logits, 1), 2, np.concatenate(masks))
    np.testing.assert_allclose(m_aux["router_aux_loss"], want, rtol=1e-5)
    np.testing.assert_allclose(m_aux["loss"] - m_plain["loss"], coef * want, rtol=1e-4)


@pytest.mark.parametrize("rows_over", ["fsdp", "fsdp+expert"])
def test_expert_parallel_learner_equals_one_device(episode, rows_over):
    """fsdp=2 x expert=2 x tensor=2 (8 devices: rows, routes and experts sharded) == 1 device:
    replayed routes (changed ones, so replay matters), mismatch, aux loss, loss and gradients.
    "fsdp+expert": the rules split the rows over the expert devices too, so the learner's batch
    is 4-way and its MoE layers dispatch by all-to-all, each layer rematerialised in the
    backward order `text.ordered_checkpoint` pins (model.remat="ordered")."""
    from cua_jax import sharding as shd
    from cua_jax.models.qwen_vl import moe

    assert len(jax.devices()) == 8
    cfg, samples = episode
    bad, _ = _tampered(samples, cfg.text.num_experts)
    kw = dict(routing_replay=True, router_aux_coef=0.1)
    one = _learner(cfg, **kw)
    mesh = shd.make_mesh(1, 2, 2, expert=2)
    rules = shd.DEFAULT_RULES
    if rows_over == "fsdp+expert":
        rules = (*shd.DEFAULT_RULES, ("batch", ("data", "fsdp", "expert")))
        cfg = cfg.replace(remat="ordered")
    model = qwen_vl.init_random(cfg, seed=0)
    eight = Learner(
        model,
        mesh=mesh,
        rules=rules,
        loss=LossConfig(**kw),
        seq_len_buckets=BUCKET,
        donate=False,
    )
    gate_up = eight.model.model.language_model.layers[0].mlp.experts.gate_up_proj[...]
    assert gate_up.sharding.spec[0] == "expert"
    want = "fsdp" if rows_over == "fsdp" else ("fsdp", "expert")
    assert eight.route_shape == (2, 2) and eight.route_sharding.spec[0] == want
    assert eight.layout.batch_parallel == (2 if rows_over == "fsdp" else 4)
    blocks = [b for _, b in nnx.iter_modules(eight.model) if isinstance(b, moe.SparseMoeBlock)]
    assert blocks and all(
        moe.choose_all_to_all(b.dispatch, b.rules, ("expert",)) == (rows_over != "fsdp")
        for b in blocks
    )
    m1, g1 = one.loss_and_grads(one.pack(bad))
    m8, g8 = eight.loss_and_grads(eight.pack(bad))
    assert m1["routing_mismatch"] > 0
    for k in ("loss", "routing_mismatch", "routing_recorded", "router_aux_loss", "grad_norm"):
        assert m8[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-7), k
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-6)


def test_dense_models_refuse_moe_options():
    cfg = qwen_vl.tiny("qwen3_vl")
    with pytest.raises(ValueError, match="need a MoE model"):
        Learner(qwen_vl.init_random(cfg), loss=LossConfig(routing_replay=True))
    with pytest.raises(ValueError, match="router_aux_coef"):
        LossConfig(router_aux_coef=-1.0)


def _smoke_config(**overrides):
    from configs import qwen3vl_grpo

    c = qwen3vl_grpo.get_config("smoke")
    for key, value in overrides.items():
        section, name = key.split(".")
        c[section][name] = value
    return c


def test_config_keys_build_the_tiny_moe_and_are_checked():
    from cua_jax.config.checks import ConfigError, validate_config
    from cua_jax.job import builders

    c = _smoke_config(
        **{
            "model.preset": "tiny_moe",
            "rl.routing_replay": True,
            "rl.router_aux_coef": 0.01,
            "mesh.expert": 1,
        }
    )
    validate_config(c)
    mesh, rules = builders.mesh_and_rules(c, devices=jax.devices()[:1])
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
    model, _ = builders.build_model_and_processor(c, mesh, rules)
    assert model.config.text.num_experts == 8 and model.config.model_type == "qwen3_vl_moe"
    learner = builders.build_learner(model, c, mesh, rules, sft=False)
    assert learner.loss_config.routing_replay and learner.loss_config.router_aux_coef == 0.01
    sft = builders.build_learner(qwen_vl.init_random(model.config), c, mesh, rules, sft=True)
    assert not sft.loss_config.routing_replay  # SFT data has no sampler routes
    for bad, match in [
        ({"rl.routing_replay": True}, "rl.routing_replay=True is for MoE models"),
        ({"rl.router_aux_coef": 0.1}, "rl.router_aux_coef=0.1 is for MoE models"),
        ({"mesh.expert": 2}, "mesh.expert=2 is for MoE models"),
        ({"model.preset": "tiny_moe", "mesh.expert": 3}, "does not divide the model's 8"),
        ({"model.preset": "huge"}, "one of tiny, small, tiny_moe"),
        ({"mesh.expert": 0}, "config.mesh.expert=0 is out of range"),
        ({"model.preset": "tiny_moe", "rl.router_aux_coef": -1.0}, "router_aux_coef=-1.0"),
    ]:
        with pytest.raises(ConfigError, match=match):
            validate_config(_smoke_config(**bad))
    with pytest.raises(ConfigError, match="expert=2"):  # 1 device cannot hold expert=2
        builders.mesh_and_rules(_smoke_config(**{"mesh.expert": 2}), devices=jax.devices()[:1])


def test_model_moe_dispatch_reaches_every_moe_block_of_a_tiny_or_loaded_model(tmp_path):
    """config.model.moe_dispatch is the dispatch of every MoE block the builder makes: the tiny
    MoE's, and a local checkpoint's (whose blocks are built "auto", then set); a bad value is
    one line at the config check."""
    from cua_jax.config.checks import ENUMS, ConfigError, validate_config
    from cua_jax.job import builders
    from cua_jax.models.qwen_vl.moe import MOE_DISPATCHES, SparseMoeBlock
    from tests.data.hf_local import save_hf_processor_dir

    assert ENUMS["model.moe_dispatch"] == MOE_DISPATCHES

    def dispatches(model):
        return {m.dispatch for _, m in nnx.iter_modules(model) if isinstance(m, SparseMoeBlock)}

    c = _smoke_config(**{"model.preset": "tiny_moe", "model.moe_dispatch": "all_to_all"})
    validate_config(c)
    mesh, rules = builders.mesh_and_rules(c, devices=jax.devices()[:1])
    model, _ = builders.build_model_and_processor(c, mesh, rules)
    assert model.config.moe_dispatch == "all_to_all" and dispatches(model) == {"all_to_all"}
    save_hf_processor_dir("qwen3_vl", str(tmp_path))  # a processor to load beside it
    qwen_vl.save_pretrained(model, str(tmp_path))
    c = _smoke_config(**{"model.hf_path": str(tmp_path), "model.moe_dispatch": "all_gather"})
    loaded, _ = builders.build_model_and_processor(c, mesh, rules)
    assert loaded.config.moe_dispatch == "all_gather" and dispatches(loaded) == {"all_gather"}
    with pytest.raises(ConfigError, match="config.model.moe_dispatch='scatter' is not one of"):
        validate_config(_smoke_config(**{"model.moe_dispatch": "scatter"}))


def test_small_preset_is_tiny_at_twice_the_depth_and_width():
    from cua_jax.config.checks import validate_config
    from cua_jax.job import builders

    for family in ("qwen3_vl", "qwen2_5_vl"):
        c = _smoke_config(**{"model.preset": "small", "model.family": family})
        validate_config(c)
        mesh, rules = builders.mesh_and_rules(c, devices=jax.devices()[:1])
        model, _ = builders.build_model_and_processor(c, mesh, rules)
        t, v = model.config.text, model.config.vision
        assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads) == (256, 4, 8)
        assert (v.depth, v.hidden_size, v.out_hidden_size) == (4, 128, 256)
        if family == "qwen3_vl":  # an 8x8 position grid, DeepStack from the last two blocks
            assert v.num_position_embeddings == 64 and v.deepstack_visual_indexes == (2, 3)
        else:  # window, full, window, full
            assert v.fullatt_block_indexes == (1, 3)


def test_real_moe_preset():
    from configs import qwen3vl_grpo
    from cua_jax.models import lora

    c = qwen3vl_grpo.get_config("30b-a3b")
    assert c.model.lora_rank == 32 and tuple(c.model.lora_targets) == lora.MOE_TARGETS
    assert c.mesh.expert == 4 and c.rl.routing_replay  # v5p-8: 32 experts on each chip
    real = qwen_vl.published_config("qwen3_vl", "30b-a3b")
    assert real.model_type == "qwen3_vl_moe" and real.text.num_experts % c.mesh.expert == 0
    assert (real.text.num_experts, real.text.num_experts_per_tok) == (128, 8)


def test_smoke_main_job_runs_the_tiny_moe(tmp_path):
    """launch/tpu.py end to end (rollouts in Chromium, a GRPO step with routing replay and the
    aux loss, an eval, a checkpoint) on --config.model.preset=tiny_moe, cut to one step."""
    from tests.main_job import metrics_rows, run_main_job

    args = [
        "--config=configs/qwen3vl_grpo.py:smoke",
        "--config.model.preset=tiny_moe",
        "--config.rl.routing_replay=True",
        "--config.rl.router_aux_coef=0.01",
        "--config.rl.filter_zero_variance=False",  # an untrained policy's group still trains
        "--config.total_steps=1",
        "--config.sft.steps=0",
        "--config.rl.group_size=2",
        "--config.rl.groups_per_batch=1",
        "--config.rl.max_tokens=16",
        "--config.env.concurrency=2",
        "--config.env.max_turns=1",
        "--config.log.eval_every=1",
        "--config.log.progress=False",
        "--config.compile_cache_dir=",
        "--config.tasks=({'source_type': 'builtin', 'split': 'train', 'difficulty': 'easy', "
        "'category': 'click', 'seed': 0, 'limit': 1},)",
        "--config.eval_tasks=({'source_type': 'builtin', 'split': 'eval', 'difficulty': 'easy', "
        "'seed': 1000, 'limit': 1},)",
    ]
    run_main_job(args, str(tmp_path))
    rows = metrics_rows(str(tmp_path))
    trained = [row for row in rows if "train/loss" in row]
    assert len(trained) == 1
    row = trained[0]
    assert 0.0 <= row["train/routing_mismatch"] <= 1.0 and row["train/routing_recorded"] > 0
    assert np.isfinite(row["train/router_aux_loss"]) and row["train/router_aux_loss"] > 0
    assert "eval/success" in rows[-1]
