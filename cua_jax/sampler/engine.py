"""Rollout engine: continuous batching over a paged KV cache, multi-turn KV reuse, preemption.

    engine = Engine(model, max_slots=16, page_size=16, num_pages=512, max_seq_len=2048)
    out = await engine.generate(prompt_ids, pixel_values, image_grid_thw,
                                params=SamplingParams(temperature=1.0, seed=7), session_id="ep3")
    out.tokens, out.logprobs, out.model_logprobs, out.finish_reason, out.version

How a request flows (host scheduler `step()`, called in a worker thread by the asyncio driver):

1. Admission (between decode chunks). A waiting request takes a free slot. Its K/V may already
   be partly in the cache: (a) its `session_id`'s previous turn (prompt + generated) is kept after
   it finishes, and the longest common prefix with the new prompt is reused (image runs are never
   split, and a screenshot is reused only if its pixels are identical), so a turn that appends a
   screenshot prefills only the new tokens, and a turn whose history window dropped an old
   screenshot recomputes from the first difference; (b) a running request with the identical
   prompt (the G rollouts of a GRPO group) lends its pages through a fork of the page table
   (refcounted; the partially filled last page is copied on first write). Only the rest is
   prefilled, in one jitted call per (length bucket, image grid) that runs the vision tower, writes
   K/V into pages and returns the last logits; the first token is sampled right away.
2. Decode. One jitted call advances every slot by up to `decode_chunk` tokens inside a
   `while_loop` (embed -> decoder with a paged-attention attn_fn -> logits -> sample), with stop
   tokens and per-slot budgets checked on device; the host only looks at the chunk's output.
3. Finish on a stop token, a stop string (host-side), max_new_tokens or max_seq_len.

M-RoPE: prompt positions come from `get_rope_index` over the whole prompt (host side), which is
exactly what a forward pass over the whole transcript uses; generated token i gets i + rope_delta
on all three axes, and positions depend only on earlier tokens, so cached K/V stay valid in later
turns.

Pages running out: session caches are evicted first (least recently used), then the most
recently admitted running request is preempted: its pages are freed and it goes back to the
front of the queue with its tokens so far, to be recomputed. Sampling keys are
fold_in(key(seed), token index), so a recomputed request continues with the same random stream.
Only a request that cannot fit even alone fails, with finish_reason "error".

Letters: S slots, C decode chunk, P pages per sequence, L page size, T tokens, V vocab.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cua_jax.models.qwen_vl.rope import get_rope_index
from cua_jax.models.qwen_vl.vision import vision_metadata
from cua_jax.sampler import kv_cache
from cua_jax.sampler.kernels.paged_attention import (
    GpuKernelOptions,
    chunk_attention_reference,
    contiguous_decode_attention,
    paged_attention,
    select_backend,
)
from cua_jax.sampler.page_table import TRASH_PAGE, OutOfPagesError, PageAllocator
from cua_jax.sampler.sampling import SamplingParams, SlotSampling, sample_tokens

_MAX_STOP_IDS = 8
_log = logging.getLogger(__name__)


@dataclasses.dataclass
class GenerateOutput:
    """Result of one request.

    tokens: generated token ids (a stop token that ended generation is included).
    logprobs: f32 log-prob of each token under the distribution it was sampled from (see
      `sampling.py`); model_logprobs: f32 log_softmax of the raw logits (temperature 1).
    finish_reason: "stop" (stop token / string), "length" (max_new_tokens or max_seq_len) or
      "error" (see `error`). version: the oldest weights version that produced any token.
    num_prompt_tokens / num_cached_tokens: prompt length and how many of its tokens were served
      from the cache (session reuse or group prefix sharing) instead of being prefilled.
    """

    tokens: list[int]
    logprobs: np.ndarray
    model_logprobs: np.ndarray
    finish_reason: str
    version: int
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: str | None = None


@dataclasses.dataclass
class _Request:
    rid: int
    prompt: np.ndarray  # i32[T0]
    pixel_values: np.ndarray | None
    grids: np.ndarray  # i32[n_images, 3]
    params: SamplingParams
    session_id: Any
    on_done: Callable[[GenerateOutput], None]
    positions: np.ndarray  # i32[3, T0] M-RoPE positions of the prompt
    rope_delta: int
    image_runs: list[tuple[int, int]]  # [start, end) of each image's token run, in order
    image_hashes: list[bytes]
    patch_offsets: np.ndarray  # i64[n_images + 1] first pixel row of each image
    prompt_key: bytes
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    model_logprobs: list[float] = dataclasses.field(default_factory=list)
    slot: int = -1
    version: int = -1
    cached_tokens: int = -1
    preemptions: int = 0

    @property
    def seq(self) -> np.ndarray:
        return np.concatenate([self.prompt, np.asarray(self.generated, np.int32)])


@dataclasses.dataclass
class _Session:
    tokens: np.ndarray  # i32[n] the full previous sequence
    kv_len: int  # tokens whose K/V are in `pages`
    pages: list[int]
    image_runs: list[tuple[int, int]]
    image_hashes: list[bytes]


def _bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _batch_bucket(n: int) -> int:
    """Rows of a batched prefill call: 1, 4, 16, 64, ... (few shapes, at most 4x padding)."""
    b = 1
    while b < n:
        b *= 4
    return b


# Attention reads at least this many tokens' worth of page-table columns per call; above it the
# width is the next power of two of what the longest live sequence needs (see `_pages_bucket`).
_MIN_ATTN_TOKENS = 128

# XLA:CPU compiles dots into YNNPACK fusions by default; for the decode and prefill shapes here
# (tens of rows x a few hundred columns) Eigen's dot is faster: 1-core decode step at batch 16 of
# the bench model 3.3 ms without vs 4.0 ms with (tools/bench_sampler.py, 2026-11-22). CPU only.
_CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}

# The CPU decode loop gathers every slot's pages (all layers) into contiguous buffers once per
# chunk when they fit in this many bytes; above it, it gathers pages inside each step instead.
_MAX_GATHERED_BYTES = 256 << 20


@dataclasses.dataclass
class _Prefill:
    """An admitted request whose tokens [start, end) still have to be prefilled."""

    req: _Request
    slot: int
    start: int
    end: int


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if diff.size else n


def _image_runs(ids: np.ndarray, image_token_id: int) -> list[tuple[int, int]]:
    is_img = np.concatenate([[False], ids == image_token_id, [False]])
    edges = np.nonzero(np.diff(is_img.astype(np.int8)))[0]
    return [(int(s), int(e)) for s, e in zip(edges[::2], edges[1::2], strict=True)]


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
      kv_sharding: sharding of each layer's page pool, e.g. kv-heads over the `tensor` axis.
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
    ):
        cfg = model.config
        t = cfg.text
        self.config = cfg
        self.max_slots, self.page_size, self.num_pages = max_slots, page_size, num_pages
        self.max_seq_len, self.decode_chunk = max_seq_len, decode_chunk
        self.attn_backend, self.detokenize = attn_backend, detokenize
        self.static_batching, self.share_prefix = static_batching, share_prefix
        self.pages_per_seq = -(-max_seq_len // page_size)
        if self.pages_per_seq > num_pages - 1:
            # As vLLM refuses a max_model_len its KV cache cannot hold: otherwise a request that
            # fits max_seq_len could fail half-way through its output, after every other
            # sequence was preempted.
            raise ValueError(
                f"Engine: one sequence of max_seq_len={max_seq_len} tokens needs "
                f"{self.pages_per_seq} KV pages of page_size={page_size}, but num_pages="
                f"{num_pages} holds {num_pages - 1} (page 0 is scratch); use num_pages >= "
                f"{self.pages_per_seq + 1} or a smaller max_seq_len."
            )
        self.alloc = PageAllocator(num_pages, page_size, max_slots, self.pages_per_seq)
        # Params are swapped by update_params; other variables (if any) stay as built.
        self._graphdef, self._state, self._other = nnx.split(model, nnx.Param, ...)
        self._params_ready = threading.Condition()
        self.version = version
        dtype = cache_dtype or jnp.dtype(cfg.dtype)
        # Commit the cache to its devices up front: jit outputs are committed, and a first call
        # with uncommitted inputs would otherwise compile a second time.
        kv_sharding = kv_sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        self._init_cache = lambda: kv_cache.init_cache(
            t.num_hidden_layers, t.num_key_value_heads, num_pages, page_size, t.head_dim, dtype,
            kv_sharding,
        )  # fmt: skip
        self.cache = self._init_cache()
        self._scale = 1.0 / math.sqrt(t.head_dim)
        self._lock = threading.RLock()  # held by step(); the scheduler state is not shared
        # Submissions and weight updates hand over through this small lock so that generate()
        # and update_params() never wait for a running decode chunk (the event loop stays free).
        self._inbox_lock = threading.Lock()
        self._incoming: list[_Request] = []
        self._pending_params: tuple[Any, int] | None = None
        self._ids = itertools.count()
        self._waiting: list[_Request] = []
        self._running: dict[int, _Request] = {}  # slot -> request
        self._admit_order: list[int] = []  # slots, oldest first (preemption takes the last)
        self._next_tok = np.zeros(max_slots, np.int32)
        self._sessions: OrderedDict[Any, _Session] = OrderedDict()
        self._prefill_fns: dict[tuple, Callable] = {}
        self._driver: asyncio.Task | None = None
        self.stats = dict.fromkeys(
            ["prefill_tokens", "prefill_calls", "cached_tokens", "decode_calls", "slot_steps",
             "useful_tokens", "preemptions", "page_copies"], 0,
        )  # fmt: skip
        # Explicit output placement: the cache keeps its sharding across calls (donated, updated
        # in place); small outputs (tokens, log-probs, logits) are replicated.
        self._cache_sh = jax.tree.map(lambda x: x.sharding, self.cache)
        if isinstance(kv_sharding, jax.sharding.NamedSharding):
            small = jax.sharding.NamedSharding(kv_sharding.mesh, jax.sharding.PartitionSpec())
        else:
            small = jax.sharding.SingleDeviceSharding(next(iter(self.cache.k[0].devices())))
        self._small_sh = small
        platform = next(iter(self.cache.k[0].devices())).platform
        # Decided once, for the cache's platform: an explicit backend whose kernel cannot take
        # this head_dim / page_size fails here, not at the first decode compile.
        self._attn = select_backend(
            attn_backend, head_dim=t.head_dim, page_size=page_size, platform=platform
        )
        if isinstance(attn_options, str):
            attn_options = GpuKernelOptions.parse(attn_options)
        self.attn_options = attn_options or GpuKernelOptions()
        on_cpu = platform == "cpu"
        self._compiler_options = dict(_CPU_COMPILER_OPTIONS) if on_cpu else None
        self._decode_fn = jax.jit(
            self._decode_chunk, donate_argnums=(1,), out_shardings=(self._cache_sh, *[small] * 3),
            compiler_options=self._compiler_options,
        )  # fmt: skip
        self._copy_fn = jax.jit(
            kv_cache.copy_pages, donate_argnums=(0,), out_shardings=self._cache_sh
        )
        # First tokens after prefill: rows idx of a prefill call's logits.
        self._sample_fn = jax.jit(
            lambda logits, idx, sampling, step: sample_tokens(logits[idx], sampling, step),
            compiler_options=self._compiler_options,
        )

    # ------------------------------------------------------------------------------ public
    async def generate(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        pixel_values: np.ndarray | None = None,
        image_grid_thw: np.ndarray | None = None,
        params: SamplingParams | None = None,
        session_id: Any = None,
    ) -> GenerateOutput:
        """Generates a continuation of one prompt; concurrent calls share the decode batch.

        prompt_ids is the whole transcript (all turns); pixel_values / image_grid_thw cover all
        its images, as for a forward pass. With a session_id, K/V of that session's previous turn
        are reused for the common prefix.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def on_done(out: GenerateOutput) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(out))

        self.submit(prompt_ids, pixel_values, image_grid_thw, params, session_id, on_done)
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive())
        return await fut

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
        reference, and moved only if they live on different devices/shardings than ours.
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

        def place(new_leaf, old_leaf):
            if isinstance(old_leaf, jax.Array) and isinstance(new_leaf, jax.Array):
                if new_leaf.sharding != old_leaf.sharding:
                    return jax.device_put(new_leaf, old_leaf.sharding)
            return new_leaf

        with self._inbox_lock:
            self._pending_params = (jax.tree.map(place, state, self._state), version)
        with self._params_ready:
            self._params_ready.notify_all()

    def _wait_for_live_params(self, timeout_s: float = 600.0) -> None:
        """Blocks while our weights were donated away by a train step and no update has come.

        The engine holds the trainer's arrays by reference; a train step that donates them
        deletes them. The next update_params brings the new ones; until then decoding waits.
        """

        def deleted() -> bool:
            leaves = jax.tree.leaves(self._state)
            return any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves)

        with self._params_ready:
            while deleted():
                with self._inbox_lock:
                    if self._pending_params is not None:
                        (self._state, self.version), self._pending_params = (
                            self._pending_params, None,
                        )  # fmt: skip
                        continue
                if not self._params_ready.wait(timeout_s):
                    raise RuntimeError(
                        "the sampler's weights were deleted (donated by a train step) and no "
                        f"update_params arrived within {timeout_s:.0f} s: call "
                        "engine.update_params(learner.params_for_sampler(), version) after "
                        "each train step"
                    )

    def submit(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        pixel_values: np.ndarray | None = None,
        image_grid_thw: np.ndarray | None = None,
        params: SamplingParams | None = None,
        session_id: Any = None,
        on_done: Callable[[GenerateOutput], None] = lambda o: None,
    ) -> None:
        """Queues a request; `on_done` gets its GenerateOutput (from the thread running step)."""
        params = params or SamplingParams()
        prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
        rid = next(self._ids)

        def fail(msg: str) -> None:
            empty = np.zeros((0,), np.float32)
            on_done(GenerateOutput([], empty, empty, "error", self.version, len(prompt), 0, 0, msg))

        if len(prompt) == 0:
            return fail("empty prompt: prompt_ids must hold at least one token")
        if len(prompt) >= self.max_seq_len:
            return fail(
                f"prompt of {len(prompt)} tokens does not fit max_seq_len={self.max_seq_len} "
                "(with room for one generated token): shorten the prompt or the history window, "
                "or build the Engine with a larger max_seq_len"
            )
        if params.stop_strings and self.detokenize is None:
            return fail("stop_strings need Engine(detokenize=tokenizer.decode)")
        cfg = self.config
        grids = np.zeros((0, 3), np.int32) if image_grid_thw is None else np.asarray(image_grid_thw)
        grids = grids.reshape(-1, 3).astype(np.int32)
        if pixel_values is None and len(grids):
            return fail("image_grid_thw given without pixel_values")
        try:
            pos, delta = get_rope_index(
                prompt[None], grids if len(grids) else None,
                image_token_id=cfg.image_token_id,
                spatial_merge_size=cfg.vision.spatial_merge_size,
            )  # fmt: skip
        except ValueError as e:
            return fail(str(e))
        runs = _image_runs(prompt, cfg.image_token_id)
        sizes = np.prod(grids, axis=1).astype(np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        pix = None if pixel_values is None else np.asarray(pixel_values)
        if pix is not None and pix.shape[0] != offsets[-1]:
            return fail(
                f"pixel_values has {pix.shape[0]} patch rows but image_grid_thw needs "
                f"{offsets[-1]} (sum of t*h*w)"
            )
        hashes = [
            hashlib.sha1(pix[offsets[i] : offsets[i + 1]].tobytes() + grids[i].tobytes()).digest()
            for i in range(len(grids))
        ]
        key = hashlib.sha1(prompt.tobytes() + b"".join(hashes)).digest()
        req = _Request(
            rid, prompt, pix, grids, params, session_id, on_done, pos[:, 0], int(delta[0, 0]),
            runs, hashes, offsets, key,
        )  # fmt: skip
        with self._inbox_lock:
            self._incoming.append(req)

    def has_work(self) -> bool:
        return bool(self._incoming or self._waiting or self._running)

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
            with self._inbox_lock:
                reqs = [*self._running.values(), *self._waiting, *self._incoming]
                self._incoming.clear()
            self._waiting.clear()
            self._running.clear()
            self._admit_order.clear()
            self._sessions.clear()
            self.alloc = PageAllocator(
                self.num_pages, self.page_size, self.max_slots, self.pages_per_seq
            )
            if any(x.is_deleted() for x in jax.tree.leaves(self.cache)):
                self.cache = self._init_cache()
            for req in reqs:
                req.slot = -1
                self._finish(req, "error", error=error)

    def step(self) -> None:
        """One scheduler iteration: admit waiting requests, then one decode chunk."""
        with self._lock:
            with self._inbox_lock:
                self._waiting.extend(self._incoming)
                self._incoming.clear()
                if self._pending_params is not None:
                    (self._state, self.version), self._pending_params = self._pending_params, None
            if self._waiting or self._running:
                self._wait_for_live_params()
            self._admit()
            if self._running:
                self._decode()

    # ---------------------------------------------------------------------------- admission
    def _free_slots(self) -> list[int]:
        return [s for s in range(self.max_slots) if s not in self._running]

    def _admit(self) -> None:
        """Admits waiting requests into free slots, prefilling those admitted together in batches.

        A request that would fork the pages of (or continue the session of) one admitted in this
        same round waits for that one's prefill first, so it never shares pages not yet written.
        """
        if self.static_batching and self._running:
            return
        pending: list[_Prefill] = []
        while self._waiting:
            free = self._free_slots()
            if not free:
                break
            req = self._waiting[0]
            if any(self._depends_on(req, p.req) for p in pending):
                self._prefill_pending(pending)
                pending = []
            got = self._try_admit(req, free[0])
            if got is False:
                break
            self._waiting.pop(0)
            if isinstance(got, _Prefill):
                pending.append(got)
        self._prefill_pending(pending)

    def _depends_on(self, req: _Request, other: _Request) -> bool:
        same_prompt = self.share_prefix and req.prompt_key == other.prompt_key
        same_session = req.session_id is not None and req.session_id == other.session_id
        return same_prompt or same_session

    def _evict_session(self) -> bool:
        if not self._sessions:
            return False
        _, sess = self._sessions.popitem(last=False)
        self.alloc.decref(sess.pages)
        return True

    def _reuse_len(
        self, req: _Request, tokens, runs, hashes, avail: int, target: np.ndarray
    ) -> int:
        """Tokens of `target` whose cached K/V (from a sequence `tokens`) can be reused."""
        n = min(_common_prefix(tokens[:avail], target), len(target) - 1)
        for (s, e), h_old, (s2, e2), h_new in zip(
            runs, hashes, req.image_runs, req.image_hashes, strict=False
        ):
            if s >= n:
                break
            if (s, e) != (s2, e2) or h_old != h_new or e > n:
                n = min(n, s, s2)  # never split or reuse a different image
                break
        return max(n, 0)

    def _try_admit(self, req: _Request, slot: int) -> bool | _Prefill:
        """Takes `slot` and the pages for `req`: False = wait (no pages), True = finished (error),
        or the _Prefill still to run. The slot counts as running from here on."""
        seq = req.seq
        # Prefill everything but the last token when resuming (it is fed by the next decode).
        target = seq[:-1] if req.generated else seq
        start = 0
        sess = self._sessions.get(req.session_id) if req.session_id is not None else None
        donor = None
        if sess is not None:
            start = self._reuse_len(
                req, sess.tokens, sess.image_runs, sess.image_hashes, sess.kv_len, target
            )
            del self._sessions[req.session_id]
            keep = self.alloc.pages_for(start)
            self.alloc.decref(sess.pages[keep:])
            self.alloc.attach(slot, sess.pages[:keep], start)
        else:
            for s, other in self._running.items() if self.share_prefix else ():
                if other.prompt_key == req.prompt_key and not req.generated:
                    donor = s
                    break
            if donor is not None:
                n = min(len(req.prompt) - 1, int(self.alloc.lengths[donor]))
                start = self._reuse_len(
                    req, req.prompt, req.image_runs, req.image_hashes, n, target
                )
                self.alloc.fork(donor, slot, start)
            else:
                self.alloc.attach(slot, [], 0)
        while True:
            try:
                copies = self.alloc.prepare_write(slot, start, len(target))
                break
            except OutOfPagesError:
                if self._evict_session():
                    continue
                if not self._running:
                    self.alloc.release(slot)
                    self._finish(req, "error", error=(
                        f"request needs {self.alloc.pages_for(len(target))} KV pages but the "
                        f"pool has {self.num_pages - 1}: build the Engine with more num_pages"
                    ))  # fmt: skip
                    return True
                # Wait for running requests to free pages (admission never preempts).
                self.alloc.release(slot)
                return False
        self._copy(copies)
        if req.cached_tokens < 0:
            req.cached_tokens = start
            self.stats["cached_tokens"] += start
        if req.version < 0:
            req.version = self.version
        self._running[slot] = req
        self._admit_order.append(slot)
        req.slot = slot
        return _Prefill(req, slot, start, len(target))

    def _prefill_pending(self, pending: list[_Prefill]) -> None:
        """Prefills admitted requests, then samples the first token of each fresh one.

        Text-only chunks of the same length bucket share one call; a chunk with images runs alone
        (its vision tower input has its own shape). First tokens are sampled in one call.
        """
        groups: dict[Any, list[_Prefill]] = {}
        for p in pending:
            if p.end <= p.start:
                continue
            if any(p.start <= s < p.end for s, _ in p.req.image_runs):
                groups[("image", p.slot)] = [p]
            else:
                groups.setdefault(_bucket(p.end - p.start), []).append(p)
        logits_of: dict[int, tuple[jax.Array, int]] = {}
        for group in groups.values():
            logits = self._prefill(group)
            for i, p in enumerate(group):
                logits_of[p.slot] = (logits, i)
        fresh = []
        for p in pending:
            self.alloc.set_length(p.slot, p.end)
            if p.req.generated:  # resumed after preemption: the last token is fed by decode
                self._next_tok[p.slot] = p.req.generated[-1]
            else:
                fresh.append(p)
        if not fresh:
            return
        rows = [logits_of[p.slot] for p in fresh]
        if len({id(lg) for lg, _ in rows}) == 1:  # one prefill call: pick its rows on device
            logits_XV, idx = rows[0][0], [i for _, i in rows]
        else:
            logits_XV, idx = jnp.stack([lg[i] for lg, i in rows]), list(range(len(rows)))
        n = _batch_bucket(len(fresh))
        idx = np.asarray(idx + [0] * (n - len(fresh)), np.int32)  # padding rows: ignored
        sampling = SlotSampling.from_params(
            [p.req.params for p in fresh] + [None] * (n - len(fresh))
        )
        tok, lp, mlp = map(
            np.asarray, self._sample_fn(logits_XV, idx, sampling, np.zeros((n,), np.int32))
        )
        for j, p in enumerate(fresh):
            self._next_tok[p.slot] = int(tok[j])
            self._append(p.req, [int(tok[j])], [float(lp[j])], [float(mlp[j])])

    def _copy(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        n = _bucket(len(copies), 4)
        pairs = np.zeros((2, n), np.int32)  # padded with (0 -> 0) scratch copies
        pairs[:, : len(copies)] = np.asarray(copies, np.int32).T
        self.cache = self._copy_fn(self.cache, jnp.asarray(pairs[0]), jnp.asarray(pairs[1]))
        self.stats["page_copies"] += len(copies)

    # ----------------------------------------------------------------------------- prefill
    def _pages_bucket(self, n_tokens: int) -> int:
        """Page-table columns an attention call over sequences of <= n_tokens reads.

        A power of two of the pages needed (at least _MIN_ATTN_TOKENS tokens' worth, at most the
        whole table), so attention work follows the live length with only a few compiled shapes.
        """
        need = max(self.alloc.pages_for(max(n_tokens, _MIN_ATTN_TOKENS)), 1)
        return min(self.pages_per_seq, 1 << math.ceil(math.log2(need)))

    def _prefill(self, group: list[_Prefill]) -> jax.Array:
        """Runs tokens [start, end) of each request in `group` through the model into the cache.

        Returns f32[rows, V] logits of each row's last token (rows = _batch_bucket(len(group));
        padding rows write only to the trash page and attend to nothing).
        """
        B = _batch_bucket(len(group))
        T = _bucket(max(p.end - p.start for p in group))
        ids = np.zeros((B, T), np.int32)
        pos = np.zeros((3, B, T), np.int32)
        start = np.zeros((B,), np.int32)
        n = np.zeros((B,), np.int32)
        slots = np.zeros((B,), np.int64)
        for b, p in enumerate(group):
            k = p.end - p.start
            ids[b, :k] = p.req.seq[p.start : p.end]
            pos[:, b, :k] = self._positions(p.req, p.start, p.end)
            start[b], n[b], slots[b] = p.start, k, p.slot
        pix, grid = None, ()
        if len(group) == 1:
            # Images whose token runs lie in [start, end) (admission never splits a run).
            req, s0, s1 = group[0].req, group[0].start, group[0].end
            imgs = [i for i, (s, _) in enumerate(req.image_runs) if s0 <= s < s1]
            if imgs:
                lo, hi = req.patch_offsets[imgs[0]], req.patch_offsets[imgs[-1] + 1]
                pix = jnp.asarray(req.pixel_values[lo:hi])
                grid = tuple(tuple(int(x) for x in req.grids[i]) for i in imgs)
        fn = self._prefill_fns.get(grid)
        if fn is None:
            fn = jax.jit(
                lambda *a, _g=grid: self._prefill_chunk(*a, grid=_g),
                donate_argnums=(1,),
                out_shardings=(self._cache_sh, self._small_sh),
                compiler_options=self._compiler_options,
            )
            self._prefill_fns[grid] = fn
        table = self.alloc.table()[slots, : self._pages_bucket(int(np.max(start + n)))]
        table[len(group) :] = TRASH_PAGE
        self.cache, logits = fn(
            self._state, self.cache, ids, pix, pos, table, start, n
        )  # fmt: skip
        self.stats["prefill_tokens"] += int(n.sum())
        self.stats["prefill_calls"] += 1
        return logits

    def _positions(self, req: _Request, start: int, end: int) -> np.ndarray:
        """i32[3, end - start] M-RoPE positions of sequence tokens [start, end)."""
        T0 = len(req.prompt)
        idx = np.arange(start, end)
        gen = np.broadcast_to(idx + req.rope_delta, (3, len(idx)))
        return np.where(idx < T0, req.positions[:, np.minimum(idx, T0 - 1)], gen).astype(np.int32)

    def _prefill_chunk(self, state, cache, ids_BT, pix, pos_3BT, table_BP, start_B, n_B, *, grid):
        """Rows b: tokens start[b] .. start[b] + n[b] - 1 (n[b] = 0: a padding row)."""
        model = nnx.merge(self._graphdef, state, self._other)
        B, T = ids_BT.shape
        meta = vision_metadata(self.config, np.asarray(grid, np.int64)) if grid else None
        embeds, vis_mask, ds = model.embed(ids_BT, pix, None, vision_meta=meta)
        q_pos = start_B[:, None] + jnp.arange(T)[None]  # i32[B, T]
        valid = jnp.arange(T)[None] < n_B[:, None]
        page, off = kv_cache.token_slots(table_BP, q_pos, valid, self.page_size)
        k_pools, v_pools = list(cache.k), list(cache.v)

        def attn_fn(i, q_BTNH, k_BTKH, v_BTKH):
            k_pools[i], v_pools[i] = kv_cache.write_kv(
                k_pools[i], v_pools[i], k_BTKH, v_BTKH, page, off
            )
            out = chunk_attention_reference(
                q_BTNH, k_pools[i], v_pools[i], table_BP, q_pos, start_B + n_B, self._scale
            )
            return out.astype(q_BTNH.dtype)

        hidden = model.decode(embeds, pos_3BT, attn_fn, vis_mask, ds)
        last = jnp.take_along_axis(hidden, jnp.maximum(n_B - 1, 0)[:, None, None], axis=1)
        logits = model.logits(last)[:, 0]
        return kv_cache.KVCache(tuple(k_pools), tuple(v_pools)), logits

    # ------------------------------------------------------------------------------ decode
    def _decode_chunk(self, state, cache, table_SP, lengths_S, tok_S, delta_S, steps_S, gen_S,
                      stop_SX, sampling):  # fmt: skip
        """Up to C decode steps for every slot; slot s runs steps_S[s] steps or until a stop.

        With the jnp reference backend (CPU) and a small enough table, each slot's pages are
        gathered into contiguous K/V buffers once per chunk (the table covers every position the
        chunk writes), each step writes its K/V into those buffers and attends to them, and the
        chunk's new tokens go into the pages once at the end: no page gather inside the loop.
        Otherwise every step writes its K/V into the pages and calls `paged_attention` (the
        Pallas kernels on GPU / TPU).
        """
        model = nnx.merge(self._graphdef, state, self._other)
        S, C = tok_S.shape[0], self.decode_chunk
        K, P, L, H = cache.k[0].shape[0], table_SP.shape[1], self.page_size, cache.k[0].shape[3]
        gathered = 2 * cache.num_layers * K * S * P * L * H * cache.k[0].dtype.itemsize
        contiguous = self._attn == "reference" and gathered <= _MAX_GATHERED_BYTES
        if contiguous:
            # k [S, K, H, P*L], v [S, K, P*L, H] (the layouts the attention dots take); V past
            # each slot's length is zeroed (stale pages) since attention multiplies it by 0.
            live = (jnp.arange(P * L)[None, :] < lengths_S[:, None])[:, None, :, None]
            ks, vs = [], []
            for kp, vp in zip(cache.k, cache.v, strict=True):
                k = kp[:, table_SP].reshape(K, S, P * L, H)
                v = jnp.transpose(vp[:, table_SP].reshape(K, S, P * L, H), (1, 0, 2, 3))
                ks.append(jnp.transpose(k, (1, 0, 3, 2)))
                vs.append(jnp.where(live, v, 0).astype(v.dtype))
            kv0 = (tuple(ks), tuple(vs))
        else:
            kv0 = cache

        def cond(carry):
            i, done = carry[0], carry[4]
            return (i < C) & jnp.any(~done & (i < steps_S))

        def body(carry):
            i, kv, lengths, tok, done, out_tok, out_lp, out_mlp = carry
            active = (~done) & (i < steps_S)
            pos_S = lengths + delta_S
            pos = jnp.broadcast_to(pos_S[None, :, None], (3, S, 1))
            attn_len = jnp.where(active, lengths + 1, 0)
            if contiguous:
                k_bufs, v_bufs = list(kv[0]), list(kv[1])
                # Inactive slots write out of range: dropped.
                at = jnp.where(active, lengths, P * L)
            else:
                k_bufs, v_bufs = list(kv.k), list(kv.v)
                page, off = kv_cache.token_slots(
                    table_SP, lengths[:, None], active[:, None], self.page_size
                )

            def attn_fn(li, q_BTNH, k_BTKH, v_BTKH):
                if contiguous:
                    rows = jnp.arange(S)
                    k_bufs[li] = (
                        k_bufs[li].at[rows, :, :, at].set(k_BTKH[:, 0].astype(k_bufs[li].dtype),
                                                          mode="drop")
                    )  # fmt: skip
                    v_bufs[li] = (
                        v_bufs[li].at[rows, :, at].set(v_BTKH[:, 0].astype(v_bufs[li].dtype),
                                                       mode="drop")
                    )  # fmt: skip
                    o = contiguous_decode_attention(
                        q_BTNH[:, 0], k_bufs[li], v_bufs[li], attn_len, self._scale
                    )
                else:
                    k_bufs[li], v_bufs[li] = kv_cache.write_kv(
                        k_bufs[li], v_bufs[li], k_BTKH, v_BTKH, page, off
                    )
                    o = paged_attention(
                        q_BTNH[:, 0], k_bufs[li], v_bufs[li], table_SP, attn_len,
                        scale=self._scale, backend=self._attn, gpu_options=self.attn_options,
                    )  # fmt: skip
                return o[:, None].astype(q_BTNH.dtype)

            embeds, _, _ = model.embed(tok[:, None])
            hidden = model.decode(embeds, pos, attn_fn)
            logits = model.logits(hidden)[:, 0]
            new, lp, mlp = sample_tokens(logits, sampling, gen_S + i)
            is_stop = jnp.any(new[:, None] == stop_SX, axis=1)
            out_tok = out_tok.at[:, i].set(jnp.where(active, new, -1))
            out_lp = out_lp.at[:, i].set(lp)
            out_mlp = out_mlp.at[:, i].set(mlp)
            if contiguous:
                kv = (tuple(k_bufs), tuple(v_bufs))
            else:
                kv = kv_cache.KVCache(tuple(k_bufs), tuple(v_bufs))
            return (
                i + 1,
                kv,
                lengths + active,
                jnp.where(active, new, tok),
                done | (active & is_stop),
                out_tok,
                out_lp,
                out_mlp,
            )

        init = (
            jnp.int32(0), kv0, lengths_S, tok_S, jnp.zeros((S,), bool),
            jnp.full((S, C), -1, jnp.int32), jnp.zeros((S, C), jnp.float32),
            jnp.zeros((S, C), jnp.float32),
        )  # fmt: skip
        # while_loop, not fori_loop: the chunk ends early once every slot has stopped.
        _, kv, lengths, _, _, out_tok, out_lp, out_mlp = jax.lax.while_loop(cond, body, init)
        if not contiguous:
            return kv, out_tok, out_lp, out_mlp
        # A slot's active steps are a prefix of the chunk: it wrote positions
        # lengths_S .. lengths - 1; copy those from the buffers into the pages.
        pos_SC = jnp.minimum(lengths_S[:, None] + jnp.arange(C)[None], P * L - 1)
        valid_SC = jnp.arange(C)[None] < (lengths - lengths_S)[:, None]
        page, off = kv_cache.token_slots(table_SP, pos_SC, valid_SC, self.page_size)
        k_pools, v_pools = list(cache.k), list(cache.v)
        for li in range(cache.num_layers):
            k_new = jnp.take_along_axis(kv[0][li], pos_SC[:, None, None, :], axis=3)  # [S,K,H,C]
            v_new = jnp.take_along_axis(kv[1][li], pos_SC[:, None, :, None], axis=2)  # [S,K,C,H]
            k_pools[li], v_pools[li] = kv_cache.write_kv(
                k_pools[li], v_pools[li], jnp.transpose(k_new, (0, 3, 1, 2)),
                jnp.transpose(v_new, (0, 2, 1, 3)), page, off,
            )  # fmt: skip
        return kv_cache.KVCache(tuple(k_pools), tuple(v_pools)), out_tok, out_lp, out_mlp

    def _budget(self, req: _Request) -> int:
        return min(
            req.params.max_new_tokens - len(req.generated),
            self.max_seq_len - len(req.prompt) - len(req.generated),
        )

    def _preempt_one(self, needed_by: int) -> bool:
        """Frees the most recently admitted running request other than `needed_by`."""
        for slot in reversed(self._admit_order):
            if slot != needed_by:
                req = self._running.pop(slot)
                self._admit_order.remove(slot)
                self.alloc.release(slot)
                req.slot = -1
                req.preemptions += 1
                self.stats["preemptions"] += 1
                self._waiting.insert(0, req)
                return True
        return False

    def _decode(self) -> None:
        C = self.decode_chunk
        steps = np.zeros(self.max_slots, np.int32)
        for slot in list(self._admit_order):
            if slot not in self._running:
                continue  # preempted while making room for an earlier slot
            req = self._running[slot]
            n = min(C, self._budget(req))
            L0 = int(self.alloc.lengths[slot])
            while True:
                try:
                    self._copy(self.alloc.prepare_write(slot, L0, L0 + n))
                    break
                except OutOfPagesError:
                    if self._evict_session() or self._preempt_one(slot):
                        continue
                    self._running.pop(slot)
                    self._admit_order.remove(slot)
                    self.alloc.release(slot)
                    self._finish(req, "error", error="KV page pool too small for one sequence")
                    break
            if slot in self._running:
                steps[slot] = n
        if not self._running:
            return
        # Attention reads only the page-table columns the longest sequence reaches in this chunk.
        longest = max(int(self.alloc.lengths[s]) + int(steps[s]) for s in self._running)
        table = self.alloc.table()[:, : self._pages_bucket(longest)]
        S = self.max_slots
        delta = np.zeros(S, np.int32)
        gen = np.zeros(S, np.int32)
        stops = np.full((S, _MAX_STOP_IDS), -1, np.int32)
        params: list[SamplingParams | None] = [None] * S
        for slot, req in self._running.items():
            delta[slot] = req.rope_delta
            gen[slot] = len(req.generated)
            ids = req.params.stop_token_ids[:_MAX_STOP_IDS]
            stops[slot, : len(ids)] = ids
            params[slot] = req.params
        # Host arrays go to the jitted call as numpy (cheaper than jnp.asarray each).
        self.cache, out_tok, out_lp, out_mlp = self._decode_fn(
            self._state, self.cache, table, self.alloc.lengths.copy(), self._next_tok.copy(),
            delta, steps, gen, stops, SlotSampling.from_params(params),
        )  # fmt: skip
        out_tok, out_lp, out_mlp = map(np.asarray, (out_tok, out_lp, out_mlp))
        self.stats["decode_calls"] += 1
        self.stats["slot_steps"] += S * C
        for slot, req in list(self._running.items()):
            k = int(np.sum(out_tok[slot] >= 0))
            self.alloc.set_length(slot, int(self.alloc.lengths[slot]) + k)
            self._next_tok[slot] = out_tok[slot, k - 1] if k else self._next_tok[slot]
            req.version = min(req.version, self.version)
            self._append(req, out_tok[slot, :k].tolist(), out_lp[slot, :k], out_mlp[slot, :k])

    # ------------------------------------------------------------------------------ finish
    def _append(self, req: _Request, toks: list[int], lps, mlps) -> None:
        """Adds tokens to a running request and finishes it if a stop condition is met."""
        p = req.params
        for j, t in enumerate(toks):
            req.generated.append(int(t))
            req.logprobs.append(float(lps[j]))
            req.model_logprobs.append(float(mlps[j]))
            self.stats["useful_tokens"] += 1
            if t in p.stop_token_ids:
                return self._finish(req, "stop")
            if p.stop_strings:
                text = self.detokenize(req.generated)
                if any(s in text for s in p.stop_strings):
                    return self._finish(req, "stop")
            if self._budget(req) <= 0:
                return self._finish(req, "length")

    def _finish(self, req: _Request, reason: str, error: str | None = None) -> None:
        slot = req.slot
        if slot >= 0 and self._running.get(slot) is req:
            del self._running[slot]
            self._admit_order.remove(slot)
            if req.session_id is not None:
                pages, kv_len = self.alloc.detach(slot)
                seq = req.seq
                kv_len = min(kv_len, len(seq))
                old = self._sessions.pop(req.session_id, None)
                if old is not None:
                    self.alloc.decref(old.pages)
                self._sessions[req.session_id] = _Session(
                    seq, kv_len, pages, _image_runs(seq, self.config.image_token_id),
                    req.image_hashes,
                )  # fmt: skip
            else:
                self.alloc.release(slot)
        req.slot = -1
        out = GenerateOutput(
            tokens=list(req.generated),
            logprobs=np.asarray(req.logprobs, np.float32),
            model_logprobs=np.asarray(req.model_logprobs, np.float32),
            finish_reason=reason,
            version=max(req.version, 0) if req.version >= 0 else self.version,
            num_prompt_tokens=len(req.prompt),
            num_cached_tokens=max(req.cached_tokens, 0),
            num_preemptions=req.preemptions,
            error=error,
        )
        req.on_done(out)

    def drop_session(self, session_id: Any) -> None:
        """Frees the cached K/V of a finished episode (also evicted automatically when needed)."""
        with self._lock:
            sess = self._sessions.pop(session_id, None)
            if sess is not None:
                self.alloc.decref(sess.pages)

    def check_pages(self) -> None:
        """Asserts refcounts equal the owners (slots + session caches); for tests."""
        counts = self.alloc.owned_counts([s.pages for s in self._sessions.values()])
        if not np.array_equal(counts, self.alloc.refcount):
            raise AssertionError("page refcounts disagree with the owners")
        assert TRASH_PAGE not in [p for s in self._sessions.values() for p in s.pages]
