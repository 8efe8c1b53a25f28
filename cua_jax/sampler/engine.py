"""Rollout engine: continuous batching over a paged KV cache, multi-turn KV reuse, preemption.

    engine = Engine(model, max_slots=16, page_size=16, num_pages=512, max_seq_len=2048)
    out = await engine.generate(prompt_ids, pixel_values, image_grid_thw,
                                params=SamplingParams(temperature=1.0, seed=7), session_id="ep3")
    out.tokens, out.logprobs, out.model_logprobs, out.finish_reason, out.version

Three parts. `scheduler.Scheduler` (host side, no JAX) decides: which waiting request takes a
free slot, how much of its prompt is already cached (its session's previous turn, or a running
request with the same prompt whose pages it forks), when to evict session caches or preempt.
`steps` holds the device programs: prefill (vision tower + K/V written into pages + last logits),
the decode chunk (up to `decode_chunk` steps for every slot inside a `while_loop`: embed ->
decoder with a paged-attention attn_fn -> logits -> sample, stop tokens and budgets checked on
device), first-token sampling and page copies. This `Engine` runs one scheduler iteration per
`step()` (in a worker thread for the asyncio callers), owns the cache and the weights, and takes
new weights between chunks (`update_params`, no copy).

A request: prefilled tokens [start, end) in one jitted call per (length bucket, image grid);
requests admitted together share calls; the first token is sampled right away. Finished on a
stop token, a stop string (host-side), max_new_tokens or max_seq_len.

M-RoPE: prompt positions come from `get_rope_index` over the whole prompt (host side), which is
exactly what a forward pass over the whole transcript uses; generated token i gets i + rope_delta
on all three axes, and positions depend only on earlier tokens, so cached K/V stay valid in later
turns. Sampling keys are fold_in(key(seed), token index), so a preempted and recomputed request
continues with the same random stream. Only a request that cannot fit even alone fails, with
finish_reason "error".

Hybrid models (Qwen3.5, Gated DeltaNet + full attention): the cache keeps K/V pages for the
full-attention layers and, per slot, the linear layers' conv and recurrent states (rows of
`cache.linear`, zeroed when a slot starts a new sequence, continued by every prefill and
decode of that slot). Finished sessions keep their states in rows of their own
(`session_states` of them); a session continues only from exactly the tokens its state
covers, a preempted request is recomputed from scratch, and running requests' pages are not
forked (`scheduler`'s docstring says why). Weights taken by `update_params` apply from the next
step; states already computed are kept, as K/V pages are.

On a mesh (`mesh=`, see `placement.py`): the learner's sharded parameters are used in place,
K/V pages are split by kv head over `tensor`, every jitted call has explicit in/out shardings,
and K/V writes + attention run under `shard_map` on each device's own kv heads.

Letters: S slots, C decode chunk, P pages per sequence, L page size, T tokens, V vocab.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from cua_jax import sharding as shd
from cua_jax.models import qwen_vl
from cua_jax.sampler import kv_cache, placement, steps
from cua_jax.sampler.grammar import TokenAutomaton
from cua_jax.sampler.kernels.paged_attention import GpuKernelOptions, select_backend
from cua_jax.sampler.page_table import TRASH_PAGE
from cua_jax.sampler.sampling import GrammarTables, SamplingParams, SlotSampling
from cua_jax.sampler.scheduler import (
    Admitted,
    GenerateOutput,
    Request,
    Scheduler,
    batch_bucket,
    pages_bucket,
    prompt_inputs,
    token_bucket,
)

__all__ = ["Engine", "GenerateOutput"]

_log = logging.getLogger(__name__)


# XLA:CPU compiles dots into YNNPACK fusions by default; for the decode and prefill shapes here
# (tens of rows x a few hundred columns) Eigen's dot is faster: 1-core decode step at batch 16 of
# the bench model 3.3 ms without vs 4.0 ms with (tools/bench_sampler.py, 2026-11-22). CPU only.
_CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}

# The CPU decode loop gathers every slot's pages (all layers) into contiguous buffers once per
# chunk when they fit in this many bytes; above it, it gathers pages inside each step instead.
_MAX_GATHERED_BYTES = 256 << 20


def _to_host(x: jax.Array) -> np.ndarray:
    """A replicated output as numpy; on a multi-host mesh from this process's own copy."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


