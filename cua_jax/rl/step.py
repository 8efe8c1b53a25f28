"""The learner's programs as plain functions: the losses, the gradients and the guarded update.

Each function takes a `StepSpec` first (what a learner fixes for its life: the model's graph,
the mesh, the loss and the optimizer) and arrays after it; `cua_jax.rl.learner.Learner` jits
them with its shardings and donations, and so may SDPO's teacher pass, Entropulse's entropy
probe or `cua_jax.plan` (which lowers them over abstract arrays). Nothing here holds state.

    spec = learner.spec
    lp = step.token_logprobs(spec, learner.trainable, learner.frozen, learner.rest, xs, images)

The arguments are the learner's parameter trees (`trainable`, `frozen`, `rest`; `ref`: the KL
reference's trainable params or None), a laid-out batch (`xs`, `images`:
`cua_jax.rl.layout.BatchLayout.device_batch`) and a step mode: "rl", "sft", or an SDPO mode
(`distill.step_mode`) whose target arrays ride in `xs`.

Gradient accumulation: the rows are split into ``num_substeps`` micro-batches scanned with
`jax.lax.scan`; the loss weights are normalised over the whole batch on the host, so the summed
micro-batch gradients are the full-batch gradient. With grouped screens
(`cua_jax.rl.image_groups.ImageGroups`) each micro-batch embeds its own rows inside the scan's
gradient; otherwise the embedding stage runs once for the batch through `jax.vjp` and the
scan's embedding cotangents are pulled back through the vision tower once at the end.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from cua_jax import sharding as shd
from cua_jax.models.qwen_vl.moe import load_balancing_loss
from cua_jax.rl import distill, image_groups, losses
from cua_jax.rl.image_groups import ImageGroups
from cua_jax.rl.micro import combine_micro_metrics, split_micro, split_micro_inputs, unsplit_micro
from cua_jax.rl.settings import LossConfig


@dataclasses.dataclass(frozen=True, eq=False)
class StepSpec:
    """What a learner's programs close over, fixed when the learner is built.

    graphdef: the model's graph (`nnx.split`), merged with the parameter trees in each call.
    banned: token ids whose logits are masked in every log-prob and entropy (the sampler's
      `banned_token_ids`), so the learner scores the sampler's policy.
    logits_chunk: positions per logits chunk (0: all at once; `losses.chunked_token_stats`).
    moe: the model routes tokens to experts (the batch carries ``routes``).
    """

    graphdef: Any
    mesh: Mesh
    rules: shd.Rules
    loss: LossConfig
    tx: optax.GradientTransformation
    max_update_ratio: float
    num_substeps: int
    banned: tuple[int, ...] = ()
    logits_chunk: int = 0
    moe: bool = False


def merge(spec: StepSpec, trainable, frozen, rest) -> nnx.Module:
    """The model of these parameter trees."""
    return nnx.merge(spec.graphdef, trainable, frozen, rest)


def embed(spec: StepSpec, trainable, frozen, rest, ids_RL, images):
    """((token + screen embeddings, deepstack features), visual mask) of a batch's rows."""
    model = merge(spec, trainable, frozen, rest)
    if isinstance(images, ImageGroups):
        return image_groups.embed_groups(model, ids_RL, images)
    if images is None:
        emb, vmask, ds = model.embed(ids_RL)
    else:
        pv, meta = images
        emb, vmask, ds = model.embed(ids_RL, pv, vision_meta=meta)
    return (emb, ds), vmask


