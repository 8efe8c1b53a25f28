"""Randomized multi-turn workload through one tight engine == each turn run alone.

Episodes of GRPO groups (shared first prompt, own seeds) take 1-4 turns; a turn appends text and
maybe a screenshot to the transcript, or drops the oldest screenshot (a history window, so the
session's K/V is only partly reusable); greedy and sampled turns, stop tokens; a page pool small
enough to preempt; weight updates (same values, new versions) mid-run. Every turn's tokens,
log-probs and finish reason must equal the same request run alone, with no session, on a roomy
engine. This found that a pool smaller than one max_seq_len sequence failed requests half-way
through their output (now refused at Engine construction).
"""

import asyncio

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from cua_jax.sampler import Engine, SamplingParams  # noqa: E402
from tests.models.hf_tiny import VOCAB, image_inputs, prompt_ids  # noqa: E402

FAM = "qwen2_5_vl"


@pytest.fixture(scope="module")
def model(hf_model_qwen25):
    return hf_model_qwen25


@pytest.fixture(scope="module")
def images():
    return [image_inputs(FAM, [s], seed=i) for i, s in enumerate([(56, 56), (56, 84), (84, 56)])]


def _segment(rng, images, with_image: bool):
    if with_image:
        pv, grid = images[int(rng.integers(len(images)))]
        lens = [int(rng.integers(1, 6)), int(rng.integers(1, 6))]
        return prompt_ids(grid, lens, seed=int(rng.integers(1 << 30))).tolist(), [(pv, grid)]
    return rng.integers(0, VOCAB - 8, int(rng.integers(1, 8))).tolist(), []


def _params(rng) -> SamplingParams:
    new = int(rng.integers(1, 12))
    stop = (int(rng.integers(0, VOCAB - 8)),) if rng.random() < 0.3 else ()
    if rng.random() < 0.5:
        return SamplingParams(temperature=0.0, max_new_tokens=new, stop_token_ids=stop)
    return SamplingParams(
        temperature=float(rng.uniform(0.5, 1.5)),
        top_k=int(rng.choice([0, 20])),
        top_p=float(rng.choice([1.0, 0.9])),
        seed=int(rng.integers(1 << 20)),
        max_new_tokens=new,
        stop_token_ids=stop,
    )


def _pack(imgs):
    if not imgs:
        return None, None
    return np.concatenate([p for p, _ in imgs]), np.concatenate([g for _, g in imgs])


async def _episode(engine, rng, name, first, images, image_token, log):
    ids, imgs = list(first[0]), list(first[1])
    for turn in range(int(rng.integers(1, 5))):
        if turn:
            if imgs and rng.random() < 0.25:  # the history window drops the oldest screenshot
                s = ids.index(image_token)
                e = s
                while ids[e] == image_token:
                    e += 1
                ids = ids[: s - 1] + ids[e + 1 :]  # with its vision start / end tokens
                imgs = imgs[1:]
            seg, im = _segment(rng, images, rng.random() < 0.5)
            ids, imgs = ids + seg, imgs + im
        pv, grid = _pack(imgs)
        p = _params(rng) if turn else first[2]
        out = await engine.generate(ids, pv, grid, params=p, session_id=name)
        assert out.finish_reason != "error", out.error
        log.append((list(ids), pv, grid, p, out))
        ids += list(out.tokens)
        if len(ids) + 24 > engine.max_seq_len:
            break


async def _workload(engine, model, images, seed):
    rng = np.random.default_rng(seed)
    log, episodes = [], []
    for g in range(int(rng.integers(3, 6))):
        first = _segment(rng, images, rng.random() < 0.7)
        for k in range(int(rng.integers(1, 5))):
            p = SamplingParams(
                temperature=1.0, seed=100 * g + k, max_new_tokens=int(rng.integers(1, 10))
            )
            sub = np.random.default_rng(rng.integers(1 << 30))
            episodes.append(
                _episode(
                    engine, sub, f"{g}/{k}", (*first, p), images, model.config.image_token_id, log
                )
            )

    async def updates():
        for v in (1, 2, 3):
            await asyncio.sleep(0.02 * v)
            engine.update_params(model, v)

    await asyncio.gather(*episodes, updates())
    return log


@pytest.mark.parametrize(
    "seed,slots,page_size,num_pages,chunk",
    [(6, 6, 4, 19, 4), (20, 4, 2, 18, 5)],  # both preempt (10 and 9 times when written)
)
def test_random_multiturn_workload_equals_each_turn_alone(
    model, images, seed, slots, page_size, num_pages, chunk
):
    engine = Engine(
        model,
        max_slots=slots,
        page_size=page_size,
        num_pages=num_pages,
        max_seq_len=page_size * (num_pages - 1),
        decode_chunk=chunk,
    )
    log = asyncio.run(_workload(engine, model, images, seed))
    engine.check_pages()
    assert engine.stats["preemptions"] > 0 and engine.stats["cached_tokens"] > 0
    assert engine.version == 3
    ref = Engine(
        model,
        max_slots=1,
        page_size=8,
        num_pages=64,
        max_seq_len=256,
        decode_chunk=4,
        share_prefix=False,
    )
    for ids, pv, grid, p, out in log:
        (want,) = ref.generate_batch(
            [dict(prompt_ids=ids, pixel_values=pv, image_grid_thw=grid, params=p)]
        )
        assert (out.tokens, out.finish_reason) == (want.tokens, want.finish_reason)
        np.testing.assert_allclose(out.logprobs, want.logprobs, atol=1e-5)
        np.testing.assert_allclose(out.model_logprobs, want.model_logprobs, atol=1e-5)
