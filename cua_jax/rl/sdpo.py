"""SDPO for screens: the policy, shown feedback on a failed episode, is its own teacher.

Self-Distillation Policy Optimization (Hübotter et al. 2026, "Reinforcement Learning via
Self-Distillation", arXiv 2601.20802; reference code lasgroup/SDPO on verl). For each failed
episode of a GRPO group the current (or EMA) policy reads a *teacher context*: the episode's own
conversation with a feedback message inserted before the task. Its next-token distribution at
every token the student generated is distilled back into the student (stop-gradient on the
teacher), so one scalar reward becomes dense per-token credit:

    L_SDPO = Σ_t w_t D(π_θ(· | x, o_<t) , sg π_T(· | f, x, o_<t))     over the failed episodes'
                                                                        generated tokens t

On screens the feedback f is what the environment can show (`FEEDBACK_KINDS`):
  final_screenshot  the screen after the failed attempt's last action (`Trajectory.final_screen`;
                    the last screen its policy saw where that was not kept)
  checker_message   the task checker's report (`Trajectory.checker_message`: what the clicks
                    hit and where the targets were, in the policy's coordinates) and why the
                    episode ended (`failure_reason`)
  peer_success      the tool calls of a successful episode of the same group, as decoded text
A successful episode never gets a teacher (there is nothing to correct, and its own success
would be its feedback).

Teacher sequence. The student's sample is `[system] [user: screenshot, task] [assistant] ...`
(`rollout.render_transcript`). The teacher's is the same ids with one user message rendered by
the same `ChatRenderer` inserted right after the system message:

    [system] [user: feedback text, final screenshot] [user: screenshot, task] [assistant] ...

so every student token at position p >= s (s = end of the system message) sits at p + F in the
teacher sequence (F = the feedback message's length), and the teacher's images are the
feedback screenshot followed by the sample's own. M-RoPE positions are recomputed for it.

Divergences (per token, over the teacher's top-k ids plus one tail bucket holding the rest of
the probability, or over the whole vocabulary with ``topk=0``); p_S student, p_T teacher:
  "kl"   forward KL(p_T || p_S) = Σ_v p_T (log p_T - log p_S)
  "rkl"  reverse KL(p_S || p_T)
  "js"   generalised Jensen-Shannon with β: M = (1 - β) p_S + β p_T,
         JS_β = (1 - β) KL(p_S || M) + β KL(p_T || M)   (β = 0.5: the usual JS)
as `compute_self_distillation_loss` in lasgroup/SDPO (its alpha is our β; alpha = 0 / 1 are
the forward / reverse KL).

Pipeline (one train step, `SelfDistiller.train_step`): the GRPO batch is packed as usual
(`Learner.prepare_batch`); the failed episodes' samples are found in it (`locate`), their
teacher sequences are packed with the learner's packing and run through the teacher params
without gradient (`teacher_topk`: chunked logits, top-k only, never f32[rows, L, V] at once),
and the teacher's top-k ids and log-probs are scattered onto the student's packed positions
(`TeacherTargets`). The learner's step then adds λ · L_SDPO to (1 - λ) · L_GRPO.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cua_jax import multihost
from cua_jax import sharding as shd
from cua_jax.config.checks import FEEDBACK_KINDS, feedback_kinds
from cua_jax.data.chat import RenderedChat
from cua_jax.rl import step
from cua_jax.rl.distill import (  # noqa: F401  (the loss's names, re-exported)
    DIVERGENCES,
    TARGET_KEYS,
    TOPK_KEYS,
    Divergence,
    LossVariant,
    add_tail,
    chunked_stats_and_divergence,
    distill_loss,
    distill_weights,
    micro_loss,
    parse_mode,
    step_mode,
    student_support_logp,
    token_divergence,
    topk_width,
)
from cua_jax.rl.image_groups import ImageGroups
from cua_jax.rl.micro import compile_each, split_micro, split_micro_inputs, unsplit_micro
from cua_jax.rl.trajectory import PositionFn, Sample, Trajectory, trajectory_to_samples

TEACHERS = ("current", "ema")

FEEDBACK_HEADER = "Feedback on an earlier attempt at the task below: it failed."
PEER_HEADER = "A successful attempt at the same task made these tool calls, in order:"
SCREEN_HEADER = "The screen at the end of the failed attempt:"
FEEDBACK_FOOTER = "Now solve the task below correctly."


# ---------------------------------------------------------------------------------------------
# Teacher context (host numpy)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Feedback:
    """What a failed episode's teacher is shown (each part optional)."""

    screenshot: tuple[np.ndarray, np.ndarray] | None = None  # (pixel_values, grid i32[1, 3])
    checker_message: str = ""
    peer_actions: list[str] = dataclasses.field(default_factory=list)

    def empty(self) -> bool:
        return self.screenshot is None and not self.checker_message and not self.peer_actions