def token_stats(
    spec: StepSpec, trainable, frozen, rest, emb, ds, vmask, mb, temperature, entropy, variant=None
):
    """(log π(next token), entropy or None, MoE RoutingInfo or None), f32[mb, L-1], at
    `temperature`, with the banned ids masked; the logits are made `logits_chunk` positions
    at a time. MoE: the decoder replays `mb["routes"]` with `routing_replay`. With SDPO's
    loss `variant` (`distill.LossVariant`): ((log π, entropy, divergence from the teacher),
    RoutingInfo)."""
    model = merge(spec, trainable, frozen, rest)
    attn = model.attn_fn(None, mb["segment_ids"])
    info = None
    if spec.moe:
        replay = None
        if spec.loss.routing_replay:  # [B, T, L, K] -> [L, B, T, K]
            replay = jnp.transpose(mb["routes"], (2, 0, 1, 3))
        hidden, info = model.decode(
            emb, mb["position_ids"], attn, vmask, ds, routes=replay, return_routing=True
        )
    else:
        hidden = model.decode(emb, mb["position_ids"], attn, vmask, ds)
    hidden = hidden[:, :-1]
    banned = jnp.asarray(spec.banned, jnp.int32) if spec.banned else None

    def logits_fn(h):
        logits = model.logits(h)  # f32[mb, c, V]
        if banned is not None:  # finite, so 0-weight positions never make 0 * inf = NaN
            logits = logits.at[..., banned].set(-1e30)
        return logits if temperature == 1.0 else logits / temperature

    if variant is not None:  # SDPO: + the divergence from the teacher, from the same chunks
        return distill.chunked_stats_and_divergence(
            logits_fn,
            hidden,
            mb["input_ids"][:, 1:],
            mb["sdpo_ids"][:, 1:],
            mb["sdpo_logp"][:, 1:],
            chunk=spec.logits_chunk,
            entropy=entropy,
            divergence=variant.divergence,
            js_beta=variant.js_beta,
        ), info
    lp, ent = losses.chunked_token_stats(
        logits_fn, hidden, mb["input_ids"][:, 1:], chunk=spec.logits_chunk, entropy=entropy
    )
    return lp, ent, info


def token_logprobs(spec: StepSpec, trainable, frozen, rest, xs, images):
    """log π(token t | tokens < t) f32[R, L] (0 at t = 0) at the loss's temperature, traced in
    the training layout as the step is."""
    with shd.training_layout(spec.mesh, spec.rules):
        (emb, ds), vmask = embed(spec, trainable, frozen, rest, xs["input_ids"], images)
        lp, _, _ = token_stats(
            spec, trainable, frozen, rest, emb, ds, vmask, xs, spec.loss.temperature, False
        )
        return jnp.pad(lp, ((0, 0), (1, 0)))


def routing_terms(spec: StepSpec, info, mb, n_total):
    """MoE: (coef x this micro-batch's share of the load-balancing loss, metrics): the
    recorded/differing (token, layer) counts behind `routing_mismatch`, `router_aux_loss`."""
    routes = mb["routes"]  # i32[B, T, L, K]
    k = routes.shape[-1]
    _, own = jax.lax.top_k(jax.lax.stop_gradient(info.router_logits), k)  # [L, B, T, K]
    own = jnp.transpose(own, (1, 2, 0, 3))
    rec_BT = jnp.all(routes >= 0, axis=(2, 3)) & (mb["segment_ids"] > 0)
    differ = jnp.any(jnp.sort(own, -1) != jnp.sort(routes, -1), axis=-1)  # [B, T, L]
    metrics = {
        "_routing_differ": jnp.sum(differ & rec_BT[..., None]).astype(jnp.float32),
        "_routing_recorded": (jnp.sum(rec_BT) * routes.shape[2]).astype(jnp.float32),
    }
    coef = spec.loss.router_aux_coef
    if not coef:
        return 0.0, metrics
    mask = mb["loss_mask"]
    n = jnp.sum(mask).astype(jnp.float32)
    # a micro-batch without trained tokens adds nothing (and no 0/0 in its backward)
    safe = jnp.where(n > 0, mask, jnp.ones_like(mask))
    aux = jnp.where(n > 0, load_balancing_loss(info.router_logits, k, safe), 0.0)
    metrics["router_aux_loss"] = aux
    return coef * aux * n / jnp.maximum(n_total, 1.0), metrics


def micro_loss(
    spec: StepSpec, mode, trainable, frozen, rest, ref, emb, ds, vmask, ref_emb, mb, n_total
):
    """(loss, metrics) of one micro-batch, the MoE routing terms included."""
    loss, metrics, info = micro_policy_loss(
        spec, mode, trainable, frozen, rest, ref, emb, ds, vmask, ref_emb, mb
    )
    if info is None:  # dense
        return loss, metrics
    aux, routing = routing_terms(spec, info, mb, n_total)
    return loss + aux, {**metrics, **routing, "loss": loss + aux}


