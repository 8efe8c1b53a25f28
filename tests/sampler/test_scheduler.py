"""The sampler's host scheduler alone (no model, no device): admission results, prefix forks,
session reuse, preemption and finishing, checked against hand-computed page bookkeeping."""

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from cua_jax.sampler.scheduler import (
    Admitted,
    Deferred,
    Rejected,
    Request,
    Scheduler,
    image_digest,
    image_runs,
    prompt_inputs,
)

IMG = 99


def _params(max_new_tokens=8, stop=()):
    # Duck-typed SamplingParams: the scheduler reads only these fields.
    return SimpleNamespace(max_new_tokens=max_new_tokens, stop_token_ids=stop, stop_strings=())


def _req(prompt, *, session=None, params=None, hashes=None, done=None):
    prompt = np.asarray(prompt, np.int32)
    runs = image_runs(prompt, IMG)
    hashes = hashes if hashes is not None else [b"img%d" % i for i in range(len(runs))]
    return Request(
        rid=0,
        prompt=prompt,
        pixel_values=None,
        grids=np.zeros((len(runs), 3), np.int32),
        params=params or _params(),
        session_id=session,
        on_done=(done.append if done is not None else lambda o: None),
        positions=np.zeros((3, len(prompt)), np.int32),
        rope_delta=0,
        image_runs=runs,
        image_hashes=hashes,
        patch_offsets=np.zeros(len(runs) + 1, np.int64),
        prompt_key=prompt.tobytes() + b"".join(hashes),
    )


def _sched(**kw):
    args = dict(max_slots=4, page_size=4, num_pages=17, max_seq_len=64, image_token_id=IMG)
    return Scheduler(**{**args, **kw})


def _admit_all(s, version=0):
    batches = []
    for batch in s.admit(version):
        batches.append(batch)
        s.prefilled(batch)  # what the Engine does after prefilling a batch
    return batches