def last_screenshot(traj: Trajectory) -> tuple[np.ndarray, np.ndarray] | None:
    """(pixel_values, grid i32[1, 3]) of the episode's final screen: the screen after its last
    action (`Trajectory.final_screen`, kept when `RolloutSettings.keep_final_screen`), else the
    last screen its policy saw (the last image of the last turn that added images)."""
    if traj.final_screen is not None:
        pv, grid = traj.final_screen
        return np.asarray(pv), np.asarray(grid, np.int32).reshape(-1, 3)[-1:]
    for turn in reversed(traj.turns):
        if turn.image_grid_thw is None or not len(turn.image_grid_thw):
            continue
        grid = np.asarray(turn.image_grid_thw, np.int32)
        rows = int(np.prod(grid[-1]))
        return np.asarray(turn.pixel_values)[-rows:], grid[-1:]
    return None


def successful_peer(traj: Trajectory, group: Sequence[Trajectory]) -> Trajectory | None:
    """The group's successful episode (not `traj` itself, not an infrastructure fault) with the
    fewest turns; the first of those on a tie."""
    peers = [t for t in group if t is not traj and t.success and not t.infra_fault and t.turns]
    return min(peers, key=lambda t: len(t.turns)) if peers else None


def episode_feedback(
    traj: Trajectory,
    group: Sequence[Trajectory],
    decode: Callable[[Sequence[int]], str],
    kinds: Sequence[str] = FEEDBACK_KINDS,
) -> Feedback | None:
    """The feedback a failed episode's teacher reads; None for a success, an infrastructure
    fault, or when none of `kinds` has anything to say."""
    kinds = feedback_kinds(kinds)
    if traj.success or traj.infra_fault or not traj.turns:
        return None
    fb = Feedback()
    if "final_screenshot" in kinds:
        fb.screenshot = last_screenshot(traj)
    if "checker_message" in kinds:
        parts = [traj.checker_message] if traj.checker_message else []
        if traj.failure_reason:
            parts.append(f"The episode ended: {traj.failure_reason}.")
        fb.checker_message = " ".join(parts)
    if "peer_success" in kinds:
        peer = successful_peer(traj, group)
        if peer is not None:
            fb.peer_actions = [decode(t.generated_ids) for t in peer.turns if t.generated_ids.size]
    return None if fb.empty() else fb


def feedback_message(fb: Feedback) -> tuple[dict[str, Any], np.ndarray]:
    """(the user message of the feedback, its image grids i32[I, 3])."""
    lines = [FEEDBACK_HEADER]
    if fb.checker_message:
        lines.append(f"The task checker says: {fb.checker_message}")
    if fb.peer_actions:
        lines.append(PEER_HEADER)
        lines += [f"{i + 1}. {a.strip()}" for i, a in enumerate(fb.peer_actions)]
    content: list[dict[str, Any]] = []
    grid = np.zeros((0, 3), np.int32)
    if fb.screenshot is not None:
        lines.append(SCREEN_HEADER)
        content.append({"type": "text", "text": "\n".join(lines)})
        content.append({"type": "image"})
        content.append({"type": "text", "text": FEEDBACK_FOOTER})
        grid = np.asarray(fb.screenshot[1], np.int32).reshape(-1, 3)
    else:
        lines.append(FEEDBACK_FOOTER)
        content.append({"type": "text", "text": "\n".join(lines)})
    return {"role": "user", "content": content}, grid