def micro_policy_loss(
    spec: StepSpec, mode, trainable, frozen, rest, ref, emb, ds, vmask, ref_emb, mb
):
    """(loss, metrics, MoE RoutingInfo or None) of one micro-batch: SFT's cross-entropy, or
    the policy loss (`losses.policy_loss`; SDPO's modes add their distillation term)."""
    lc = spec.loss
    temp = 1.0 if mode == "sft" else lc.temperature
    mask = mb["loss_mask"][:, 1:]
    weights = mb["loss_weights"][:, 1:]
    stats = (spec, trainable, frozen, rest, emb, ds, vmask, mb, temp)
    if mode == "sft":
        logp, _, info = token_stats(*stats, False)
        return (*losses.sft_loss(logp, weights, mask), info)
    variant = distill.parse_mode(mode)
    if variant is None:
        logp, entropy, info = token_stats(*stats, True)
    else:
        (logp, entropy, divergence), info = token_stats(*stats, True, variant)
    if not lc.entropy_coef:
        entropy = jax.lax.stop_gradient(entropy)
    behaviour = jnp.where(mask, mb["behaviour_logprobs"][:, 1:], jax.lax.stop_gradient(logp))
    old = behaviour if lc.old_logprobs == "behaviour" else jax.lax.stop_gradient(logp)
    ref_logp = None
    if ref is not None:
        r_emb, r_ds = ref_emb
        ref_logp, _, _ = token_stats(spec, ref, frozen, rest, r_emb, r_ds, vmask, mb, temp, False)
        ref_logp = jax.lax.stop_gradient(ref_logp)
    loss, metrics = losses.policy_loss(
        logp,
        old,
        mb["advantages"][:, 1:],
        weights,
        mask,
        eps_low=lc.eps_low,
        eps_high=lc.eps_high,
        behaviour_logprobs_BT=behaviour,
        tis_cap=lc.tis_cap,
        ref_logprobs_BT=ref_logp,
        kl_coef=lc.kl_coef,
        kl_estimator=lc.kl_estimator,
        entropy_BT=entropy,
        entropy_coef=lc.entropy_coef,
    )
    if variant is not None:
        loss, metrics = distill.micro_loss(loss, metrics, divergence, mb, variant.weight)
    return loss, metrics, info


def batch_grads(spec: StepSpec, mode, trainable, frozen, rest, ref, xs, images, n_total=None):
    """(grads, each micro-batch's metrics stacked [S]) of one call: the whole batch, or one
    chunk of a token-budget batch whose trained tokens in all are `n_total`. `ref`: the KL
    reference's params (needed when the loss has a KL term and `mode` is not SFT). Traced in
    the FSDP `shd.training_layout`: rows over the batch axes, each weight gathered as it is
    used (else GSPMD may keep every row on every chip)."""
    with shd.training_layout(spec.mesh, spec.rules):
        if n_total is None:
            n_total = jnp.sum(xs["loss_mask"]).astype(jnp.float32)
        if mode == "sft" or not spec.loss.kl_coef > 0:
            ref = None
        elif ref is None:
            raise ValueError("no reference policy: build the learner with LossConfig(kl_coef > 0)")
        if isinstance(images, ImageGroups):  # each micro-batch embeds its own screens
            return _grads_grouped(spec, mode, trainable, frozen, rest, ref, xs, images, n_total)
        return _grads_flat(spec, mode, trainable, frozen, rest, ref, xs, images, n_total)


def _grads_flat(spec: StepSpec, mode, trainable, frozen, rest, ref, xs, images, n_total):
    """`batch_grads` with the flat layout: the batch embedded once, outside the scan."""
    s = spec.num_substeps
    ids = xs["input_ids"]
    (emb, ds), embed_vjp, vmask = jax.vjp(
        lambda tr: embed(spec, tr, frozen, rest, ids, images), trainable, has_aux=True
    )
    ref_emb = None
    if ref is not None:
        ref_emb, _ = embed(spec, ref, frozen, rest, ids, images)
        ref_emb = jax.lax.stop_gradient(ref_emb)

    scan_in = {
        "mb": split_micro_inputs(xs, s),
        "emb": split_micro(emb, s),
        "ds": split_micro(ds, s),
        "vmask": split_micro(vmask, s),
        "ref_emb": split_micro(ref_emb, s),
    }

    def body(g_acc, x):
        def f(tr, e, d):
            return micro_loss(
                spec, mode, tr, frozen, rest, ref, e, d, x["vmask"], x["ref_emb"], x["mb"], n_total
            )

        (_, metrics), (g_tr, g_emb, g_ds) = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(
            trainable, x["emb"], x["ds"]
        )
        g_acc = jax.tree.map(jnp.add, g_acc, g_tr)
        return g_acc, (g_emb, g_ds, metrics)

    g0 = jax.tree.map(jnp.zeros_like, trainable)
    g_tr, (g_emb, g_ds, metrics) = jax.lax.scan(body, g0, scan_in)

    (g_embed,) = embed_vjp((unsplit_micro(g_emb), unsplit_micro(g_ds)))
    return jax.tree.map(jnp.add, g_tr, g_embed), metrics