def _moe_model_def(model: nnx.Module, mesh: Mesh | None, rules: shd.Rules) -> steps.ModelDef:
    """The ModelDef of a MoE model whose sparse blocks run expert-parallel on the engine's own
    mesh (a sampler sub-mesh may differ from the learner's; None: one device, no shard_map).

    The blocks' mesh is static module state (part of the graphdef), so it is set on a merged
    copy of the model: the caller's model (the learner's) keeps its own mesh."""

    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    copy = nnx.merge(graphdef, params, other)
    qwen_vl.set_expert_mesh(copy, mesh if mesh is not None and mesh.size > 1 else None, rules)
    return steps.ModelDef.of(copy)[0]


class Engine:
    """Continuous-batching sampler over a paged KV cache. See the module docstring.

    Args:
      model: a `cua_jax.models.qwen_vl.QwenVL` (weights are taken by reference, not copied).
      max_slots: sequences decoded together (the decode batch).
      page_size: tokens per KV page.
      num_pages: pages in the pool (page 0 is scratch), shared by all layers' pools.
      max_seq_len: longest sequence (prompt + generated); longer prompts fail alone.
      decode_chunk: decode steps per jitted call.
      attn_backend: paged-attention backend for decode ("auto", "tpu", "gpu", "interpret",
        "reference"); prefill always uses the jnp chunk attention.
      attn_options: tuning of our Pallas kernel when it is the one used ("gpu", "interpret"): a
        `GpuKernelOptions` or its string form, e.g. "pages_per_block=4,f32_dots=false".
      detokenize: ids -> text, needed only for stop strings.
      static_batching: admit new requests only when the batch has drained (for benchmarks).
      share_prefix: fork the pages of a running request with an identical prompt (GRPO groups).
      cache_dtype: dtype of the KV pages (default: the model's compute dtype).
      kv_sharding: sharding of each layer's page pool (default: kv heads over the mesh's
        `tensor` axis with a mesh, else the parameters' device).
      version: the weights version reported until the first update_params.
      mesh: run on this mesh (axes data / fsdp / tensor). Parameters already on it are used in
        place (the learner's, colocated); others are moved to `cua_jax.sharding` shardings
        under `rules` (a sampler sub-mesh; update_params reshards new weights the same way).
        None: the parameters' own mesh if they are sharded, else their device.
      rules: logical-axis rules for parameters moved onto `mesh` (pass the learner's).
      session_states: hybrid models only: finished sessions whose linear states are kept
        (default max_slots); each row costs the linear layers' conv + recurrent state.
      grammar: a `TokenAutomaton` (e.g. `grammar.action_automaton`) that requests with
        `SamplingParams(constrained=True)` are decoded within; its tables stay on the devices.
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        max_slots: int = 8,
        page_size: int = 16,
        num_pages: int = 256,
        max_seq_len: int = 1024,
        decode_chunk: int = 8,
        attn_backend: str = "auto",
        attn_options: GpuKernelOptions | str | None = None,
        detokenize: Callable[[Sequence[int]], str] | None = None,
        static_batching: bool = False,
        share_prefix: bool = True,
        cache_dtype: Any = None,
        kv_sharding: jax.sharding.Sharding | None = None,
        version: int = 0,
        mesh: Mesh | None = None,
        rules: shd.Rules = shd.DEFAULT_RULES,
        session_states: int | None = None,
        grammar: TokenAutomaton | None = None,
    ):
        cfg = model.config
        t = cfg.text
        self.config = cfg
        self.hybrid = steps.is_hybrid(cfg)
        if session_states is not None and session_states < 0:
            raise ValueError(f"Engine: session_states={session_states} must be >= 0")
        self.sched = Scheduler(
            max_slots=max_slots,
            page_size=page_size,
            num_pages=num_pages,
            max_seq_len=max_seq_len,
            image_token_id=cfg.image_token_id,
            share_prefix=share_prefix,
            static_batching=static_batching,
            detokenize=detokenize,
            route_shape=steps.route_shape(cfg),
            session_states=(max_slots if session_states is None else session_states)
            if self.hybrid
            else None,
        )
        self.max_slots, self.page_size, self.num_pages = max_slots, page_size, num_pages
        self.max_seq_len, self.decode_chunk = max_seq_len, decode_chunk
        self.attn_backend = attn_backend
        self.pages_per_seq = self.sched.pages_per_seq
        self._model_def, params = steps.ModelDef.of(model)
        mesh = mesh or placement.params_mesh(params)
        self.mesh = mesh
        if t.is_moe:
            self._model_def = _moe_model_def(model, mesh, rules)
        if mesh is not None:
            placement.check_mesh(mesh, t.num_key_value_heads, t.num_attention_heads)
            params, param_sh = placement.place_params(params, mesh, rules)
            kv_sharding = kv_sharding or placement.kv_sharding(mesh)
            small = placement.replicated(mesh)
        else:
            params = jax.tree.map(
                lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), params
            )
            param_sh = jax.tree.map(lambda x: x.sharding, params)
            device = next(iter(jax.tree.leaves(params)[0].devices()))
            kv_sharding = kv_sharding or jax.sharding.SingleDeviceSharding(device)
            if isinstance(kv_sharding, NamedSharding):
                small = placement.replicated(kv_sharding.mesh)
            else:
                small = placement.replicated(next(iter(kv_sharding.device_set)))
        self._state, self._param_sh = params, param_sh
        self.version = version
        dtype = cache_dtype or jnp.dtype(cfg.dtype)
        n_kv = len(kv_cache.kv_layers(cfg))
        shape = (n_kv, t.num_key_value_heads, num_pages, page_size, t.head_dim)
        linear = steps.linear_cache_shapes(cfg, self.sched.num_state_rows)

        # Committed to its devices up front: a first call with uncommitted inputs would
        # otherwise compile a second time.
        state_sh = steps.StepShardings(None, kv_sharding, small)
        state_sh = tuple(steps.linear_state_sharding(state_sh, cfg) for _ in linear)

        def init_cache() -> kv_cache.KVCache:
            zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), linear)
            return kv_cache.init_cache(*shape, dtype, kv_sharding, zeros, state_sh)

        self._init_cache = init_cache
        self.cache = self._init_cache()
        platform = next(iter(kv_sharding.device_set)).platform
        # Decided once, for the cache's platform: an explicit backend whose kernel cannot take
        # this head_dim / page_size fails here, not at the first decode compile.
        self._attn = select_backend(
            attn_backend, head_dim=t.head_dim, page_size=page_size, platform=platform
        )
        if isinstance(attn_options, str):
            attn_options = GpuKernelOptions.parse(attn_options)
        self.attn_options = attn_options or GpuKernelOptions()
        self.step_config = steps.StepConfig(
            page_size=page_size,
            decode_chunk=decode_chunk,
            head_dim=t.head_dim,
            attn_backend=self._attn,
            attn_options=self.attn_options,
            mesh=mesh,
        )
        self.shardings = steps.StepShardings(param_sh, kv_sharding, small)
        self.grammar = grammar
        self._grammar = (
            GrammarTables.none()
            if grammar is None
            else jax.device_put(GrammarTables.of(grammar, t.vocab_size), small)
        )
        self._fns = steps.build_step_fns(
            self._model_def,
            self.step_config,
            self.shardings,
            n_kv,
            dict(_CPU_COMPILER_OPTIONS) if platform == "cpu" else None,
        )
        self._lock = threading.RLock()  # held by step(): one scheduler iteration at a time
        # Submissions and weight updates hand over through this small condition, so generate()
        # and update_params() never wait for a running decode chunk (the event loop stays free).
        self._inbox = threading.Condition()
        self._incoming: list[Request] = []
        self._cancelled: set[int] = set()  # ids whose callers left (applied by step)
        self._pending_params: tuple[Any, int] | None = None
        self._ids = itertools.count()
        self._driver: asyncio.Task | None = None

    # The scheduler's state, under the names tests and tools use.
    @property
    def alloc(self):
        return self.sched.alloc

    @property
    def stats(self) -> dict[str, int]:
        return self.sched.stats

    @property
    def _sessions(self):
        return self.sched.sessions

    @property
    def detokenize(self):
        return self.sched.detokenize

    @detokenize.setter
    def detokenize(self, fn) -> None:
        self.sched.detokenize = fn

    # ------------------------------------------------------------------------------ public
    async def generate(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        pixel_values: np.ndarray | None = None,
        image_grid_thw: np.ndarray | None = None,
        params: SamplingParams | None = None,
        session_id: Any = None,
        image_hashes: Sequence[bytes] | None = None,
    ) -> GenerateOutput:
        """Generates a continuation of one prompt; concurrent calls share the decode batch.

        prompt_ids is the whole transcript (all turns); pixel_values / image_grid_thw cover all
        its images, as for a forward pass. With a session_id, K/V of that session's previous turn
        are reused for the common prefix. image_hashes: each image's `image_digest`, when the
        caller keeps them (the rollout hashes a screenshot once, not once a turn).
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def on_done(out: GenerateOutput) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(out))

        rid = self.submit(
            prompt_ids, pixel_values, image_grid_thw, params, session_id, on_done, image_hashes
        )
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive())
        try:
            return await fut
        except asyncio.CancelledError:  # nobody waits for the tokens: stop making them
            if rid is not None:
                self.cancel(rid)
            raise

    def cancel(self, rid: int) -> None:
        """Stops request `rid` (from `submit`) at the next scheduler iteration; its `on_done`
        gets finish_reason "cancelled". A request already finished is left alone."""
        with self._inbox:
            self._cancelled.add(rid)

    def generate_batch(
        self, requests: Sequence[dict[str, Any]] | Sequence[Sequence[int]]
    ) -> list[GenerateOutput]:
        """Blocking: runs a list of requests (prompt id lists, or dicts of `generate` kwargs)."""
        outs: list[GenerateOutput | None] = [None] * len(requests)
        for i, r in enumerate(requests):
            kw = dict(r) if isinstance(r, dict) else {"prompt_ids": r}

            def done(o: GenerateOutput, i: int = i) -> None:
                outs[i] = o

            self.submit(on_done=done, **kw)
        while any(o is None for o in outs):
            self.step()
        return outs  # type: ignore[return-value]

    def update_params(self, new: nnx.Module | nnx.State, version: int) -> None:
        """Uses the trainer's new weights from the next decode chunk on (no copy).

        `new` is a QwenVL or its nnx.State (e.g. `nnx.state(model)`); arrays are taken by
        reference, and moved (`jax.device_put`) only if their sharding differs from the engine's:
        a sampler on its own sub-mesh gets the new weights resharded onto it here.
        """
        state = (
            nnx.state(new, nnx.Param)
            if isinstance(new, nnx.Module)
            else nnx.filter_state(new, nnx.Param)
        )
        if jax.tree.structure(state) != jax.tree.structure(self._state):
            raise ValueError(
                "update_params: the new parameter tree does not match the engine's model "
                "(different config or a LoRA/base mismatch)."
            )

        def place(x, sh):
            if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sh, x.ndim):
                return x
            return jax.device_put(x, sh)

        placed = jax.tree.map(place, state, self._param_sh)
        with self._inbox:
            self._pending_params = (placed, version)
            self._inbox.notify_all()

    def drop_session(self, session_id: Any) -> None:
        """Frees the cached K/V of a finished episode (also evicted automatically when needed)."""
        with self._lock:
            self.sched.drop_session(session_id)

    def check_pages(self) -> None:
        """Asserts refcounts equal the owners (slots + session caches); for tests."""
        self.sched.check_pages()

    def submit(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        pixel_values: np.ndarray | None = None,
        image_grid_thw: np.ndarray | None = None,
        params: SamplingParams | None = None,
        session_id: Any = None,
        on_done: Callable[[GenerateOutput], None] = lambda o: None,
        image_hashes: Sequence[bytes] | None = None,
    ) -> int | None:
        """Queues a request; `on_done` gets its GenerateOutput (from the thread running step).
        Returns its id for `cancel` (None: refused at once, `on_done` already called)."""
        req = self._make_request(
            prompt_ids, pixel_values, image_grid_thw, params, session_id, image_hashes
        )
        if isinstance(req, str):
            empty = np.zeros((0,), np.float32)
            n = len(np.asarray(prompt_ids).reshape(-1))
            on_done(GenerateOutput([], empty, empty, "error", self.version, n, 0, 0, req))
            return None
        req.on_done = on_done
        with self._inbox:
            self._incoming.append(req)
        return req.rid

    def _make_request(
        self, prompt_ids, pixel_values, image_grid_thw, params, session_id, image_hashes=None
    ) -> Request | str:
        """The Request (M-RoPE positions, image runs and hashes computed), or an error message."""
        params = params or SamplingParams()
        prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
        if len(prompt) == 0:
            return "empty prompt: prompt_ids must hold at least one token"
        if len(prompt) >= self.max_seq_len:
            return (
                f"prompt of {len(prompt)} tokens does not fit max_seq_len={self.max_seq_len} "
                "(with room for one generated token): shorten the prompt or the history window, "
                "or build the Engine with a larger max_seq_len"
            )
        if params.stop_strings and self.detokenize is None:
            return "stop_strings need Engine(detokenize=tokenizer.decode)"
        if params.constrained and self.grammar is None:
            return "constrained=True needs an Engine built with a grammar (Engine(grammar=...))"
        cfg = self.config
        inputs = prompt_inputs(
            prompt,
            pixel_values,
            image_grid_thw,
            image_token_id=cfg.image_token_id,
            merge_size=cfg.vision.spatial_merge_size,
            image_hashes=image_hashes,
        )
        if isinstance(inputs, str):
            return inputs
        return Request(
            rid=next(self._ids),
            params=params,
            session_id=session_id,
            on_done=lambda o: None,
            **inputs.fields(),
        )

    def abstract_grammar(self) -> GrammarTables:
        """ShapeDtypeStructs of the grammar tables the jitted calls take (for the warm-up)."""
        return self._grammar.abstract(None if self.grammar is None else self.shardings.small)

    def _grammar_states(self, reqs: Sequence[Request | None]) -> list[int]:
        """Each request's grammar state after the tokens it has generated (-1: unconstrained),
        advanced on the host from where the previous call left it."""
        out = []
        for r in reqs:
            if r is None or not r.params.constrained:
                out.append(-1)
                continue
            if r.grammar_seen == 0:
                r.grammar_state = self.grammar.initial
            r.grammar_state = self.grammar.walk(r.generated[r.grammar_seen :], r.grammar_state)
            r.grammar_seen = len(r.generated)
            out.append(r.grammar_state)
        return out

    def has_work(self) -> bool:
        return bool(self._incoming or self.sched.has_work())

    # ---------------------------------------------------------------------------- driver
    async def _drive(self) -> None:
        while self.has_work():
            try:
                await asyncio.to_thread(self.step)
            except Exception as e:  # noqa: BLE001 - reported to every waiting caller
                _log.exception("sampler step failed; failing the requests in flight")
                self._fail_all(f"sampler step failed: {type(e).__name__}: {e}")

    def _fail_all(self, error: str) -> None:
        """After an exception inside `step()`: every request in flight (running, waiting or just
        submitted) finishes with finish_reason "error" instead of waiting forever, and the
        scheduler starts clean (slots, pages and session caches reset; the KV cache is rebuilt
        if the failed call had consumed it), so later requests run normally."""
        with self._lock:
            with self._inbox:
                incoming = list(self._incoming)
                self._incoming.clear()
            reqs = [*self.sched.reset(), *incoming]
            if any(x.is_deleted() for x in jax.tree.leaves(self.cache)):
                self.cache = self._init_cache()
            for req in reqs:
                req.slot = -1
                self.sched.finish(req, "error", self.version, error=error)

    def _take_pending_params(self) -> None:
        """Under self._inbox: installs weights handed over by update_params."""
        if self._pending_params is not None:
            (self._state, self.version), self._pending_params = self._pending_params, None

    def _wait_for_live_params(self, timeout_s: float = 600.0) -> None:
        """Blocks while our weights were donated away by a train step and no update has come.

        The engine holds the trainer's arrays by reference; a train step that donates them
        deletes them. The next update_params brings the new ones; until then decoding waits.
        """

        def deleted() -> bool:
            leaves = jax.tree.leaves(self._state)
            return any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves)

        with self._inbox:
            while deleted():
                if self._pending_params is not None:
                    self._take_pending_params()
                    continue
                if not self._inbox.wait(timeout_s):
                    raise RuntimeError(
                        "the sampler's weights were deleted (donated by a train step) and no "
                        f"update_params arrived within {timeout_s:.0f} s: call "
                        "engine.update_params(learner.params_for_sampler(), version) after "
                        "each train step"
                    )

    def step(self) -> None:
        """One scheduler iteration: admit waiting requests (prefilling them), then one decode
        chunk."""
        with self._lock:
            with self._inbox:
                self.sched.waiting.extend(self._incoming)
                self._incoming.clear()
                self._take_pending_params()
                cancelled, self._cancelled = self._cancelled, set()
            if cancelled:
                self.sched.cancel(cancelled, self.version)
            if self.sched.has_work():
                self._wait_for_live_params()
            for batch in self.sched.admit(self.version):
                self._prefill_batch(batch)
            if self.sched.running:
                self._decode()

    # ----------------------------------------------------------------------------- prefill
    def _prefill_batch(self, batch: list[Admitted]) -> None:
        """Prefills requests admitted together, then samples the first token of each fresh one.

        Text-only chunks of the same length bucket share one call; a chunk with images runs alone
        (its vision tower input has its own shape). First tokens are sampled in one call.
        """
        self._copy_states()
        for a in batch:
            self._copy(a.copies)
        groups: dict[Any, list[Admitted]] = {}
        for a in batch:
            if a.end <= a.start:
                continue
            if any(a.start <= s < a.end for s, _ in a.req.image_runs):
                groups[("image", a.slot)] = [a]
            else:
                groups.setdefault(token_bucket(a.end - a.start), []).append(a)
        logits_of: dict[int, tuple[jax.Array, int]] = {}
        for group in groups.values():
            logits = self._prefill(group)
            for i, a in enumerate(group):
                logits_of[a.slot] = (logits, i)
        fresh = self.sched.prefilled(batch)
        if not fresh:
            return
        # First tokens, one sampling call per prefill call, on that call's logits f32[X, V]
        # (X a prefill row bucket, n <= X sampled rows): no eager stacking of rows from several
        # calls, so every (X, n) is in the warm-up's bucket set (cua_jax.job.warmup)
        calls: dict[int, tuple[jax.Array, list[tuple[Admitted, int]]]] = {}
        for a in fresh:
            logits, i = logits_of[a.slot]
            calls.setdefault(id(logits), (logits, []))[1].append((a, i))
        for logits_XV, members in calls.values():
            n = batch_bucket(len(members))
            pad = n - len(members)
            idx = np.asarray([i for _, i in members] + [0] * pad, np.int32)  # padding: ignored
            reqs = [a.req for a, _ in members] + [None] * pad
            sampling = SlotSampling.from_params(
                [r and r.params for r in reqs], self._grammar_states(reqs), self._grammar
            )
            tok, lp, mlp = map(
                _to_host,
                self._fns.sample_first(logits_XV, idx, sampling, np.zeros((n,), np.int32)),
            )
            for j, (a, _) in enumerate(members):
                self.sched.next_tok[a.slot] = int(tok[j])
                self.sched.append(
                    a.req, [int(tok[j])], [float(lp[j])], [float(mlp[j])], self.version
                )

    def _copy_states(self) -> None:
        """Hybrid models: runs the scheduler's pending (slot row -> session row) state copies
        (sessions that finished since), before any slot row is written again."""
        copies = self.sched.take_state_copies()
        if not copies:
            return
        n = token_bucket(len(copies), 4)
        pairs = np.zeros((2, n), np.int32)
        pairs[1] = self.sched.num_state_rows  # padding: written out of range, dropped
        pairs[:, : len(copies)] = np.asarray(copies, np.int32).T
        self.cache = self._fns.copy_states(self.cache, pairs[0], pairs[1])

    def _copy(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        n = token_bucket(len(copies), 4)
        pairs = np.zeros((2, n), np.int32)  # padded with (0 -> 0) scratch copies
        pairs[:, : len(copies)] = np.asarray(copies, np.int32).T
        self.cache = self._fns.copy_pages(self.cache, pairs[0], pairs[1])
        self.stats["page_copies"] += len(copies)

    def _pages_bucket(self, n_tokens: int) -> int:
        """Page-table columns an attention call over sequences of <= n_tokens reads
        (`scheduler.pages_bucket`): attention work follows the live length with only a few
        compiled shapes."""
        return pages_bucket(n_tokens, self.alloc.page_size, self.pages_per_seq)

    def _prefill(self, group: list[Admitted]) -> jax.Array:
        """Runs tokens [start, end) of each request in `group` through the model into the cache.

        Returns f32[rows, V] logits of each row's last token (rows = batch_bucket(len(group));
        padding rows write only to the trash page and attend to nothing).
        """
        B = batch_bucket(len(group))
        T = token_bucket(max(a.end - a.start for a in group))
        ids = np.zeros((B, T), np.int32)
        pos = np.zeros((3, B, T), np.int32)
        start = np.zeros((B,), np.int32)
        n = np.zeros((B,), np.int32)
        slots = np.zeros((B,), np.int64)
        # hybrid models' state rows: padding rows read zeros and write out of range (dropped)
        dst = np.full((B,), self.sched.num_state_rows, np.int32)
        src = np.full((B,), -1, np.int32)
        for b, a in enumerate(group):
            k = a.end - a.start
            ids[b, :k] = a.req.seq[a.start : a.end]
            pos[:, b, :k] = a.req.positions_of(a.start, a.end)
            start[b], n[b], slots[b] = a.start, k, a.slot
            dst[b], src[b] = a.slot, a.state_src
        pix, grid = None, ()
        if len(group) == 1:
            # Images whose token runs lie in [start, end) (admission never splits a run).
            req, s0, s1 = group[0].req, group[0].start, group[0].end
            imgs = [i for i, (s, _) in enumerate(req.image_runs) if s0 <= s < s1]
            if imgs:
                lo, hi = req.patch_offsets[imgs[0]], req.patch_offsets[imgs[-1] + 1]
                pix = req.pixel_values[lo:hi]
                grid = tuple(tuple(int(x) for x in req.grids[i]) for i in imgs)
        table = self.alloc.table()[slots, : self._pages_bucket(int(np.max(start + n)))]
        table[len(group) :] = TRASH_PAGE
        self.cache, logits = self._fns.prefill(grid)(
            self._state, self.cache, ids, pix, pos, table, start, n, dst, src
        )
        self.stats["prefill_tokens"] += int(n.sum())
        self.stats["prefill_calls"] += 1
        return logits

    # ------------------------------------------------------------------------------ decode
    def _decode_fn(self, state, cache, table_SP, *rest):
        """One jitted decode chunk: over contiguous per-slot buffers (jnp reference backend,
        when they fit in _MAX_GATHERED_BYTES), else over the pages."""
        contiguous = (
            self._attn == "reference"
            and steps.contiguous_bytes(cache, table_SP.shape[0], table_SP.shape[1])
            <= _MAX_GATHERED_BYTES
        )
        fn = self._fns.decode_contiguous if contiguous else self._fns.decode_paged
        return fn(state, cache, table_SP, *rest)

    def _decode(self) -> None:
        self._copy_states()
        plan = self.sched.plan_decode(self.decode_chunk, self.version)
        for copies in plan.copies:
            self._copy(copies)
        if not self.sched.running:
            return
        # Attention reads only the page-table columns the longest sequence reaches in this chunk.
        table = self.alloc.table()[:, : self._pages_bucket(plan.longest)]
        # Host arrays go to the jitted call as numpy (cheaper than jnp.asarray each).
        self.cache, out_tok, out_lp, out_mlp, *routes = self._decode_fn(
            self._state,
            self.cache,
            table,
            plan.lengths,
            plan.tok,
            plan.delta,
            plan.steps,
            plan.gen,
            plan.stops,
            SlotSampling.from_params(
                plan.params,
                self._grammar_states([self.sched.running.get(i) for i in range(self.max_slots)]),
                self._grammar,
            ),
        )
        out_tok, out_lp, out_mlp = map(_to_host, (out_tok, out_lp, out_mlp))
        out_routes = _to_host(routes[0]) if routes else None  # MoE: i32[S, C, L, K]
        self.stats["decode_calls"] += 1
        self.stats["slot_steps"] += self.max_slots * self.decode_chunk
        self.sched.apply_decode(out_tok, out_lp, out_mlp, self.version, out_routes)
        self._copy_states()
