"""SDPO: the distillation divergences and their gradients against numbers done by hand, the
teacher context against the feedback conversation rendered token for token, a success never
taught by itself, and samples found in a packed batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cua_jax.data.processor import QwenVLProcessor
from cua_jax.rl import packing, sdpo
from cua_jax.rl.rollout import _Transcript
from cua_jax.rl.trajectory import Sample, Trajectory, Turn, text_position_ids

# Two tokens, vocabulary of two. Token 0: p_S = (0.5, 0.5), p_T = (0.8, 0.2); token 1:
# p_S = (0.9, 0.1), p_T = (0.5, 0.5).
S_LOGITS = np.log(np.array([[[0.5, 0.5], [0.9, 0.1]]], np.float32))
T_LOGP = np.log(np.array([[[0.8, 0.2], [0.5, 0.5]]], np.float32))

# By hand (ln 1.6 = 0.470004, ln 0.4 = -0.916291, ln(5/9) = -0.587787, ln 5 = 1.609438):
#   KL(T||S)_0 = 0.8 ln 1.6 + 0.2 ln 0.4                   = 0.192745
#   KL(T||S)_1 = 0.5 ln(0.5/0.9) + 0.5 ln 5                = 0.510826
#   KL(S||T)_0 = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2)         = 0.223144
#   KL(S||T)_1 = 0.9 ln 1.8 + 0.1 ln 0.2                   = 0.368064
#   JS_0: M = (0.65, 0.35); 0.5 KL(S||M) + 0.5 KL(T||M) = 0.5 (0.047155 + 0.054188) = 0.050672
#   JS_1: M = (0.7, 0.3);   0.5 KL(S||M) + 0.5 KL(T||M)                            = 0.101749
HAND = {
    "kl": (0.192745, 0.510826),
    "rkl": (0.223144, 0.368064),
    "js": (0.050672, 0.101749),
}
# d D / d student logit z_0 (z_1 gets the negative; two outcomes):
#   KL(T||S):  p_S - p_T                                   -> -0.3, 0.4
#   KL(S||T):  p_S,0 (ln(p_S,0 / p_T,0) - KL(S||T))          -> 0.5 (-0.470004 - 0.223144), ...
#   JS (β = ½): g_v = ½ (ln(p_S,v / M_v) + 1 - ½ p_S,v / M_v) - ¼ p_T,v / M_v,
#               dD/dz_0 = p_S,0 (g_0 - Σ_v p_S,v g_v)
HAND_GRAD_Z0 = {
    "kl": (-0.3, 0.4),
    "rkl": (-0.346574, 0.197750),
    "js": (-0.077380, 0.060747),
}


@pytest.mark.parametrize("div", ["kl", "rkl", "js"])
def test_divergence_equals_hand_computed(div):
    s, t = sdpo.student_support_logp(
        jnp.asarray(S_LOGITS), jnp.asarray([[[0, 1], [0, 1]]]), jnp.asarray(T_LOGP)
    )
    got = np.asarray(sdpo.token_divergence(s, t, div))
    np.testing.assert_allclose(got[0], HAND[div], atol=2e-6)


def test_generalised_js_beta():
    # β = 1/4, token 0: M = 0.75 p_S + 0.25 p_T = (0.575, 0.425);
    # 0.75 (0.5 ln(0.5/0.575) + 0.5 ln(0.5/0.425)) + 0.25 (0.8 ln(0.8/0.575) + 0.2 ln(0.2/0.425))
    # = 0.75 (0.5 (-0.139762) + 0.5 (0.162519)) + 0.25 (0.8 (0.330242) + 0.2 (-0.753772))
    # = 0.75 (0.011379) + 0.25 (0.113439) = 0.036894
    got = sdpo.token_divergence(
        jnp.log(jnp.array([0.5, 0.5])), jnp.log(jnp.array([0.8, 0.2])), "js", 0.25
    )
    assert float(got) == pytest.approx(0.036894, abs=2e-6)
    with pytest.raises(ValueError, match="js_beta"):
        sdpo.token_divergence(jnp.zeros(2), jnp.zeros(2), "js", 1.0)
    with pytest.raises(ValueError, match="unknown divergence"):
        sdpo.token_divergence(jnp.zeros(2), jnp.zeros(2), "tv")


@pytest.mark.parametrize("div", ["kl", "rkl", "js"])
def test_masked_token_mean_and_gradient_only_through_the_student(div):
    mask = np.array([[True, True]])
    weights = sdpo.distill_weights(mask)
    np.testing.assert_allclose(weights, [[0.5, 0.5]])

    def loss(z, t_logp):
        s, t = sdpo.student_support_logp(z, jnp.asarray([[[0, 1], [0, 1]]]), t_logp)
        return sdpo.distill_loss(sdpo.token_divergence(s, t, div), weights, mask)[0]

    value, (g_z, g_t) = jax.value_and_grad(loss, argnums=(0, 1))(
        jnp.asarray(S_LOGITS), jnp.asarray(T_LOGP)
    )
    assert float(value) == pytest.approx(0.5 * sum(HAND[div]), abs=2e-6)
    # The teacher is a target: no gradient reaches it.
    np.testing.assert_array_equal(np.asarray(g_t), 0.0)
    want = 0.5 * np.array([[[g, -g] for g in HAND_GRAD_Z0[div]]])  # token mean: x ½ each
    np.testing.assert_allclose(np.asarray(g_z), want, atol=2e-6)
    # A masked-off token adds nothing.
    half = np.array([[True, False]])
    only0 = sdpo.distill_loss(
        sdpo.token_divergence(
            *sdpo.student_support_logp(
                jnp.asarray(S_LOGITS), jnp.asarray([[[0, 1], [0, 1]]]), jnp.asarray(T_LOGP)
            ),
            div,
        ),
        sdpo.distill_weights(half),
        half,
    )[0]
    assert float(only0) == pytest.approx(HAND[div][0], abs=2e-6)


def test_top_k_adds_a_tail_bucket():
    # Vocabulary of 3, teacher's top-1 id 2 with p_T = 0.6; student p_S = (0.2, 0.3, 0.5).
    z = jnp.log(jnp.array([[[0.2, 0.3, 0.5]]]))
    s, t = sdpo.student_support_logp(z, jnp.array([[[2]]]), jnp.log(jnp.array([[[0.6]]])))
    np.testing.assert_allclose(np.exp(np.asarray(s)), [[[0.5, 0.5]]], atol=1e-6)
    np.testing.assert_allclose(np.exp(np.asarray(t)), [[[0.6, 0.4]]], atol=1e-6)
    # KL(T||S) over (id 2, rest) = 0.6 ln 1.2 + 0.4 ln 0.8 = 0.109393 - 0.089257 = 0.020136
    assert float(sdpo.token_divergence(s, t, "kl")[0, 0]) == pytest.approx(0.020136, abs=2e-6)


@pytest.mark.parametrize("div", ["kl", "js"])
def test_chunked_divergence_equals_unchunked(div):
    rng = np.random.default_rng(0)
    b, t, d, v, k = 2, 7, 5, 11, 4
    w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    tg = jnp.asarray(rng.integers(0, v, (b, t)))
    tid = jnp.asarray(np.argsort(rng.random((b, t, v)), axis=-1)[..., :k])
    tlp = jnp.asarray(np.log(rng.dirichlet(np.ones(v), (b, t))[..., :k]), jnp.float32)

    def total(w, chunk):
        lp, ent, dv = sdpo.chunked_stats_and_divergence(
            lambda x: x @ w, h, tg, tid, tlp, chunk=chunk, divergence=div
        )
        return jnp.sum(dv) + jnp.sum(lp) + jnp.sum(ent), (lp, ent, dv)

    (v0, a0), g0 = jax.value_and_grad(total, has_aux=True)(w, 0)
    (v3, a3), g3 = jax.value_and_grad(total, has_aux=True)(w, 3)
    for x, y in zip(a0, a3, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g0), np.asarray(g3), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Teacher context
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def proc():
    return QwenVLProcessor.default("qwen3_vl", min_pixels=64 * 64, max_pixels=64 * 64)


def _screen(seed):
    return np.random.default_rng(seed).integers(0, 255, (64, 64, 3), np.uint8)


def _episode(proc, seed, *, success, gens=("click A", "click B"), reason=None):
    """A two-turn episode recorded as the agent loop records it (`_Transcript`)."""
    tok = proc.tokenizer
    tr = _Transcript(proc, "Press Submit.", "You operate a computer.", max_history_images=2)
    turns = []
    for k, text in enumerate(gens):
        prompt = tr.prompt(
            "" if k == 0 else "Here is the screen after your action.", _screen(seed + k)
        )
        gen = tok.encode(text) + [tok.im_end_id]
        tr.reply(gen)
        turns.append(
            Turn(
                prompt.ids,
                gen,
                np.zeros(len(gen), np.float32),
                pixel_values=prompt.new_pixel_values,
                image_grid_thw=prompt.new_grid,
                extends_previous=prompt.extends,
            )
        )
    return Trajectory(
        "t", "g", turns, reward=float(success), success=success, failure_reason=reason
    )


def test_teacher_sequence_is_the_rendered_feedback_conversation(proc):
    chat, tok = proc.chat, proc.tokenizer
    failed = _episode(proc, 0, success=False, reason="max_turns")
    peer = _episode(proc, 10, success=True, gens=("click Submit",))
    group = [failed, peer]
    pairs = sdpo.teacher_samples([group], chat, text_position_fn(proc))
    assert len(pairs) == 1  # the failed episode's one sample; the success gets no teacher
    student, ts = pairs[0]

    # The same conversation rendered from messages, with the feedback as a second user turn.
    fb_screen = proc.preprocess_images([_screen(1)])  # the failed episode's last screen
    screens = [proc.preprocess_images([_screen(i)]) for i in (0, 1)]
    fb_text = (
        f"{sdpo.FEEDBACK_HEADER}\nThe task checker says: The episode ended: max_turns.\n"
        f"{sdpo.PEER_HEADER}\n1. click Submit\n{sdpo.SCREEN_HEADER}"
    )
    msgs = [
        {"role": "system", "content": "You operate a computer."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": fb_text},
                {"type": "image"},
                {"type": "text", "text": sdpo.FEEDBACK_FOOTER},
            ],
        },
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Press Submit."}]},
    ]
    grids = [fb_screen["image_grid_thw"], screens[0]["image_grid_thw"]]
    r = chat.render(msgs, np.concatenate(grids), add_generation_prompt=True)
    r = chat.append_generated(r, tok.encode("click A") + [tok.im_end_id])
    r = chat.extend(
        r,
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Here is the screen after your action."},
                    {"type": "image"},
                ],
            }
        ],
        screens[1]["image_grid_thw"],
        add_generation_prompt=True,
    )
    # The sample ends with the last turn's sampled ids (no template "\n" after them).
    last = tok.encode("click B") + [tok.im_end_id]
    np.testing.assert_array_equal(ts.sample.input_ids, np.r_[r.input_ids, last])
    # Images: the feedback screen, then the episode's, in the order of their placeholders.
    np.testing.assert_array_equal(
        ts.sample.image_grid_thw,
        np.concatenate([fb_screen["image_grid_thw"], *(s["image_grid_thw"] for s in screens)]),
    )
    np.testing.assert_array_equal(
        ts.sample.pixel_values,
        np.concatenate([fb_screen["pixel_values"], *(s["pixel_values"] for s in screens)]),
    )
    # The distilled tokens are exactly the student's generated ones, moved by the shift.
    np.testing.assert_array_equal(ts.sample.loss_mask, np.r_[r.loss_mask, np.ones(len(last), bool)])
    p = np.flatnonzero(student.loss_mask)
    np.testing.assert_array_equal(ts.sample.input_ids[p + ts.shift], student.input_ids[p])
    assert ts.start == sdpo.system_end(student.input_ids, chat) > 0


def text_position_fn(proc):
    del proc
    return lambda ids, grid: text_position_ids(ids, None)


def test_a_success_never_gets_a_teacher_from_itself(proc):
    decode = proc.tokenizer.decode
    win = _episode(proc, 0, success=True)
    lose = _episode(proc, 5, success=False)
    assert sdpo.episode_feedback(win, [win, lose], decode) is None
    assert sdpo.successful_peer(win, [win, lose]) is None
    assert sdpo.successful_peer(lose, [win, lose]) is win
    # Alone with its success, a success has no peer; a failure without any success in its
    # group gets only its own screen (and no peer actions).
    assert sdpo.successful_peer(win, [win]) is None
    fb = sdpo.episode_feedback(lose, [lose], decode, ("final_screenshot", "peer_success"))
    assert fb.peer_actions == [] and fb.screenshot is not None
    assert sdpo.episode_feedback(lose, [lose], decode, ("peer_success",)) is None


def test_locate_finds_samples_in_a_packed_batch():
    rng = np.random.default_rng(0)
    samples = []
    for i, n in enumerate([5, 9, 3, 9, 7, 4]):
        ids = rng.integers(10, 90, n).astype(np.int32)
        pv = grid = None
        if i in (1, 3):  # two samples with the same ids whose images differ
            ids = np.array([1, 2, 99, 99, 3, 4, 5, 6, 7], np.int32)  # 2 image pads (merge 1)
            pv = np.full((2, 3), float(i), np.float32)
            grid = np.array([[1, 1, 2]], np.int32)
        samples.append(
            Sample(
                ids,
                np.r_[False, np.ones(n - 1, bool)],
                np.zeros(n, np.float32),
                text_position_ids(ids),
                0.0,
                pixel_values=pv,
                image_grid_thw=grid,
            )
        )
    batch = packing.pack(samples, seq_len_buckets=(16,))
    where = sdpo.locate(batch, samples[1:], image_token_id=99, merge=1)
    patches = {}
    for s, (r, o) in zip(samples[1:], where, strict=True):
        np.testing.assert_array_equal(batch.input_ids[r, o : o + s.length], s.input_ids)
        patches[(r, o)] = s
    # Each of the twins sits where its own patches are.
    order = sorted((r, o) for (r, o), s in patches.items() if s.pixel_values is not None)
    firsts = [float(patches[k].pixel_values[0, 0]) for k in order]
    np.testing.assert_array_equal(batch.pixel_values[::2, 0], firsts)
    assert sdpo.locate(batch, [samples[0]], 99, 1)[0] is not None
    other = Sample(
        np.arange(4, dtype=np.int32),
        np.ones(4, bool),
        np.zeros(4, np.float32),
        text_position_ids(np.arange(4)),
        0.0,
    )
    assert sdpo.locate(batch, [other], 99, 1) == [None]


def test_feedback_is_the_final_screen_and_the_checker_report(proc):
    """With the screen after the last action kept (`Trajectory.final_screen`) the teacher sees
    it, not the last screen the policy saw; the checker's report comes before why it ended."""
    failed = _episode(proc, 0, success=False, reason="max_turns")
    final = proc.preprocess_images([_screen(7)])
    failed.final_screen = (final["pixel_values"], final["image_grid_thw"])
    failed.checker_message = 'Clicked "Cancel" at (120, 88); the target was "Submit" at (5, 9).'
    fb = sdpo.episode_feedback(failed, [failed], proc.tokenizer.decode)
    np.testing.assert_array_equal(fb.screenshot[0], final["pixel_values"])
    np.testing.assert_array_equal(fb.screenshot[1], final["image_grid_thw"])
    assert fb.checker_message == failed.checker_message + " The episode ended: max_turns."
    failed.final_screen = None  # not kept: the last screen the policy saw
    last = proc.preprocess_images([_screen(1)])
    fb = sdpo.episode_feedback(failed, [failed], proc.tokenizer.decode)
    np.testing.assert_array_equal(fb.screenshot[0], last["pixel_values"])