def system_end(ids: np.ndarray, chat: Any) -> int:
    """The position right after the leading system message (its <|im_end|> and "\\n"), 0 when
    the sequence does not start with one."""
    tok = chat.tokenizer
    ids = np.asarray(ids)
    header = [tok.im_start_id, *tok.encode("system")]
    if ids.size < len(header) or list(ids[: len(header)]) != header:
        return 0
    ends = np.flatnonzero(ids == tok.im_end_id)
    if not ends.size:
        raise ValueError("the sample's system message has no <|im_end|>")
    newline = tok.encode("\n")
    e = int(ends[0]) + 1
    if list(ids[e : e + len(newline)]) != newline:
        raise ValueError("the sample's system message is not followed by a newline")
    return e + len(newline)


@dataclasses.dataclass
class TeacherSample:
    """A teacher sequence (a `Sample` whose loss mask marks the tokens to distill) and where the
    student's tokens are in it: student position p >= `start` is teacher position p + `shift`;
    `feedback` is what the sequence shows the teacher."""

    sample: Sample
    start: int
    shift: int
    feedback: Feedback | None = None


def teacher_sample(
    sample: Sample, fb: Feedback, chat: Any, position_fn: PositionFn
) -> TeacherSample:
    """The teacher sequence of one student sample: the feedback message (rendered by `chat`, the
    rollouts' renderer) inserted after the system message; images: the feedback's, then the
    sample's; the loss mask is the student's, moved with its tokens."""
    ids = np.asarray(sample.input_ids, np.int32)
    s = system_end(ids, chat)
    if np.any(ids[:s] == chat.tokenizer.vision_start_id):
        raise ValueError("the sample has an image in its system message; SDPO cannot place one")
    msg, grid = feedback_message(fb)
    prefix = RenderedChat(
        input_ids=ids[:s],
        loss_mask=np.zeros(s, bool),
        image_grid_thw=np.zeros((0, 3), np.int32),
        text="",
        open_assistant=False,
    )
    fb_ids = chat.extend(prefix, [msg], grid, add_generation_prompt=False).input_ids[s:]
    f = int(fb_ids.size)
    t_ids = np.concatenate([ids[:s], fb_ids, ids[s:]]).astype(np.int32)
    mask = np.concatenate([np.zeros(s + f, bool), np.asarray(sample.loss_mask[s:], bool)])
    pvs = [fb.screenshot[0]] if fb.screenshot is not None else []
    grids = [grid] if len(grid) else []
    if sample.pixel_values is not None:
        pvs.append(np.asarray(sample.pixel_values))
        grids.append(np.asarray(sample.image_grid_thw, np.int32))
    pv = np.concatenate(pvs) if pvs else None  # the screens' own form (bytes or floats)
    g = np.concatenate(grids).astype(np.int32) if grids else None
    if mask[:s].any():
        raise ValueError("a student sample has generated tokens inside its system message")
    teacher = Sample(
        input_ids=t_ids,
        loss_mask=mask,
        behaviour_logprobs=np.zeros(t_ids.size, np.float32),
        position_ids=np.asarray(position_fn(t_ids, g), np.int32),
        advantage=0.0,
        pixel_values=pv,
        image_grid_thw=g,
        policy_version=sample.policy_version,
        task_id=sample.task_id,
    )
    return TeacherSample(teacher, s, f, fb)


def action_decoder(chat: Any) -> Callable[[Sequence[int]], str]:
    """How a peer's generated ids become the tool-call text of `peer_success` feedback (without
    <|im_end|>)."""
    return lambda ids: chat.tokenizer.decode(ids, skip_special_tokens=True)