def test_module_imports_without_jax():
    code = (
        "import sys, cua_jax.sampler.scheduler, cua_jax.sampler.page_table; "
        "bad = [m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'flax'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prompt_inputs_hash_each_image_once_or_take_the_callers():
    from blake3 import blake3

    from cua_jax.data.positions import get_rope_index

    rng = np.random.default_rng(0)
    grids = np.array([[1, 4, 4], [1, 2, 4]], np.int32)  # 4 and 2 merged tokens (merge 2)
    pv = rng.integers(0, 255, (16 + 8, 12), dtype=np.uint8)
    prompt = np.array([5, 6, IMG, IMG, IMG, IMG, 7, IMG, IMG, 8], np.int32)
    got = prompt_inputs(prompt, pv, grids, image_token_id=IMG, merge_size=2)
    # By hand: the hash of the rows' bytes, then the grid's.
    want = [blake3(pv[:16].tobytes() + grids[0].tobytes()).digest()]
    want.append(blake3(pv[16:].tobytes() + grids[1].tobytes()).digest())
    assert (
        got.image_hashes
        == want
        == [image_digest(pv[:16], grids[0]), image_digest(pv[16:], grids[1])]
    )
    f32 = pv[:16].astype(np.float32)  # f32 screens' rows are hashed by their bytes too
    assert image_digest(f32, grids[0]) == blake3(f32.tobytes() + grids[0].tobytes()).digest()
    assert got.image_runs == [(2, 6), (7, 9)] and list(got.patch_offsets) == [0, 16, 24]
    pos, delta = get_rope_index(prompt[None], grids, image_token_id=IMG, spatial_merge_size=2)
    assert np.array_equal(got.positions, pos[:, 0]) and got.rope_delta == int(delta[0, 0])
    # The caller's digests are taken as they are (the rollout keeps them a screenshot).
    given = prompt_inputs(prompt, pv, grids, image_token_id=IMG, merge_size=2, image_hashes=want)
    assert given.prompt_key == got.prompt_key
    other = prompt_inputs(
        prompt, pv, grids, image_token_id=IMG, merge_size=2, image_hashes=[b"a", b"b"]
    )
    assert other.prompt_key != got.prompt_key
    # Bad inputs are one line each, not an exception.
    assert prompt_inputs(
        prompt, pv, grids, image_token_id=IMG, merge_size=2, image_hashes=want[:1]
    ) == ("1 image_hashes for 2 images")
    assert "patch rows" in prompt_inputs(prompt, pv[:20], grids, image_token_id=IMG, merge_size=2)
    assert "without pixel_values" in prompt_inputs(
        prompt, None, grids, image_token_id=IMG, merge_size=2
    )


def test_pool_must_hold_one_max_length_sequence():
    with pytest.raises(ValueError, match=r"needs 16 KV pages.*num_pages >= 17"):
        _sched(num_pages=16)


def test_group_prompt_is_forked_after_its_first_prefill():
    s = _sched()
    prompt = list(range(10))  # 2.5 pages of 4
    a, b = _req(prompt), _req(prompt)
    s.waiting += [a, b]
    batches = _admit_all(s)
    # b depends on a (same prompt): a is prefilled alone first, then b forks its pages.
    assert [[x.req for x in batch] for batch in batches] == [[a], [b]]
    first, second = batches[0][0], batches[1][0]
    assert (first.start, first.end, first.copies) == (0, 10, [])
    # b reuses 9 tokens (the last prompt token is recomputed for its logits): pages 0-2 shared,
    # page 2 (tokens 8, 9) is written by b, so it is copied first (copy-on-write).
    assert (second.start, second.end) == (9, 10)
    pa, pb = s.alloc.slot_pages[first.slot], s.alloc.slot_pages[second.slot]
    assert pa[:2] == pb[:2] and pa[2] != pb[2]
    assert second.copies == [(pa[2], pb[2])]
    assert all(s.alloc.refcount[p] == 2 for p in pa[:2])
    assert a.cached_tokens == 0 and b.cached_tokens == 9 and s.stats["cached_tokens"] == 9
    s.check_pages()


def test_session_reuse_stops_at_a_changed_screenshot():
    s = _sched()
    done = []
    prompt = [1, 2, IMG, IMG, 3, 4]
    r1 = _req(prompt, session="ep", params=_params(max_new_tokens=2), done=done)
    s.waiting.append(r1)
    _admit_all(s)
    s.append(r1, [7], [0.0], [0.0], version=0)  # the first token, sampled after prefill
    s.alloc.set_length(r1.slot, 7)  # the decode step that fed token 7 wrote its K/V
    s.append(r1, [8], [0.0], [0.0], version=0)
    assert done[0].finish_reason == "length" and done[0].tokens == [7, 8]
    assert s.sessions["ep"].kv_len == 7 and not s.running
    # Next turn appends text: everything cached is reused.
    r2 = _req([*prompt, 7, 8, 5], session="ep")
    got = s.try_admit(r2, 0, version=1)
    assert isinstance(got, Admitted) and (got.start, got.end) == (7, 9)
    s.finish(r2, "stop", 1)
    # A turn whose screenshot has other pixels: reuse stops before its image run.
    r3 = _req([*prompt, 7, 8, 5], session="ep", hashes=[b"other"])
    got = s.try_admit(r3, 0, version=1)
    assert isinstance(got, Admitted) and got.start == 2
    s.finish(r3, "stop", 1)
    s.drop_session("ep")
    s.check_pages()
    assert s.alloc.num_free == s.num_pages - 1


def test_deferred_while_others_run_rejected_when_alone():
    s = _sched(num_pages=17, max_seq_len=64)
    running = _req(list(range(40)))  # 10 pages of the 16
    s.waiting.append(running)
    _admit_all(s)
    big = _req(list(range(100, 130)))  # 8 pages: do not fit next to it
    assert isinstance(s.try_admit(big, 1, version=0), Deferred)
    assert s.alloc.slot_pages[1] == [] and 1 not in s.running
    s.check_pages()
    # With nothing running (and no session to evict) a request the free pages cannot hold is
    # rejected, and admission finishes it with that error. Two pages are held outside the
    # scheduler here, so 12 tokens (3 pages) cannot fit in the 4-page pool.
    lone, done = _sched(max_seq_len=16, num_pages=5), []
    lone.alloc.alloc(2)
    res = lone.try_admit(_req(list(range(12))), 0, version=0)
    assert isinstance(res, Rejected) and "needs 3 KV pages but the pool has 4" in res.error
    assert lone.alloc.slot_pages[0] == [] and not lone.running
    lone.waiting.append(_req(list(range(12)), done=done))
    assert _admit_all(lone) == [] and not lone.waiting
    assert done[0].finish_reason == "error" and "more num_pages" in done[0].error


def test_decode_plan_preempts_the_newest_and_requeues_it():
    s = _sched(max_slots=2, num_pages=9, max_seq_len=32)  # 8 usable pages
    a, b = _req(list(range(14))), _req(list(range(20, 34)))  # 4 pages each
    s.waiting += [a, b]
    _admit_all(s)
    assert s.admit_order == [a.slot, b.slot] and s.alloc.num_free == 0
    plan = s.plan_decode(chunk=4, version=0)
    # a needs a 5th page: b (admitted last) is preempted and goes back to the front of the queue.
    assert s.stats["preemptions"] == 1 and b.preemptions == 1 and s.waiting == [b]
    assert list(s.running.values()) == [a] and plan.steps[a.slot] == 4
    assert plan.longest == 18 and plan.lengths[a.slot] == 14
    # The chunk's output: 2 tokens then a stop token.
    out = np.full((2, 4), -1, np.int32)
    out[a.slot, :3] = [5, 6, 3]
    a.params = _params(stop=(3,))
    done = []
    a.on_done = done.append
    s.apply_decode(out, np.zeros((2, 4)), np.zeros((2, 4)), version=2)
    assert done[0].tokens == [5, 6, 3] and done[0].finish_reason == "stop"
    assert done[0].version == 0  # the oldest weights that produced a token
    s.check_pages()
    # The preempted request is recomputed: prompt and generated tokens but the last.
    b.generated = [41, 42]
    (batch,) = _admit_all(s)
    assert (batch[0].start, batch[0].end) == (0, 15) and s.next_tok[b.slot] == 42


def test_hybrid_sessions_continue_only_from_their_state():
    """Hybrid models (session_states set): a finished session's slot state is queued for copy
    into a session row, with the tokens it covers; a next turn that extends exactly those tokens
    starts there from that row (freed once prefilled), any other prefix from token 0; with one
    session row the least recently used session is evicted for a new one; running requests'
    pages are never forked (the donor's state covers its own tokens)."""
    s = _sched(session_states=1)
    assert s.num_state_rows == 5 and not s.share_prefix
    done = []
    prompt = [1, 2, IMG, IMG, 3, 4]
    r1 = _req(prompt, session="ep", params=_params(max_new_tokens=2), done=done)
    s.waiting.append(r1)
    _admit_all(s)
    s.append(r1, [7], [0.0], [0.0], version=0)
    s.alloc.set_length(r1.slot, 7)  # the decode step that fed token 7
    s.append(r1, [8], [0.0], [0.0], version=0)
    sess = s.sessions["ep"]
    assert (sess.state_row, sess.state_len) == (4, 7)
    assert s.take_state_copies() == [(0, 4)] and s.take_state_copies() == []  # slot 0's
    s.check_pages()
    # the transcript extended: continue from the 7 tokens the state covers, reading row 4
    r2 = _req([*prompt, 7, 8, 5], session="ep", params=_params(max_new_tokens=1))
    s.waiting.append(r2)
    (batch,) = list(s.admit(version=1))
    assert (batch[0].start, batch[0].end, batch[0].state_src) == (7, 9, 4)
    assert s.free_state_rows == []  # still to be read by the prefill
    s.prefilled(batch)
    assert s.free_state_rows == [4] and batch[0].state_src == -1
    s.append(r2, [9], [0.0], [0.0], version=1)  # finished: a new session state (row 4)
    assert s.sessions["ep"].state_len == 9 and s.take_state_copies() == [(0, 4)]
    # history rewritten at token 0: no stored state there, prefill everything
    r3 = _req([5, *prompt[1:], 7, 8, 5, 9, 6], session="ep", params=_params(max_new_tokens=1))
    got = s.try_admit(r3, 0, version=2)
    assert isinstance(got, Admitted) and (got.start, got.state_src) == (0, -1)
    assert s.free_state_rows == [4]
    s.append(r3, [1], [0.0], [0.0], version=2)
    # a second session takes the only row: the first ("ep") is evicted, pages and all
    r4 = _req([3, 3, 3], session="other", params=_params(max_new_tokens=1))
    s.waiting.append(r4)
    _admit_all(s)
    s.append(r4, [1], [0.0], [0.0], version=2)
    assert list(s.sessions) == ["other"] and s.sessions["other"].state_row == 4
    s.check_pages()
    # the same prompt twice while the first runs: no fork, both prefilled from 0
    a, b = _req([4, 4, 4, 4, 4]), _req([4, 4, 4, 4, 4])
    s.waiting += [a, b]
    starts = [x.start for batch in _admit_all(s) for x in batch]
    assert starts == [0, 0]