def test_checker_message_and_config_errors(proc):
    lose = _episode(proc, 0, success=False)
    lose.checker_message = "clicked 'Cancel' at (120, 88); the target was 'Submit'"
    fb = sdpo.episode_feedback(lose, [lose], proc.tokenizer.decode, ("checker_message",))
    assert fb.checker_message.startswith("clicked 'Cancel'")
    with pytest.raises(ValueError, match="sdpo_feedback="):
        sdpo.episode_feedback(lose, [lose], proc.tokenizer.decode, ("hint",))
    with pytest.raises(ValueError, match="teacher"):
        sdpo.SelfDistiller(proc.chat, teacher="frozen")
    with pytest.raises(ValueError, match="weight"):
        sdpo.SelfDistiller(proc.chat, weight=1.5)


# ---------------------------------------------------------------------------------------------
# The learner's SDPO step
# ---------------------------------------------------------------------------------------------


def _sdpo_learner(proc, seed=0, lr=1e-5, lora=None, buckets=(512,), num_substeps=1):
    import dataclasses

    from flax import nnx

    from cua_jax.models import qwen_vl
    from cua_jax.rl.learner import Learner, OptimizerConfig

    tok = proc.tokenizer
    tiny = qwen_vl.tiny("qwen3_vl", vocab_size=tok.vocab_size, **tok.vision_token_ids())
    cfg = tiny.replace(
        text=dataclasses.replace(tiny.text, num_hidden_layers=1),
        vision=dataclasses.replace(tiny.vision, depth=1, deepstack_visual_indexes=(0,)),
    )
    model = qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(seed))
    return Learner(
        model,
        optimizer=OptimizerConfig(learning_rate=lr, max_grad_norm=None),
        seq_len_buckets=buckets,
        logits_chunk=64,
        lora=lora,
        num_substeps=num_substeps,
    )