def _teacher_info(pairs: Sequence[tuple[Sample, TeacherSample]], too_long: int) -> dict:
    """The step's `sdpo/*` counts of its distilled samples and what their teachers were shown
    (a sample can count in several)."""
    return {
        "sdpo/teacher_samples": float(len(pairs)),
        "sdpo/teacher_rows": 0.0,
        "sdpo/teacher_too_long": float(too_long),
        "sdpo/feedback_screens": float(sum(t.feedback.screenshot is not None for _, t in pairs)),
        "sdpo/feedback_messages": float(sum(bool(t.feedback.checker_message) for _, t in pairs)),
        "sdpo/feedback_peers": float(sum(bool(t.feedback.peer_actions) for _, t in pairs)),
    }


def teacher_samples(
    groups: Sequence[Sequence[Trajectory]],
    chat: Any,
    position_fn: PositionFn,
    kinds: Sequence[str] = FEEDBACK_KINDS,
) -> list[tuple[Sample, TeacherSample]]:
    """(student sample, its teacher) for every sample of every failed episode with feedback;
    the student samples are `trajectory_to_samples`' (the same ids the learner packs)."""

    decode = action_decoder(chat)
    out = []
    for group in groups:
        for traj in group:
            fb = episode_feedback(traj, group, decode, kinds)
            if fb is None:
                continue
            for s in trajectory_to_samples(traj, 0.0, position_fn):
                out.append((s, teacher_sample(s, fb, chat, position_fn)))
    return out


# ---------------------------------------------------------------------------------------------
# Samples in a packed batch
# ---------------------------------------------------------------------------------------------


def _digest(a: np.ndarray | None) -> bytes:
    if a is None:
        return b""
    return hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=16).digest()


def locate(
    batch: Any, samples: Sequence[Sample], image_token_id: int, merge: int
) -> list[tuple[int, int] | None]:
    """(row, first position) of each sample in a packed batch, None for one not in it.

    `packing.pack` places samples by length; this finds them by content: ids, then images (a
    segment with n image-pad tokens takes n x merge² patches of the batch, in row-major segment
    order). Samples with equal ids and images are interchangeable, so which of them takes which
    slot does not matter."""
    by_ids: dict[bytes, list[int]] = {}
    for i, s in enumerate(samples):
        by_ids.setdefault(_digest(np.asarray(s.input_ids, np.int32)), []).append(i)
    out: list[tuple[int, int] | None] = [None] * len(samples)
    seg = np.asarray(batch.segment_ids)
    ids = np.asarray(batch.input_ids)
    pv = batch.pixel_values
    # offset of the current segment's first patch in the batch's patches (multi-host: the
    # patches of every process, this one's rows' from `patch_offset` on)
    patch = int(getattr(batch, "patch_offset", 0))
    for r in range(seg.shape[0]):
        row = seg[r]
        starts = np.flatnonzero((row != 0) & np.r_[True, row[1:] != row[:-1]])
        for st in starts:
            end = st + int(np.sum(row == row[st]))
            seg_ids = ids[r, st:end]
            n_patch = int(np.sum(seg_ids == image_token_id)) * merge * merge
            for i in by_ids.get(_digest(seg_ids), []):
                spv = samples[i].pixel_values
                if out[i] is None and (
                    spv is None or np.array_equal(np.asarray(pv[patch : patch + n_patch]), spv)
                ):
                    out[i] = (r, int(st))
                    break
            patch += n_patch
    return out


# ---------------------------------------------------------------------------------------------
# The teacher pass and its targets on the student's packed positions
# ---------------------------------------------------------------------------------------------


TEACHER_PROGRAM = "sdpo_teacher"  # the teacher pass's jitted function (compile_stats names)


