"""LoRA on the tiny Qwen3-VL: only adapters train; a fresh learner's reference == the base model,
a learner built after SFT keeps the SFT policy as reference, also after a checkpoint round trip;
merge-then-forward == the adapted forward."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from cua_jax.models import lora, qwen_vl
from cua_jax.rl.learner import Learner, LoraConfig, LossConfig, OptimizerConfig
from cua_jax.rl.trajectory import Trajectory, Turn

_TINY = qwen_vl.tiny("qwen3_vl", vocab_size=256)
CFG = _TINY.replace(
    text=dataclasses.replace(_TINY.text, num_hidden_layers=1),
    vision=dataclasses.replace(_TINY.vision, depth=1, deepstack_visual_indexes=(0,)),
)


def _groups():
    rng = np.random.default_rng(0)
    groups = []
    for g in range(2):
        grp = []
        for _ in range(4):
            p, n = rng.integers(0, 200, rng.integers(4, 12)), int(rng.integers(3, 9))
            turn = Turn(p, rng.integers(0, 200, n), -rng.random(n) * 4)
            grp.append(Trajectory("t", f"g{g}", [turn], reward=float(rng.random())))
        groups.append(grp)
    return groups


def _flat(model, filt):
    # A wrapped layer's kernel lives at <layer>.base_module.kernel; compare by the base path.
    return {
        tuple(k for k in p if k != "base_module"): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(model, filt))
    }


def _logprobs(model, batch):
    logits = model(batch.input_ids, position_ids=batch.position_ids, segment_ids=batch.segment_ids)
    lp = jax.nn.log_softmax(logits[:, :-1], -1)
    return np.take_along_axis(np.asarray(lp), batch.input_ids[:, 1:, None], -1)[..., 0]


def test_apply_lora_targets_and_errors():
    model = qwen_vl.QwenVL(CFG, rngs=nnx.Rngs(0))
    paths = lora.apply_lora(model, 2, 4.0, rngs=nnx.Rngs(1))
    assert len(paths) == 7 * CFG.text.num_hidden_layers
    assert all("language_model.layers" in p for p in paths)
    a = model.model.language_model.layers[0].self_attn.q_proj.lora_a
    assert a.get_metadata()["out_sharding"] == ("embed", None)
    with pytest.raises(ValueError, match="target_modules"):
        lora.apply_lora(qwen_vl.QwenVL(CFG, rngs=nnx.Rngs(0)), 2, 4.0, ["no_such_layer"])


def test_lora_learner_reference_and_merge():
    base = qwen_vl.QwenVL(CFG, rngs=nnx.Rngs(0))
    model = qwen_vl.QwenVL(CFG, rngs=nnx.Rngs(0))
    learner = Learner(
        model,
        lora=LoraConfig(rank=4, alpha=8.0),
        seq_len_buckets=(32,),
        loss=LossConfig(kl_coef=0.1, kl_estimator="k3"),
        optimizer=OptimizerConfig(learning_rate=1e-2),
    )
    batch, _ = learner.prepare_batch(_groups())
    base_params = _flat(base, nnx.Param)
    for _ in range(3):
        m = learner.train_step(batch)
    assert m["kl"] > 0  # the adapted policy has moved away from the base (reference) policy
    # Only adapters changed: every base weight is bit-identical to the untouched base model.
    after = _flat(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    assert after.keys() == base_params.keys()
    for k, v in base_params.items():
        np.testing.assert_array_equal(after[k], v, err_msg=str(k))
    adapters = _flat(model, nnx.LoRAParam)
    assert len(adapters) == 2 * 7 and all(
        np.abs(v).max() > 0 for k, v in adapters.items() if k[-1] == "lora_b"
    )
    # Reference log-probs (the adapters as the learner started: B = 0) == the base model's.
    mask = batch.loss_mask[:, 1:]
    ref = learner.token_logprobs(batch, reference=True)[:, 1:]
    want = _logprobs(base, batch)
    np.testing.assert_allclose(ref[mask], want[mask], rtol=1e-5, atol=1e-5)
    adapted = learner.token_logprobs(batch)[:, 1:]
    assert np.abs(adapted[mask] - want[mask]).max() > 1e-3
    # Merge then forward == adapted forward; the merged model has no adapters left.
    merged = lora.merge_lora(nnx.clone(model))
    assert not lora.has_lora(merged) and lora.has_lora(model)
    np.testing.assert_allclose(_logprobs(merged, batch)[mask], adapted[mask], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_lora", [True, False])
def test_reference_is_the_policy_rl_starts_from_and_survives_a_resume(use_lora, tmp_path):
    """After an SFT warm-up the RL learner's KL reference is the SFT policy (KL 0 at its first
    step), not the base model; a resumed learner, built from freshly initialised weights, gets
    the same reference back from the checkpoint."""
    from cua_jax.checkpoint.orbax_io import Checkpointer

    kw = dict(
        lora=LoraConfig(rank=4, alpha=8.0) if use_lora else None,
        seq_len_buckets=(32,),
        optimizer=OptimizerConfig(learning_rate=1e-2),
    )
    model = qwen_vl.QwenVL(CFG, rngs=nnx.Rngs(0))
    sft = Learner(model, **kw)
    batch, _ = sft.prepare_batch(_groups())
    for _ in range(3):
        sft.sft_step(batch)
    mask = batch.loss_mask[:, 1:]
    sft_lp = sft.token_logprobs(batch)[:, 1:]
    base_lp = _logprobs(qwen_vl.QwenVL(CFG, rngs=nnx.Rngs(0)), batch)
    assert np.abs(sft_lp[mask] - base_lp[mask]).max() > 1e-2  # SFT moved the policy

    rl = Learner(model, loss=LossConfig(kl_coef=0.1, kl_estimator="k3"), **kw)
    ref = rl.token_logprobs(batch, reference=True)[:, 1:]
    np.testing.assert_allclose(ref[mask], sft_lp[mask], rtol=1e-5, atol=1e-5)
    assert rl.train_step(batch)["kl"] == pytest.approx(0.0, abs=1e-6)
    rl.train_step(batch)
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    ckpt.save(2, rl.state_dict(), {}, force=True)
    ckpt.wait()

    fresh = qwen_vl.QwenVL(CFG, rngs=nnx.Rngs(0))  # a resumed run starts from init weights
    resumed = Learner(fresh, loss=LossConfig(kl_coef=0.1, kl_estimator="k3"), **kw)
    state, _ = ckpt.restore(resumed.abstract_state())
    resumed.load_state_dict(state)
    ckpt.close()
    again = resumed.token_logprobs(batch, reference=True)[:, 1:]
    np.testing.assert_allclose(again[mask], sft_lp[mask], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        resumed.token_logprobs(batch)[:, 1:][mask],
        rl.token_logprobs(batch)[:, 1:][mask],
        rtol=1e-5,
        atol=1e-5,
    )


def test_config_lora_targets_leave_the_vision_tower_alone():
    """The configs' default targets are the language model's projections only: bare names would
    also wrap Qwen2.5-VL's vision MLP (gate/up/down_proj), trained even with freeze_vision."""
    from configs.qwen25vl_grpo import get_config

    targets = tuple(get_config("smoke").model.lora_targets)
    assert targets == lora.DEFAULT_TARGETS
    model = qwen_vl.QwenVL(qwen_vl.tiny("qwen2_5_vl", vocab_size=256), rngs=nnx.Rngs(0))
    paths = lora.apply_lora(model, 2, 4.0, targets, rngs=nnx.Rngs(1))
    assert paths and not any("visual" in p for p in paths)
    bare = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    m2 = qwen_vl.QwenVL(qwen_vl.tiny("qwen2_5_vl", vocab_size=256), rngs=nnx.Rngs(0))
    assert any("visual" in p for p in lora.apply_lora(m2, 2, 4.0, bare, rngs=nnx.Rngs(1)))