def _group(proc):
    return [
        _episode(proc, 0, success=False, reason="max_turns"),
        _episode(proc, 10, success=True, gens=("click Submit",)),
        _episode(proc, 20, success=False, gens=("click C",)),
    ]


def _forward_kl(learner, batch, targets):
    """Mean KL(teacher || student) over the distilled tokens, from the student's full
    distribution on the packed batch (an independent pass: `teacher_topk` with k = 0)."""
    _, s_logp = sdpo.teacher_topk(learner, learner._trainable, batch, 0)
    t = targets.logp.astype(np.float64)
    kl = np.sum(np.exp(t) * (t - s_logp), axis=-1)
    return float(kl[targets.mask].mean())


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sdpo_step_moves_the_student_toward_the_teacher(proc, lora):
    """Full fine-tuning and LoRA (the teacher is the base with the current adapters; the step
    trains the adapters only)."""
    from cua_jax.rl.learner import LoraConfig

    learner = _sdpo_learner(proc, lr=1e-3 if lora else 1e-5, lora=LoraConfig(4) if lora else None)
    base = [np.asarray(x) for x in jax.tree.leaves(learner._frozen)]
    assert bool(base) == lora  # LoRA freezes the base weights
    group = _group(proc)
    batch, _ = learner.prepare_batch([group])
    distiller = sdpo.SelfDistiller(proc.chat, weight=1.0, divergence="kl", topk=0)
    targets, info = distiller.targets(learner, batch, [group])
    assert info["sdpo/teacher_samples"] == 2  # the two failures; the success is no student
    n_gen = sum(t.generated_ids.size for g in (group[0], group[2]) for t in g.turns)
    assert targets.mask.sum() == n_gen
    # Where a token is distilled its teacher distribution is a full one over the vocabulary.
    np.testing.assert_allclose(np.exp(targets.logp[targets.mask]).sum(-1), 1.0, atol=1e-4)
    before = _forward_kl(learner, batch, targets)
    assert before > 0.0
    m = learner.train_step(batch, teacher=targets)
    # The step's SDPO loss (chunked, inside the step) is the same forward KL, token mean.
    assert m["sdpo_loss"] == pytest.approx(before, rel=1e-4)
    assert m["loss"] == pytest.approx(m["sdpo_loss"], rel=1e-6)  # λ = 1: no GRPO term
    after = _forward_kl(learner, batch, targets)
    assert after < before
    for x, y in zip(base, jax.tree.leaves(learner._frozen), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))  # (with LoRA: the frozen base)