@dataclasses.dataclass
class TeacherTargets:
    """The teacher's distribution at each distilled token of a packed student batch; entry
    [r, t] is about token t of row r (the learner's targets are input_ids[:, 1:])."""

    ids: np.ndarray  # i32[R, L, K] the teacher's top-k ids (the vocabulary when K = V)
    logp: np.ndarray  # f32[R, L, K] their teacher log-probs (normalised over the vocabulary)
    mask: np.ndarray  # bool[R, L] the token is distilled
    weights: np.ndarray  # f32[R, L] `distill_weights(mask)`
    divergence: Divergence = "js"
    js_beta: float = 0.5
    weight: float = 1.0  # λ: the step minimises (1 - λ) L_GRPO + λ L_SDPO

    def arrays(self) -> dict[str, np.ndarray]:
        return dict(zip(TARGET_KEYS, (self.ids, self.logp, self.mask, self.weights), strict=True))

    @property
    def mode(self) -> str:
        """The learner's jit key: one compiled step per loss variant."""
        return step_mode(self.divergence, self.js_beta, self.weight)


def teacher_topk(
    learner: Any, params: Any, batch: Any, k: int, cache: dict | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The policy `params`' top-k next-token (ids i32[R, L, K], log-probs f32[R, L, K]) on a
    packed batch, at the learner's temperature with its banned ids masked; entry [r, q] is the
    distribution of token q given tokens < q (q = 0: zeros). ``k <= 0`` or ``k >= V``: the
    whole vocabulary in id order. The decoder runs over the learner's micro-batches
    (`num_substeps`, as the step does) and makes logits `learner.logits_chunk` positions at a
    time; no gradient. One compile per batch shape (kept in `cache`)."""
    fn = _teacher_jit(learner, k, cache)
    ids_parts, logp_parts = [], []
    for part, _ in learner.chunks(batch):  # a token-budget batch: one call a chunk
        xs, images = learner.layout.device_batch(part, substeps=learner.num_substeps)
        ids, logp = fn(params, learner.frozen, learner.rest, xs, images)
        ids_parts.append(multihost.local_rows(ids))  # multi-host: this one's rows
        logp_parts.append(multihost.local_rows(logp))
    return np.concatenate(ids_parts), np.concatenate(logp_parts)


def _teacher_jit(learner: Any, k: int, cache: dict | None) -> Any:
    """The jitted teacher pass for top-`k`, kept in `cache` (one per learner)."""
    cache = {} if cache is None else cache
    fn = cache.get(k)
    if fn is None:

        def teacher(*a):  # laid out as the learner's own programs (`shd.training_layout`)
            with shd.training_layout(learner.mesh, learner.rules):
                return _teacher_topk_fn(learner, k, *a)

        teacher.__name__ = TEACHER_PROGRAM  # the program's name in compile_stats' counts
        rows = learner.layout.rows_sharding(3)  # each process reads back its own rows
        fn = cache[k] = jax.jit(teacher, out_shardings=(rows, rows))
    return fn


def _teacher_topk_fn(learner, k, params, frozen, rest, xs, images):
    """The teacher pass, over `learner.num_substeps` micro-batches in turn as the step goes,
    so its activations (attention scores included) are one micro-batch's: the decoder and the
    top-k of each; the vision tower and embeddings per micro-batch too with grouped screens
    (`image_groups`), else once over the whole batch before (the flat layout)."""
    spec = learner.spec
    params = jax.lax.stop_gradient(params)
    grouped = isinstance(images, ImageGroups)  # then each micro-batch embeds its own screens
    if not grouped:
        (emb, ds), vmask = step.embed(spec, params, frozen, rest, xs["input_ids"], images)
    model = step.merge(spec, params, frozen, rest)
    banned = jnp.asarray(spec.banned, jnp.int32) if spec.banned else None
    temperature = spec.loss.temperature

    def top(h):
        # the rows' own logits, whole over the vocabulary: the top-k needs every entry of a row
        logits = model.logits(h, vocab_parallel=False).astype(jnp.float32)
        if banned is not None:
            logits = logits.at[..., banned].set(-1e30)
        logp = jax.nn.log_softmax(logits / temperature, axis=-1)
        v = logp.shape[-1]
        if k <= 0 or k >= v:
            return jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), logp.shape), logp
        vals, idx = jax.lax.top_k(logp, k)
        return idx.astype(jnp.int32), vals

    def micro(x):  # one micro-batch: decoder, then the top-k `logits_chunk` positions at a time
        mb = x["mb"]
        if grouped:
            imgs = ImageGroups(x["pv"], images.meta)
            (emb_mb, ds_mb), vmask_mb = step.embed(
                spec, params, frozen, rest, mb["input_ids"], imgs
            )
        else:
            emb_mb, ds_mb, vmask_mb = x["emb"], x["ds"], x["vmask"]
        attn = model.attn_fn(None, mb["segment_ids"])
        hidden_BTD = model.decode(emb_mb, mb["position_ids"], attn, vmask_mb, ds_mb)
        hidden_BTD = hidden_BTD[:, :-1]
        b, t = hidden_BTD.shape[:2]
        chunk = spec.logits_chunk
        if chunk <= 0 or chunk >= t:
            return top(hidden_BTD)
        n = -(-t // chunk)
        h = jnp.pad(hidden_BTD, ((0, 0), (0, n * chunk - t), (0, 0)))
        h = h.reshape(b, n, chunk, h.shape[-1]).swapaxes(0, 1)
        ids, logp = jax.lax.map(top, h)
        ids = ids.swapaxes(0, 1).reshape(b, n * chunk, -1)[:, :t]
        logp = logp.swapaxes(0, 1).reshape(b, n * chunk, -1)[:, :t]
        return ids, logp

    s = spec.num_substeps  # as the step, a loop over the micro-batches even when s = 1
    split = {"mb": split_micro_inputs(xs, s)}
    if grouped:
        split["pv"] = images.pixel_values
    else:
        split.update(emb=split_micro(emb, s), ds=split_micro(ds, s), vmask=split_micro(vmask, s))
    ids, logp = unsplit_micro(jax.lax.map(micro, split))
    pad = ((0, 0), (1, 0), (0, 0))  # entry q is about token q: q = 0 has no distribution
    return jnp.pad(ids, pad), jnp.pad(logp, pad)


def _longest_teacher_row(learner: Any) -> int:
    """The longest row a teacher batch can take: the shape set's teacher (or SFT) shapes, else
    the learner's length buckets."""
    if learner.shapes is not None:
        return max(sh.length for sh in learner.shapes.of("teacher"))
    return max(learner.seq_len_buckets)


def scatter_targets(
    student_batch: Any,
    pairs: Sequence[tuple[Sample, TeacherSample]],
    student_at: Sequence[tuple[int, int] | None],
    teacher_at: Sequence[tuple[int, int] | None],
    teacher_ids: np.ndarray,
    teacher_logp: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, logp, mask) on the student's packed positions from the teacher batch's: student
    token p of a sample is teacher token p + shift of its teacher sequence."""
    r_, l_ = student_batch.shape
    k = teacher_ids.shape[-1]
    ids = np.zeros((r_, l_, k), np.int32)
    logp = np.zeros((r_, l_, k), np.float32)
    mask = np.zeros((r_, l_), bool)
    for (s, ts), sa, ta in zip(pairs, student_at, teacher_at, strict=True):
        if sa is None or ta is None:
            continue
        p = np.flatnonzero(np.asarray(s.loss_mask, bool))
        p = p[p >= ts.start]
        (rs, os_), (rt, ot) = sa, ta
        ids[rs, os_ + p] = teacher_ids[rt, ot + p + ts.shift]
        logp[rs, os_ + p] = teacher_logp[rt, ot + p + ts.shift]
        mask[rs, os_ + p] = True
    return ids, logp, mask


class SelfDistiller:
    """SDPO's teacher side for a learner: builds each step's `TeacherTargets` from the step's
    groups and keeps the EMA teacher.

        distiller = SelfDistiller(processor.chat, weight=1.0, divergence="js", topk=64)
        metrics = distiller.train_step(learner, batch, groups)   # instead of learner.train_step

    teacher: "current" runs the learner's parameters at the start of the step; "ema" an
    exponential moving average of them, θ_T <- (1 - ema) θ_T + ema θ after every step (started
    from the parameters of the first step it sees, or of a new learner: after the SFT warm-up).
    """

    def __init__(
        self,
        chat: Any,
        *,
        weight: float = 1.0,
        divergence: Divergence = "js",
        js_beta: float = 0.5,
        topk: int = 64,
        teacher: str = "current",
        ema: float = 0.05,
        feedback: Sequence[str] = FEEDBACK_KINDS,
    ):
        if divergence not in DIVERGENCES:
            raise ValueError(f"sdpo divergence={divergence!r}; use one of {DIVERGENCES}")
        if teacher not in TEACHERS:
            raise ValueError(f"sdpo teacher={teacher!r}; use one of {TEACHERS}")
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"sdpo weight={weight} must be in [0, 1]")
        if teacher == "ema" and not 0.0 < ema <= 1.0:
            raise ValueError(f"sdpo ema={ema} must be in (0, 1]")
        if divergence == "js" and not 0.0 < js_beta < 1.0:
            raise ValueError(f"sdpo js_beta={js_beta} must be in (0, 1)")
        feedback = feedback_kinds(feedback)
        self.chat = chat
        self.weight = float(weight)
        self.divergence = divergence
        self.js_beta = float(js_beta)
        self.topk = int(topk)
        self.teacher = teacher
        self.ema = float(ema)
        self.feedback = tuple(feedback)
        self._ema_params = None
        self._ema_owner = None
        self._jit: dict = {}
        self._jit_owner = None

    def teacher_params(self, learner: Any) -> Any:
        if self.teacher == "current":
            return learner.trainable
        if self._ema_owner is not learner:
            self._ema_params = jax.tree.map(jnp.copy, learner.trainable)
            self._ema_owner = learner
        return self._ema_params

    def update_teacher(self, learner: Any) -> None:
        """The EMA step after a train step (nothing for the current-policy teacher)."""
        if self.teacher == "ema" and self._ema_owner is learner:
            r = self.ema
            self._ema_params = jax.tree.map(
                lambda e, p: e + r * (p - e), self._ema_params, learner.trainable
            )

    @property
    def step_mode(self) -> str:
        """The learner step mode (and jit key) every SDPO update runs (`TeacherTargets.mode`)."""
        return step_mode(self.divergence, self.js_beta, self.weight)

    def warmup(self, learner: Any, stop: threading.Event | None = None) -> dict[str, float]:
        """Compiles ahead what an SDPO step runs, for the learner's shape set: the
        learner's SDPO step for every RL shape (with all-zero teacher targets of the step's
        top-k width) and the teacher pass for every shape a teacher batch takes (the shape
        set's teacher shapes: the RL rows, a screen more per sample). Returns {program and
        shape: seconds}. A set `stop` ends it before the next program."""

        if learner.shapes is None:
            raise ValueError("warmup needs a shape set: learner.shapes = ShapeSet.build(...)")
        if self._jit_owner is not learner:
            self._jit, self._jit_owner = {}, learner
        vocab = learner.config.text.vocab_size
        k = topk_width(self.topk, vocab)

        def zeros(r: int, length: int) -> TeacherTargets:
            return TeacherTargets(
                np.zeros((r, length, k), np.int32),
                np.zeros((r, length, k), np.float32),
                np.zeros((r, length), bool),
                np.zeros((r, length), np.float32),
                self.divergence,
                self.js_beta,
                self.weight,
            )

        def lower_step(shape: Any) -> Any:
            batch = learner.blank_batch(shape)
            t = zeros(*batch.shape)
            return learner.lower_step(batch, t.mode, t.arrays())

        fn = _teacher_jit(learner, self.topk, self._jit)
        params = self.teacher_params(learner)

        def lower_teacher(shape: Any) -> Any:
            blank = learner.blank_batch(shape)
            xs, images = learner.layout.device_batch(blank, learner.num_substeps)
            return fn.lower(params, learner.frozen, learner.rest, xs, images)

        mode = zeros(1, 1).mode
        step_name = learner.program_names(mode)[0]
        out = {
            **compile_each(learner.shapes.of("rl"), step_name, lower_step, stop),
            **compile_each(learner.shapes.of("teacher"), TEACHER_PROGRAM, lower_teacher, stop),
        }
        if learner.shapes.budgeted and not (stop is not None and stop.is_set()):
            out.update(learner.warmup_apply())
        return out

    def targets(
        self, learner: Any, batch: Any, groups: Sequence[Sequence[Trajectory]]
    ) -> tuple[TeacherTargets, dict[str, float]]:
        """The step's teacher targets on `batch` (packed from `groups` by
        `learner.prepare_batch`) and info; all-zero targets when no failed episode of the
        batch has feedback."""
        if self._jit_owner is not learner:
            self._jit, self._jit_owner = {}, learner
        cfg = learner.config
        pairs = teacher_samples(groups, self.chat, learner.position_fn(), self.feedback)
        merge = cfg.vision.spatial_merge_size
        student_at = locate(batch, [s for s, _ in pairs], cfg.image_token_id, merge)
        # a teacher sequence longer than every teacher row (a long episode with a long
        # feedback message) is not distilled: its sample still trains on GRPO's loss
        longest = _longest_teacher_row(learner)
        found = [a is not None for a in student_at]
        fits = [f and t.sample.length <= longest for (_, t), f in zip(pairs, found, strict=True)]
        too_long = sum(found) - sum(fits)
        if too_long:
            logging.warning(
                "SDPO: %d teacher sequences are longer than the longest teacher row %d; their "
                "samples train on the GRPO loss only (raise rl.row_lengths)",
                too_long,
                longest,
            )
        pairs = [p for p, f in zip(pairs, fits, strict=True) if f]
        student_at = [a for a, f in zip(student_at, fits, strict=True) if f]
        vocab = cfg.text.vocab_size
        k = topk_width(self.topk, vocab)
        info = _teacher_info(pairs, too_long)
        # multi-host: every process packs its share of the teacher batch and runs the pass
        # together, when any of them has a failure to distill
        if multihost.allgather_ints([len(pairs)]).sum() > 0:
            tbatch = learner.pack([t.sample for _, t in pairs], mode="teacher")
            teacher_at = locate(tbatch, [t.sample for _, t in pairs], cfg.image_token_id, merge)
            t_ids, t_logp = teacher_topk(
                learner, self.teacher_params(learner), tbatch, self.topk, self._jit
            )
            ids, logp, mask = scatter_targets(batch, pairs, student_at, teacher_at, t_ids, t_logp)
            info["sdpo/teacher_rows"] = float(tbatch.shape[0])
            info["sdpo/teacher_row_len"] = float(tbatch.shape[1])
        else:
            r_, l_ = batch.shape
            ids = np.zeros((r_, l_, k), np.int32)
            logp = np.zeros((r_, l_, k), np.float32)
            mask = np.zeros((r_, l_), bool)
        info["sdpo/distilled_tokens"] = float(mask.sum())
        # the token mean is over the global batch: every process's distilled tokens
        total = int(multihost.allgather_ints([int(mask.sum())]).sum())
        weights = distill_weights(mask) * np.float32(mask.sum() / max(total, 1))
        targets = TeacherTargets(
            ids, logp, mask, weights, self.divergence, self.js_beta, self.weight
        )
        return targets, info

    def train_step(
        self, learner: Any, batch: Any, groups: Sequence[Sequence[Trajectory]]
    ) -> dict[str, float]:
        """The teacher pass, then one learner step on (1 - λ) GRPO + λ SDPO, then the EMA."""
        t0 = time.perf_counter()
        targets, info = self.targets(learner, batch, groups)
        t_teacher = time.perf_counter() - t0
        metrics = learner.train_step(batch, teacher=targets)
        self.update_teacher(learner)
        div_sum, n = metrics.pop("sdpo_div_sum", 0.0), metrics.get("sdpo_tokens", 0.0)
        metrics["sdpo_divergence"] = div_sum / max(n, 1.0)
        return {**metrics, **info, "sdpo/teacher_s": t_teacher}
