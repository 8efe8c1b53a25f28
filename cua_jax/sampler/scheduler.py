"""Host-side scheduler of the sampler: slots, session caches, admission, preemption, finishing.

Pure Python and numpy (no JAX): it decides what runs and keeps the page bookkeeping; the Engine
runs what it decides on device (`steps.py`). One scheduler iteration, as the Engine drives it:

    for batch in sched.admit(version):        # list[Admitted]; a batch is prefilled together
        run batch's page copies, prefill it, sample first tokens -> sched.append(...)
        sched.prefilled(batch)
    plan = sched.plan_decode(chunk)           # page copies, steps per slot, host arrays
    run the copies and one decode chunk -> sched.apply_decode(plan, tokens, lps, mlps, version)

Admission takes a free slot for the first waiting request. Its K/V may already be partly in the
cache: (a) its `session_id`'s previous turn (prompt + generated) is kept after it finishes, and
the longest common prefix with the new prompt is reused (image runs are never split, and a
screenshot is reused only if its pixels are identical); (b) a running request with the identical
prompt (the G rollouts of a GRPO group) lends its pages through a fork of the page table
(refcounted; the partially filled last page is copied on first write). `try_admit` answers with
an explicit result: `Admitted` (tokens [start, end) still to prefill), `Deferred` (no pages now:
wait for running requests to finish; admission never preempts) or `Rejected` (cannot fit even
alone: finished with finish_reason "error").

Pages running out during decode: session caches are evicted first (least recently used), then
the most recently admitted running request is preempted: its pages are freed and it goes back
to the front of the queue with its tokens so far, to be recomputed.

Hybrid models (`session_states` set: Qwen3.5's Gated DeltaNet layers carry a recurrent state
per sequence besides the K/V pages). The state after exactly n tokens can only continue from
token n, so:
* state rows: slot s uses row s; a finishing request with a session id has its slot's state
  copied into a session row (`pending_state_copies`, run by the engine before the slot is
  reused), together with `state_len`, the tokens it covers (every fed token: the K/V length);
* a session is reused only when the common prefix equals `state_len` exactly (the next turn
  extends the transcript as it was); otherwise the request is prefilled from token 0. The state
  is not stored at page boundaries: a snapshot is the whole recurrent state (Qwen3.5-27B: 48
  linear layers x 48 heads x 128 x 128 f32 = 151 MB), too big to keep per page;
* a preempted request is recomputed from scratch (its pages and state are given up);
* forking a running request's pages (`share_prefix`, GRPO groups) is off: the donor's state
  covers its own tokens, not the shared prefix, so the group's copies are prefilled (in one
  batched call when they are text-only).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from blake3 import blake3

from cua_jax.data.positions import get_rope_index
from cua_jax.sampler.page_table import TRASH_PAGE, OutOfPagesError, PageAllocator
from cua_jax.sampler.params import SamplingParams

MAX_STOP_IDS = 8
STAT_NAMES = (
    "prefill_tokens",
    "prefill_calls",
    "cached_tokens",
    "decode_calls",
    "slot_steps",
    "useful_tokens",
    "preemptions",
    "page_copies",
)


# ------------------------------------------------------------------------------ the bucket set
# Every jitted sampler call takes one of a few shapes (a run compiles its programs once):
# prefill rows and tokens, the page-table columns attention reads, page-copy counts. These are
# the rules; `BucketSet` enumerates what they allow for one engine configuration, which bounds
# (and, compiled ahead, fixes) the programs a run ever compiles.

MIN_PREFILL_TOKENS = 16
MIN_ATTN_TOKENS = 128  # attention reads at least this many tokens' worth of page-table columns


def token_bucket(n: int, minimum: int = MIN_PREFILL_TOKENS) -> int:
    """Tokens of a prefill call (and entries of a page-copy call, minimum 4): the power of two
    >= n, at least `minimum`."""
    return max(minimum, 1 << max(0, (max(n, 1) - 1).bit_length()))


def batch_bucket(n: int) -> int:
    """Rows of a batched prefill call: 1, 4, 16, 64, ... (few shapes, at most 4x padding)."""
    b = 1
    while b < n:
        b *= 4
    return b


def pages_bucket(n_tokens: int, page_size: int, pages_per_seq: int) -> int:
    """Page-table columns an attention call over sequences of <= n_tokens reads: a power of two
    of the pages needed (at least MIN_ATTN_TOKENS tokens' worth, at most the whole table)."""
    need = max(-(-max(n_tokens, MIN_ATTN_TOKENS) // page_size), 1)
    return min(pages_per_seq, 1 << (need - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class BucketSet:
    """The shapes the sampler's programs take for one engine configuration.

    prefill_rows x prefill_tokens x table_cols: text-only prefill calls (B, T, P); a prefill with
    images has one row (B = 1) and its own image grid. decode: one chunk per table width P (S =
    max_slots). copies: entries of a page-copy call."""

    prefill_rows: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    table_cols: tuple[int, ...]
    copies: tuple[int, ...]

    @staticmethod
    def of(max_slots: int, max_seq_len: int, page_size: int) -> BucketSet:
        pages_per_seq = -(-max_seq_len // page_size)

        def powers(lo: int, hi: int) -> tuple[int, ...]:
            out, b = [], lo
            while b < hi:
                out.append(b)
                b *= 2
            return (*out, hi)

        rows, b = [], 1
        while b < max_slots:
            rows.append(b)
            b *= 4
        return BucketSet(
            prefill_rows=(*rows, b),
            prefill_tokens=powers(MIN_PREFILL_TOKENS, token_bucket(max_seq_len)),
            table_cols=tuple(
                sorted({pages_bucket(n, page_size, pages_per_seq) for n in powers(1, max_seq_len)})
            ),
            copies=powers(4, token_bucket(max_slots, 4)),
        )

    def prefill_shapes(self) -> list[tuple[int, int, int]]:
        """Every text-only prefill (rows, tokens, table columns)."""
        return [
            (b, t, p)
            for b in self.prefill_rows
            for t in self.prefill_tokens
            for p in self.table_cols
        ]

    def __str__(self) -> str:
        return (
            f"sampler buckets: prefill rows {list(self.prefill_rows)} x tokens "
            f"{list(self.prefill_tokens)} x table columns {list(self.table_cols)}; decode chunk "
            f"per table width; page copies {list(self.copies)}"
        )


@dataclasses.dataclass
class GenerateOutput:
    """Result of one request.

    tokens: generated token ids (a stop token that ended generation is included).
    logprobs: f32 log-prob of each token under the distribution it was sampled from (see
      `sampling.py`); model_logprobs: f32 log_softmax of the raw logits (temperature 1).
    finish_reason: "stop" (stop token / string), "length" (max_new_tokens or max_seq_len),
      "cancelled" (`Engine.generate`'s caller was cancelled) or "error" (see `error`).
      version: the oldest weights version that produced any token.
    num_prompt_tokens / num_cached_tokens: prompt length and how many of its tokens were served
      from the cache (session reuse or group prefix sharing) instead of being prefilled.
    routes: MoE models only (None for dense ones): i32[len(tokens), L, K], the experts each of
      the L sparse layers chose for generated token i when it was fed back as the next decode
      input (what routing replay gives the learner at that token's position); -1 where not
      recorded (the last token, never fed; tokens recomputed after a preemption keep theirs).
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
    routes: np.ndarray | None = None


@dataclasses.dataclass
class Request:
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
    routes: list[np.ndarray] = dataclasses.field(default_factory=list)  # MoE: i32[L, K] each
    slot: int = -1
    version: int = -1
    cached_tokens: int = -1
    preemptions: int = 0
    grammar_state: int = -1  # constrained decoding: the state after generated[:grammar_seen]
    grammar_seen: int = 0

    @property
    def seq(self) -> np.ndarray:
        return np.concatenate([self.prompt, np.asarray(self.generated, np.int32)])

    def positions_of(self, start: int, end: int) -> np.ndarray:
        """i32[3, end - start] M-RoPE positions of sequence tokens [start, end): the prompt's
        from `get_rope_index`, generated token i at i + rope_delta on all three axes."""
        T0 = len(self.prompt)
        idx = np.arange(start, end)
        gen = np.broadcast_to(idx + self.rope_delta, (3, len(idx)))
        return np.where(idx < T0, self.positions[:, np.minimum(idx, T0 - 1)], gen).astype(np.int32)


@dataclasses.dataclass
class Session:
    tokens: np.ndarray  # i32[n] the full previous sequence
    kv_len: int  # tokens whose K/V are in `pages`
    pages: list[int]
    image_runs: list[tuple[int, int]]
    image_hashes: list[bytes]
    state_row: int = -1  # hybrid models: the row holding the linear states (-1: none)
    state_len: int = -1  # tokens those states cover


@dataclasses.dataclass
class Admitted:
    """The request holds `slot` and its pages; tokens [start, end) still have to be prefilled
    after the page `copies` (copy-on-write, (src, dst) pairs) are done. Hybrid models: the
    linear states start from state row `state_src` (-1: zeros; a session row when continuing a
    session from token `start`)."""

    req: Request
    slot: int
    start: int
    end: int
    copies: list[tuple[int, int]]
    state_src: int = -1


@dataclasses.dataclass
class Deferred:
    """Not enough free pages now; the request stays first in the queue."""


@dataclasses.dataclass
class Rejected:
    """The request cannot run even alone; it is finished with this error."""

    error: str


AdmitResult = Admitted | Deferred | Rejected


@dataclasses.dataclass
class DecodePlan:
    """One decode chunk: page copies to run first (each inner list is one copy call, in order),
    then the host arrays of the decode call (S = max_slots rows)."""

    copies: list[list[tuple[int, int]]]
    steps: np.ndarray  # i32[S] decode steps of each slot (0: idle)
    longest: int  # longest sequence any slot reaches in this chunk
    lengths: np.ndarray  # i32[S]
    tok: np.ndarray  # i32[S] last token of each slot (the next decode input)
    delta: np.ndarray  # i32[S] M-RoPE delta
    gen: np.ndarray  # i32[S] tokens generated so far (sampling key index)
    stops: np.ndarray  # i32[S, MAX_STOP_IDS] stop ids, -1 padded
    params: list[Any]  # SamplingParams | None per slot


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if diff.size else n


def image_runs(ids: np.ndarray, image_token_id: int) -> list[tuple[int, int]]:
    """[start, end) of each run of image tokens in `ids`."""
    is_img = np.concatenate([[False], ids == image_token_id, [False]])
    edges = np.nonzero(np.diff(is_img.astype(np.int8)))[0]
    return [(int(s), int(e)) for s, e in zip(edges[::2], edges[1::2], strict=True)]


def image_digest(rows: np.ndarray, grid: np.ndarray | Sequence[int]) -> bytes:
    """BLAKE3 of one image's patch rows and its (t, h, w): what the prefix cache tells images
    apart by (a cryptographic hash: a page cannot make its screen pass for another's). Read in
    place, no copy of the rows; the rollout computes it once a screenshot (0.1 ms at 640x480,
    where sha1 took 0.45)."""
    h = blake3(np.ascontiguousarray(rows).reshape(-1).view(np.uint8).data)  # any dtype's bytes
    h.update(np.asarray(grid, np.int32).reshape(3).tobytes())
    return h.digest()


@dataclasses.dataclass
class PromptInputs:
    """What `Request` needs from a prompt, computed on the host once (`prompt_inputs`)."""

    prompt: np.ndarray  # i32[T0]
    pixel_values: np.ndarray | None
    grids: np.ndarray  # i32[n_images, 3]
    positions: np.ndarray  # i32[3, T0]
    rope_delta: int
    image_runs: list[tuple[int, int]]
    image_hashes: list[bytes]
    patch_offsets: np.ndarray  # i64[n_images + 1]
    prompt_key: bytes

    def fields(self) -> dict[str, Any]:
        """The fields as keyword arguments of `Request` (the arrays themselves, not copies)."""
        return dict(vars(self))


def prompt_inputs(
    prompt_ids: Sequence[int] | np.ndarray,
    pixel_values: np.ndarray | None,
    image_grid_thw: np.ndarray | None,
    *,
    image_token_id: int,
    merge_size: int,
    image_hashes: Sequence[bytes] | None = None,
) -> PromptInputs | str:
    """M-RoPE positions, image runs, per-image digests and the prompt's key; or what is wrong
    with the inputs, in one line. `image_hashes` (one `image_digest` per image, as the rollout
    keeps them) skips hashing the pixels again each turn; they are trusted, not re-checked."""
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    grids = np.zeros((0, 3), np.int32) if image_grid_thw is None else np.asarray(image_grid_thw)
    grids = grids.reshape(-1, 3).astype(np.int32)
    if pixel_values is None and len(grids):
        return "image_grid_thw given without pixel_values"
    try:
        pos, delta = get_rope_index(
            prompt[None],
            grids if len(grids) else None,
            image_token_id=image_token_id,
            spatial_merge_size=merge_size,
        )
    except ValueError as e:
        return str(e)
    sizes = np.prod(grids, axis=1).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    pix = None if pixel_values is None else np.asarray(pixel_values)
    if pix is not None and pix.shape[0] != offsets[-1]:
        return (
            f"pixel_values has {pix.shape[0]} patch rows but image_grid_thw needs "
            f"{offsets[-1]} (sum of t*h*w)"
        )
    if image_hashes is None:
        hashes = [
            image_digest(pix[offsets[i] : offsets[i + 1]], grids[i]) for i in range(len(grids))
        ]
    elif len(image_hashes) != len(grids):
        return f"{len(image_hashes)} image_hashes for {len(grids)} images"
    else:
        hashes = list(image_hashes)
    return PromptInputs(
        prompt=prompt,
        pixel_values=pix,
        grids=grids,
        positions=pos[:, 0],
        rope_delta=int(delta[0, 0]),
        image_runs=image_runs(prompt, image_token_id),
        image_hashes=hashes,
        patch_offsets=offsets,
        prompt_key=blake3(prompt.tobytes() + b"".join(hashes)).digest(),
    )


class Scheduler:
    """Slots, sessions, admission and preemption over a `PageAllocator` (see module docstring).

    Args:
      max_slots, page_size, num_pages, max_seq_len: as the Engine's.
      image_token_id: the model's image placeholder id (image runs are never split).
      share_prefix: fork the pages of a running request with an identical prompt.
      static_batching: admit only when the batch has drained.
      detokenize: ids -> text, for stop strings.
      route_shape: (sparse layers L, top-k K) of a MoE model whose decode steps return each
        fed token's experts (recorded per generated token); None for a dense model.
      session_states: hybrid models only (None otherwise): how many finished sessions keep
        their linear states (state rows max_slots .. max_slots + session_states - 1); a
        session whose state cannot be kept is not cached at all.
    """

    def __init__(
        self,
        *,
        max_slots: int,
        page_size: int,
        num_pages: int,
        max_seq_len: int,
        image_token_id: int,
        share_prefix: bool = True,
        static_batching: bool = False,
        detokenize: Callable[[Sequence[int]], str] | None = None,
        route_shape: tuple[int, int] | None = None,
        session_states: int | None = None,
    ):
        self.route_shape = route_shape
        self.hybrid = session_states is not None
        self.session_states = session_states or 0
        if self.hybrid:
            share_prefix = False  # see the module docstring
        self.max_slots, self.page_size, self.num_pages = max_slots, page_size, num_pages
        self.max_seq_len = max_seq_len
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
        self.image_token_id = image_token_id
        self.share_prefix, self.static_batching = share_prefix, static_batching
        self.detokenize = detokenize
        self.stats = dict.fromkeys(STAT_NAMES, 0)
        self.reset()

    def reset(self) -> list[Request]:
        """Empties the scheduler (slots, queue, sessions, pages); returns the requests it held
        (running first, then waiting) so the caller can finish them."""
        held = [*getattr(self, "running", {}).values(), *getattr(self, "waiting", [])]
        self.alloc = PageAllocator(
            self.num_pages, self.page_size, self.max_slots, self.pages_per_seq
        )
        self.waiting: list[Request] = []
        self.running: dict[int, Request] = {}  # slot -> request
        self.admit_order: list[int] = []  # slots, oldest first (preemption takes the last)
        self.next_tok = np.zeros(self.max_slots, np.int32)
        self.sessions: OrderedDict[Any, Session] = OrderedDict()
        # hybrid models: free session state rows, and (slot, row) copies the engine runs
        # before the slot's row is written again
        self.free_state_rows = list(
            range(self.max_slots + self.session_states - 1, self.max_slots - 1, -1)
        )
        self.pending_state_copies: list[tuple[int, int]] = []
        for req in held:
            req.slot = -1
        return held

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def cancel(self, rids: set[int], version: int) -> None:
        """Finishes the waiting or running requests in `rids` now, with finish_reason
        "cancelled" (their callers left: a served client that disconnected). A running one
        frees its slot as a finished one does (its K/V kept as its session's cache)."""
        for req in [r for r in self.waiting if r.rid in rids]:
            self.waiting.remove(req)
            self.finish(req, "cancelled", version)
        for req in [r for r in self.running.values() if r.rid in rids]:
            self.finish(req, "cancelled", version)

    def budget(self, req: Request) -> int:
        return min(
            req.params.max_new_tokens - len(req.generated),
            self.max_seq_len - len(req.prompt) - len(req.generated),
        )

    # ---------------------------------------------------------------------------- admission
    def free_slots(self) -> list[int]:
        return [s for s in range(self.max_slots) if s not in self.running]

    def admit(self, version: int) -> Iterator[list[Admitted]]:
        """Admits waiting requests into free slots; yields batches to prefill together.

        A request that would fork the pages of (or continue the session of) one admitted in
        this same round waits for that one's batch to be prefilled first (the generator resumes
        only after the caller has run it), so it never shares pages not yet written.
        """
        if self.static_batching and self.running:
            return
        pending: list[Admitted] = []
        while self.waiting:
            free = self.free_slots()
            if not free:
                break
            req = self.waiting[0]
            if any(self.depends_on(req, p.req) for p in pending):
                yield pending
                pending = []
            got = self.try_admit(req, free[0], version)
            if isinstance(got, Deferred):
                break
            self.waiting.pop(0)
            if isinstance(got, Rejected):
                self.finish(req, "error", version, error=got.error)
            else:
                pending.append(got)
        if pending:
            yield pending

    def depends_on(self, req: Request, other: Request) -> bool:
        same_prompt = self.share_prefix and req.prompt_key == other.prompt_key
        same_session = req.session_id is not None and req.session_id == other.session_id
        return same_prompt or same_session

    @property
    def num_state_rows(self) -> int:
        """Rows of the hybrid cache's linear states: the slots', then the sessions'."""
        return self.max_slots + self.session_states if self.hybrid else 0

    def evict_session(self) -> bool:
        if not self.sessions:
            return False
        _, sess = self.sessions.popitem(last=False)
        self._free_session(sess)
        return True

    def _free_session(self, sess: Session) -> None:
        self.alloc.decref(sess.pages)
        if sess.state_row >= 0:
            self.free_state_rows.append(sess.state_row)
            sess.state_row = -1

    def reuse_len(self, req: Request, tokens, runs, hashes, avail: int, target) -> int:
        """Tokens of `target` whose cached K/V (from a sequence `tokens`) can be reused."""
        n = min(common_prefix(tokens[:avail], target), len(target) - 1)
        for (s, e), h_old, (s2, e2), h_new in zip(
            runs, hashes, req.image_runs, req.image_hashes, strict=False
        ):
            if s >= n:
                break
            if (s, e) != (s2, e2) or h_old != h_new or e > n:
                n = min(n, s, s2)  # never split or reuse a different image
                break
        return max(n, 0)

    def try_admit(self, req: Request, slot: int, version: int) -> AdmitResult:
        """Takes `slot` and the pages for `req`. On Admitted the slot counts as running."""
        seq = req.seq
        # Prefill everything but the last token when resuming (it is fed by the next decode).
        target = seq[:-1] if req.generated else seq
        start = 0
        state_src = -1
        sess = self.sessions.get(req.session_id) if req.session_id is not None else None
        if sess is not None:
            start = self.reuse_len(
                req, sess.tokens, sess.image_runs, sess.image_hashes, sess.kv_len, target
            )
            del self.sessions[req.session_id]
            if self.hybrid:
                # the linear states cover exactly state_len tokens: continue from there or
                # recompute everything; the row is freed once the prefill has read it
                if start != sess.state_len or sess.state_row < 0:
                    start = 0
                state_src = sess.state_row if start > 0 else -1
                if state_src < 0 and sess.state_row >= 0:
                    self.free_state_rows.append(sess.state_row)
            keep = self.alloc.pages_for(start)
            self.alloc.decref(sess.pages[keep:])
            self.alloc.attach(slot, sess.pages[:keep], start)
        else:
            donor = None
            if self.share_prefix and not req.generated:
                donor = next(
                    (s for s, o in self.running.items() if o.prompt_key == req.prompt_key), None
                )
            if donor is not None:
                n = min(len(req.prompt) - 1, int(self.alloc.lengths[donor]))
                start = self.reuse_len(req, req.prompt, req.image_runs, req.image_hashes, n, target)
                self.alloc.fork(donor, slot, start)
            else:
                self.alloc.attach(slot, [], 0)
        while True:
            try:
                copies = self.alloc.prepare_write(slot, start, len(target))
                break
            except OutOfPagesError:
                if self.evict_session():
                    continue
                self.alloc.release(slot)
                if state_src >= 0:  # back to the start: the state row stays unread
                    self.free_state_rows.append(state_src)
                if not self.running:
                    return Rejected(
                        f"request needs {self.alloc.pages_for(len(target))} KV pages but the "
                        f"pool has {self.num_pages - 1}: build the Engine with more num_pages"
                    )
                return Deferred()  # running requests will free pages
        if req.cached_tokens < 0:
            req.cached_tokens = start
            self.stats["cached_tokens"] += start
        if req.version < 0:
            req.version = version
        self.running[slot] = req
        self.admit_order.append(slot)
        req.slot = slot
        return Admitted(req, slot, start, len(target), copies, state_src)

    def prefilled(self, batch: list[Admitted]) -> list[Admitted]:
        """Marks a batch's tokens as cached; returns the fresh requests (their first token is to
        be sampled from the prefill logits). A resumed request's last token feeds the decode."""
        fresh = []
        for a in batch:
            self.alloc.set_length(a.slot, a.end)
            if a.state_src >= 0:  # read by the prefill: the session row is free again
                self.free_state_rows.append(a.state_src)
                a.state_src = -1
            if a.req.generated:
                self.next_tok[a.slot] = a.req.generated[-1]
            else:
                fresh.append(a)
        return fresh

    # ----------------------------------------------------------------------------- decode
    def preempt_one(self, needed_by: int) -> bool:
        """Frees the most recently admitted running request other than `needed_by`."""
        for slot in reversed(self.admit_order):
            if slot != needed_by:
                req = self.running.pop(slot)
                self.admit_order.remove(slot)
                self.alloc.release(slot)
                req.slot = -1
                req.preemptions += 1
                self.stats["preemptions"] += 1
                self.waiting.insert(0, req)
                return True
        return False

    def plan_decode(self, chunk: int, version: int) -> DecodePlan:
        """Makes room for up to `chunk` tokens of every running slot (evicting sessions, then
        preempting the newest requests); a request that cannot fit even alone is finished with
        an error. Nothing is left to decode if `running` is empty afterwards."""
        S = self.max_slots
        steps = np.zeros(S, np.int32)
        copies: list[list[tuple[int, int]]] = []
        for slot in list(self.admit_order):
            if slot not in self.running:
                continue  # preempted while making room for an earlier slot
            req = self.running[slot]
            n = min(chunk, self.budget(req))
            L0 = int(self.alloc.lengths[slot])
            while True:
                try:
                    copies.append(self.alloc.prepare_write(slot, L0, L0 + n))
                    break
                except OutOfPagesError:
                    if self.evict_session() or self.preempt_one(slot):
                        continue
                    self.running.pop(slot)
                    self.admit_order.remove(slot)
                    self.alloc.release(slot)
                    self.finish(req, "error", version, "KV page pool too small for one sequence")
                    break
            if slot in self.running:
                steps[slot] = n
        copies = [c for c in copies if c]
        longest = max((int(self.alloc.lengths[s]) + int(steps[s]) for s in self.running), default=0)
        delta = np.zeros(S, np.int32)
        gen = np.zeros(S, np.int32)
        stops = np.full((S, MAX_STOP_IDS), -1, np.int32)
        params: list[Any] = [None] * S
        for slot, req in self.running.items():
            delta[slot] = req.rope_delta
            gen[slot] = len(req.generated)
            ids = req.params.stop_token_ids[:MAX_STOP_IDS]
            stops[slot, : len(ids)] = ids
            params[slot] = req.params
        return DecodePlan(
            copies,
            steps,
            longest,
            self.alloc.lengths.copy(),
            self.next_tok.copy(),
            delta,
            gen,
            stops,
            params,
        )

    def apply_decode(
        self, out_tok: np.ndarray, out_lp, out_mlp, version: int, out_routes=None
    ) -> None:
        """Takes a decode chunk's output (i32[S, C], -1 after each slot's last token).

        `out_routes` (MoE): i32[S, C, L, K], the experts of the token fed at step i: the slot's
        last generated token before the chunk, then the chunk's own tokens but its last."""
        for slot, req in list(self.running.items()):
            k = int(np.sum(out_tok[slot] >= 0))
            self.alloc.set_length(slot, int(self.alloc.lengths[slot]) + k)
            self.next_tok[slot] = out_tok[slot, k - 1] if k else self.next_tok[slot]
            req.version = min(req.version, version)
            fed = None if out_routes is None else np.asarray(out_routes[slot, :k], np.int32)
            self.append(
                req, out_tok[slot, :k].tolist(), out_lp[slot, :k], out_mlp[slot, :k], version, fed
            )

    # ----------------------------------------------------------------------------- finish
    def append(
        self, req: Request, toks: list[int], lps, mlps, version: int, fed_routes=None
    ) -> None:
        """Adds tokens to a running request and finishes it if a stop condition is met.

        `fed_routes` (MoE decode): i32[len(toks), L, K], row j the experts of the token fed at
        step j (row 0: the request's last token so far; row j: toks[j - 1])."""
        p = req.params
        if fed_routes is not None and len(fed_routes) and req.routes:
            req.routes[-1] = fed_routes[0]
        for j, t in enumerate(toks):
            req.generated.append(int(t))
            req.logprobs.append(float(lps[j]))
            req.model_logprobs.append(float(mlps[j]))
            if self.route_shape is not None:
                if fed_routes is not None and j + 1 < len(fed_routes):
                    req.routes.append(fed_routes[j + 1])
                else:
                    req.routes.append(np.full(self.route_shape, -1, np.int32))
            self.stats["useful_tokens"] += 1
            if t in p.stop_token_ids:
                return self.finish(req, "stop", version)
            if p.stop_strings:
                text = self.detokenize(req.generated)
                if any(s in text for s in p.stop_strings):
                    return self.finish(req, "stop", version)
            if self.budget(req) <= 0:
                return self.finish(req, "length", version)

    def finish(self, req: Request, reason: str, version: int, error: str | None = None) -> None:
        """Frees the request's slot (keeping its K/V as its session's cache) and reports it."""
        slot = req.slot
        if slot >= 0 and self.running.get(slot) is req:
            del self.running[slot]
            self.admit_order.remove(slot)
            if req.session_id is not None:
                old = self.sessions.pop(req.session_id, None)
                if old is not None:
                    self._free_session(old)
                row = self._session_state_row() if self.hybrid else -1
                if self.hybrid and row < 0:  # no state kept: the pages are no use alone
                    self.alloc.release(slot)
                else:
                    pages, kv_len = self.alloc.detach(slot)
                    seq = req.seq
                    runs = image_runs(seq, self.image_token_id)
                    sess = Session(seq, min(kv_len, len(seq)), pages, runs, req.image_hashes)
                    if row >= 0:
                        sess.state_row, sess.state_len = row, kv_len
                        self.pending_state_copies.append((slot, row))
                    self.sessions[req.session_id] = sess
            else:
                self.alloc.release(slot)
        req.slot = -1
        req.on_done(
            GenerateOutput(
                tokens=list(req.generated),
                logprobs=np.asarray(req.logprobs, np.float32),
                model_logprobs=np.asarray(req.model_logprobs, np.float32),
                finish_reason=reason,
                version=max(req.version, 0) if req.version >= 0 else version,
                num_prompt_tokens=len(req.prompt),
                num_cached_tokens=max(req.cached_tokens, 0),
                num_preemptions=req.preemptions,
                error=error,
                routes=self._routes_of(req),
            )
        )

    def _routes_of(self, req: Request) -> np.ndarray | None:
        if self.route_shape is None:
            return None
        out = np.full((len(req.generated), *self.route_shape), -1, np.int32)
        if req.routes:
            out[: len(req.routes)] = np.stack(req.routes)
        return out

    def _session_state_row(self) -> int:
        """A free session state row, evicting the least recently used sessions for one
        (-1 when none can be had: no session rows)."""
        while not self.free_state_rows and self.evict_session():
            pass
        return self.free_state_rows.pop() if self.free_state_rows else -1

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The (slot row, session row) copies to run now (then forgotten)."""
        out, self.pending_state_copies = self.pending_state_copies, []
        return out

    def drop_session(self, session_id: Any) -> None:
        sess = self.sessions.pop(session_id, None)
        if sess is not None:
            self._free_session(sess)

    def check_pages(self) -> None:
        """Raises AssertionError unless refcounts equal the owners (slots + session caches),
        and (hybrid models) each session state row has one owner or is free."""
        counts = self.alloc.owned_counts([s.pages for s in self.sessions.values()])
        if not np.array_equal(counts, self.alloc.refcount):
            raise AssertionError("page refcounts disagree with the owners")
        if TRASH_PAGE in [p for s in self.sessions.values() for p in s.pages]:
            raise AssertionError("a session cache holds the scratch page")
        if self.hybrid:  # every session state row is free or held by exactly one session
            held = [s.state_row for s in self.sessions.values() if s.state_row >= 0]
            rows = sorted(held + self.free_state_rows)
            if rows != list(range(self.max_slots, self.num_state_rows)):
                raise AssertionError(
                    f"linear-state rows disagree with their owners: sessions hold {held}, "
                    f"free {self.free_state_rows}"
                )