def test_teacher_pass_over_micro_batches_is_the_one_pass_result(proc):
    """The teacher pass runs the decoder over the learner's micro-batches (rl.num_substeps), so
    its activations are one micro-batch's as in the step (the 2b preset's one-pass teacher
    needed 92 GiB of a v5p's 85.5). Its full distribution is the one-pass result, and at each
    next token it is the learner's own log-prob (`token_logprobs`, an independent program)."""
    one, two = _sdpo_learner(proc), _sdpo_learner(proc, num_substeps=2)  # same seed: same params
    pairs = sdpo.teacher_samples([_group(proc)], proc.chat, one.position_fn())
    batch = two.pack([t.sample for _, t in pairs] * 2, num_rows=2, mode="teacher")
    assert batch.shape[0] == 2 and (batch.arrays()["segment_ids"] > 0).any(-1).all()
    ids1, lp1 = sdpo.teacher_topk(one, one._trainable, batch, 0)
    ids2, lp2 = sdpo.teacher_topk(two, two._trainable, batch, 0)
    np.testing.assert_array_equal(ids1, ids2)
    np.testing.assert_allclose(lp2, lp1, atol=2e-5)
    tok = batch.arrays()["input_ids"]
    at_token = np.take_along_axis(lp2, tok[..., None], axis=-1)[..., 0]
    real = batch.arrays()["segment_ids"] > 0
    real[:, 0] = False  # entry 0 has no distribution
    np.testing.assert_allclose(at_token[real], one.token_logprobs(batch)[real], atol=2e-5)
    top_ids, top_lp = sdpo.teacher_topk(two, two._trainable, batch, 8)  # top-k of the same
    np.testing.assert_allclose(top_lp, -np.sort(-lp1, axis=-1)[..., :8], atol=2e-5)
    np.testing.assert_allclose(np.take_along_axis(lp1, top_ids, -1), top_lp, atol=2e-5)