def _grads_grouped(spec: StepSpec, mode, trainable, frozen, rest, ref, xs, images, n_total):
    """`batch_grads` with grouped screens (`image_groups`): the scan over micro-batches embeds
    each one's rows with its own screens inside the gradient, so the vision tower's
    activations are one micro-batch's and each device encodes its own rows' screens."""
    scan_in = {"mb": split_micro_inputs(xs, spec.num_substeps), "pv": images.pixel_values}

    def body(g_acc, x):
        mb = x["mb"]
        imgs = ImageGroups(x["pv"], images.meta)
        ref_emb = None
        if ref is not None:
            ref_emb, _ = embed(spec, ref, frozen, rest, mb["input_ids"], imgs)
            ref_emb = jax.lax.stop_gradient(ref_emb)

        def f(tr):
            (e, d), vmask = embed(spec, tr, frozen, rest, mb["input_ids"], imgs)
            return micro_loss(spec, mode, tr, frozen, rest, ref, e, d, vmask, ref_emb, mb, n_total)

        (_, metrics), g_tr = jax.value_and_grad(f, has_aux=True)(trainable)
        return jax.tree.map(jnp.add, g_acc, g_tr), metrics

    g0 = jax.tree.map(jnp.zeros_like, trainable)
    return jax.lax.scan(body, g0, scan_in)


def grads_and_metrics(spec: StepSpec, mode, trainable, frozen, rest, ref, xs, images):
    """(grads of the batch loss w.r.t. the trainable params, the step's metrics)."""
    grads, metrics = batch_grads(spec, mode, trainable, frozen, rest, ref, xs, images)
    return grads, batch_metrics(grads, metrics)


def batch_metrics(grads, metrics):
    """The step's metrics from the scan's per-micro-batch ones."""
    out = combine_micro_metrics(metrics, jnp)
    out["grad_norm"] = optax.tree.norm(grads)
    return out


def guarded_update(spec: StepSpec, trainable, opt_state, grads):
    """(params, optimizer state, norms) after the optimizer update of `grads`, unless the
    update is not finite or its norm exceeds `max_update_ratio` x the parameters' norm:
    then the params and the optimizer state stay as they were and `update_rejected` is 1
    (`check_finite` stops the run; nothing of the step is saved or sampled)."""
    updates, new_opt = spec.tx.update(grads, opt_state, trainable)
    update_norm = optax.tree.norm(updates)
    param_norm = optax.tree.norm(trainable)
    ratio = update_norm / jnp.maximum(param_norm, 1e-12)
    bound = spec.max_update_ratio
    ok = jnp.isfinite(update_norm) & jnp.isfinite(optax.tree.norm(grads))
    if bound > 0:
        ok = ok & (ratio <= bound)

    def keep(new, old):
        return jnp.where(ok, new, old)

    new_params = optax.apply_updates(trainable, updates)
    trainable = jax.tree.map(keep, new_params, trainable)
    opt_state = jax.tree.map(keep, new_opt, opt_state)
    norms = {
        "update_norm": update_norm,
        "update_ratio": ratio,
        "update_rejected": 1.0 - ok.astype(jnp.float32),
    }
    return trainable, opt_state, norms


def train_step(spec: StepSpec, mode, trainable, opt_state, frozen, rest, ref, xs, images):
    """One optimizer step on a batch: (params, optimizer state, metrics)."""
    grads, out = grads_and_metrics(spec, mode, trainable, frozen, rest, ref, xs, images)
    trainable, opt_state, norms = guarded_update(spec, trainable, opt_state, grads)
    out.update(norms)
    return trainable, opt_state, out


def chunk_grads(spec: StepSpec, mode, trainable, frozen, rest, ref, xs, images, n_total, acc):
    """One chunk of a token-budget batch: (grads so far `acc` + the chunk's, its
    micro-batches' metrics)."""
    g, metrics = batch_grads(spec, mode, trainable, frozen, rest, ref, xs, images, n_total)
    return jax.tree.map(jnp.add, acc, g), metrics


def apply_update(spec: StepSpec, trainable, opt_state, grads):
    """The guarded update from a token-budget batch's summed gradients, with their norm."""
    trainable, opt_state, out = guarded_update(spec, trainable, opt_state, grads)
    out["grad_norm"] = optax.tree.norm(grads)
    return trainable, opt_state, out


def zero_grads(trainable):
    """An all-zero gradient accumulator of the trainable params' shapes."""
    return jax.tree.map(jnp.zeros_like, trainable)