def test_a_teacher_sequence_longer_than_every_row_is_counted_and_not_distilled(proc):
    """The learn preset's run stopped on a 1025-token teacher sequence (a three-turn episode
    with its feedback) in 1024-token rows. Such a sequence is now left out of the teacher pass
    and counted; its sample trains on the GRPO loss only."""
    learner = _sdpo_learner(proc, buckets=(128, 160))
    group = _group(proc)
    pairs = sdpo.teacher_samples([group], proc.chat, learner.position_fn())
    assert [t.sample.length > 160 for _, t in pairs] == [True, False]  # the two-turn failure
    batch, _ = learner.prepare_batch([group])
    targets, info = sdpo.SelfDistiller(proc.chat, weight=0.5, topk=8).targets(
        learner, batch, [group]
    )
    assert info["sdpo/teacher_too_long"] == 1 and info["sdpo/teacher_samples"] == 1
    assert targets.mask.sum() == sum(t.generated_ids.size for t in group[2].turns)
    assert np.isfinite(learner.train_step(batch, teacher=targets)["loss"])


def test_sdpo_weight_zero_is_the_grpo_step(proc):
    group = _group(proc)
    a, b = _sdpo_learner(proc), _sdpo_learner(proc)
    batch, _ = a.prepare_batch([group])
    targets, _ = sdpo.SelfDistiller(proc.chat, weight=0.0, divergence="js", topk=8).targets(
        b, batch, [group]
    )
    assert targets.ids.shape[-1] == 8 and targets.mask.any()
    ma = a.train_step(batch)
    mb = b.train_step(batch, teacher=targets)
    assert mb["loss"] == pytest.approx(ma["loss"], rel=1e-6)
    assert mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=1e-5)
    assert mb["sdpo_loss"] > 0.0  # computed and reported, with no weight in the loss
    for x, y in zip(jax.tree.leaves(a._trainable), jax.tree.leaves(b._trainable), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_ema_teacher_follows_the_policy(proc):
    learner = _sdpo_learner(proc)
    d = sdpo.SelfDistiller(proc.chat, teacher="ema", ema=0.25)
    p0 = [np.asarray(x) for x in jax.tree.leaves(d.teacher_params(learner))]
    # a stand-in step: the trainable params move by +1
    learner._trainable = jax.tree.map(lambda x: x + 1.0, learner._trainable)
    d.update_teacher(learner)
    for e, x in zip(jax.tree.leaves(d.teacher_params(learner)), p0, strict=True):
        np.testing.assert_allclose(np.asarray(e), x + 0.25, rtol=1e-6, atol=1e-6)


def test_sdpo_steps_compile_nothing_after_the_warm_up(proc):
    """#23 for SDPO: `SelfDistiller.warmup` compiles the SDPO step for the RL shapes and the
    teacher pass for the shapes teacher batches take (the shape set's teacher shapes; the SFT
    shape here holds one screen, which no teacher sample fits); SDPO steps on groups of
    different lengths and screenshot counts then compile neither (strict: a compile raises)."""
    from cua_jax.job import compile_stats
    from cua_jax.rl.shapes import Shape, ShapeSet

    learner = _sdpo_learner(proc)
    # 64x64 screens: 4x4 patches each; budgets of 16 screens per batch
    learner.shapes = ShapeSet(
        rl=(Shape(4, 512, 16 * 16),),
        sft=(Shape(1, 512, 16),),
        grid=(1, 4, 4),
        strict=True,
        teacher=(Shape(4, 512, 16 * 16),),
    )
    d = sdpo.SelfDistiller(proc.chat, weight=0.5, divergence="js", topk=8)
    stats = compile_stats.install()
    mark = stats.snapshot()
    times = d.warmup(learner)
    programs = (f"{d.step_mode}_step", sdpo.TEACHER_PROGRAM)
    assert sorted(times) == sorted(f"{p} 4x512 +256 patches" for p in programs)
    warm = stats.since(mark).per_program
    assert [warm.get(p, 0) for p in programs] == [1, 1]
    stats.expect_no_compiles(programs, strict=True)
    try:
        short = [
            _episode(proc, 30, success=False, gens=("click D",)),
            _episode(proc, 40, success=True, gens=("click Submit",)),
        ]
        for group in (_group(proc), short):
            batch, _ = learner.prepare_batch([group])
            m = d.train_step(learner, batch, [group])
            assert np.isfinite(m["loss"]) and m["sdpo/teacher_samples"] >= 1
            stats.check()  # raises on a compile of either program
        assert [stats.since(mark).per_program.get(p, 0) for p in programs] == [1, 1]
    finally:
        stats.reset_expectations()
