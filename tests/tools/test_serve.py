"""tools/serve.py: the OpenAI-compatible server against the Engine it wraps.

A tiny random Qwen3-VL behind the server answers greedy requests with exactly the tokens
`Engine.generate_batch` gives for the trainer's rendering of the same conversation (one turn, and
a second turn that quotes the first reply), concurrent requests with images give the same outputs
as sequential ones, and malformed or foreign requests get OpenAI-style errors.
"""

import asyncio
import json

import httpx
import numpy as np
import pytest

from cua_jax.data.processor import QwenVLProcessor
from cua_jax.evaluation.openai_chat import encode_image
from cua_jax.models import qwen_vl
from cua_jax.rl.rollout import _TurnRecord, render_transcript
from cua_jax.sampler import Engine, SamplingParams
from tools.serve import create_app, resolve_token

TOKEN = "secret-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SYSTEM = "You click things."


@pytest.fixture(scope="module")
def proc():
    return QwenVLProcessor.default("qwen3_vl", max_pixels=64 * 64, min_pixels=32 * 32)


@pytest.fixture(scope="module")
def model(proc):
    tok = proc.tokenizer
    cfg = qwen_vl.tiny("qwen3_vl", vocab_size=tok.vocab_size, **tok.vision_token_ids())
    return qwen_vl.init_random(cfg, seed=0)


@pytest.fixture(scope="module")
def engine(model, proc):
    return Engine(
        model,
        max_slots=8,
        page_size=16,
        num_pages=512,
        max_seq_len=1024,  # the same engine shapes as tests/tools/test_agents.py (one compile)
        decode_chunk=8,
        detokenize=proc.tokenizer.decode,
    )


@pytest.fixture(scope="module")
def app(engine, proc, model):
    return create_app(
        engine,
        proc,
        token=TOKEN,
        model_name="tiny",
        max_tokens=8,
        banned_token_ids=model.config.vision_placeholder_ids,
    )


def _screen(i):
    rng = np.random.default_rng(i)
    return rng.integers(0, 255, (48 + 16 * (i % 2), 64, 3), dtype=np.uint8)


def _params(proc, model, n=8):
    return SamplingParams(
        temperature=0.0,
        max_new_tokens=n,
        stop_token_ids=proc.tokenizer.stop_ids,
        banned_token_ids=model.config.vision_placeholder_ids,
    )


def _first_turn(img, text="click the red square"):
    return [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": encode_image(img)}},
                {"type": "text", "text": text},
            ],
        },
    ]


def _reference(engine, proc, model, records):
    """The trainer's prompt for these turns and the engine's greedy tokens for it."""
    rendered, pv, grid = render_transcript(proc.chat, "click the red square", SYSTEM, records, 2)
    (out,) = engine.generate_batch(
        [
            {
                "prompt_ids": rendered.input_ids,
                "pixel_values": pv,
                "image_grid_thw": grid,
                "params": _params(proc, model),
            }
        ]
    )
    return rendered.input_ids, [int(t) for t in out.tokens]


def _record(proc, img, feedback=""):
    v = proc.preprocess_images([img])
    return _TurnRecord(feedback, v["pixel_values"], v["image_grid_thw"])


def _client(app):
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000", timeout=300
    )


async def _post(client, body, headers=AUTH, **kw):
    return await client.post("/v1/chat/completions", json=body, headers=headers, **kw)


def test_greedy_turns_equal_the_engine_on_the_trainers_rendering(app, engine, proc, model):
    img0, img1, img2 = _screen(0), _screen(1), _screen(2)

    async def run():
        async with _client(app) as c:
            msgs = _first_turn(img0)
            r1 = await _post(c, {"messages": msgs, "temperature": 0, "max_tokens": 8})
            assert r1.status_code == 200, r1.text
            msgs2 = [
                *msgs,
                {"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Here is the screen after your action."},
                        {"type": "image_url", "image_url": {"url": encode_image(img1)}},
                    ],
                },
            ]
            r2 = await _post(c, {"messages": msgs2, "temperature": 0, "max_tokens": 8})
            a2 = r2.json()["choices"][0]["message"]["content"]
            # Third turn: the history window (2 images) drops the first screenshot.
            msgs3 = [
                msgs2[0],
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "(an earlier screenshot, omitted)"},
                        {"type": "text", "text": "click the red square"},
                    ],
                },
                *msgs2[2:],
                {"role": "assistant", "content": a2},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Your last action was invalid."},
                        {"type": "image_url", "image_url": {"url": encode_image(img2)}},
                    ],
                },
            ]
            r3 = await _post(c, {"messages": msgs3, "temperature": 0, "max_tokens": 8})
            return r1.json(), r2.json(), r3.json()

    j1, j2, j3 = asyncio.run(run())
    recs = [_record(proc, img0)]
    ids1, want1 = _reference(engine, proc, model, recs)
    assert j1["choices"][0]["token_ids"] == want1
    assert j1["usage"]["prompt_tokens"] == len(ids1)
    assert j1["policy_version"] == 0 and j1["system_fingerprint"] == "cua_jax-v0"
    recs[0].generated = want1
    recs.append(_record(proc, img1, "Here is the screen after your action."))
    ids2, want2 = _reference(engine, proc, model, recs)
    assert j2["usage"]["prompt_tokens"] == len(ids2)
    assert j2["choices"][0]["token_ids"] == want2
    # the second turn extends the first: its K/V came from the session cache
    assert j2["usage"]["prompt_tokens_details"]["cached_tokens"] > len(ids1) // 2
    recs[1].generated = want2
    recs.append(_record(proc, img2, "Your last action was invalid."))
    ids3, want3 = _reference(engine, proc, model, recs)
    assert j3["usage"]["prompt_tokens"] == len(ids3)
    assert j3["choices"][0]["token_ids"] == want3


def test_concurrent_requests_with_images_equal_sequential_ones(app):
    bodies = [
        {
            "messages": _first_turn(_screen(10 + i), f"task {i}"),
            "temperature": 0 if i % 2 else 0.8,
            "seed": i,
            "max_tokens": 6,
            "logprobs": True,
        }
        for i in range(24)
    ]

    async def run(concurrent):
        async with _client(app) as c:
            if concurrent:
                rs = await asyncio.gather(*(_post(c, b) for b in bodies))
            else:
                rs = [await _post(c, b) for b in bodies]
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
        return [r.json()["choices"][0] for r in rs]

    seq = asyncio.run(run(False))
    conc = asyncio.run(run(True))
    assert [c["token_ids"] for c in conc] == [c["token_ids"] for c in seq]
    assert [c["message"]["content"] for c in conc] == [c["message"]["content"] for c in seq]
    for c in conc:
        assert len(c["logprobs"]["content"]) == len(c["token_ids"])
        assert all(
            np.isfinite(e["logprob"]) and e["logprob"] <= 0 for e in c["logprobs"]["content"]
        )


def _err(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    if code is not None:
        assert e["code"] == code, e
    if param is not None:
        assert e["param"] == param, e
    return e


def test_malformed_and_foreign_requests_get_openai_errors(app):
    good = _first_turn(_screen(0))

    def with_image(url):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]

    async def run():
        async with _client(app) as c:
            _err(
                await _post(c, {"messages": good, "frobnicate": 1}),
                400,
                "unknown_field",
                "frobnicate",
            )
            _err(
                await _post(c, {"messages": with_image("data:image/png;base64,@@@")}),
                400,
                "invalid_image",
            )
            e = _err(
                await _post(c, {"messages": with_image("data:image/png;base64,aGVsbG8=")}),
                400,
                "invalid_image",
            )
            assert e["param"] == "messages[0].content[0].image_url.url"
            _err(
                await _post(c, {"messages": with_image("http://example.com/a.png")}),
                400,
                "invalid_image_url",
            )
            long = [{"role": "user", "content": "word " * 2000}]
            _err(await _post(c, {"messages": long}), 400, "context_length_exceeded", "messages")
            _err(await _post(c, {"messages": []}), 400, "invalid_value", "messages")
            _err(
                await _post(c, {"messages": [{"role": "robot", "content": "x"}]}),
                400,
                None,
                "messages[0].role",
            )
            _err(
                await _post(c, {"messages": good, "temperature": -1}),
                400,
                "invalid_value",
                "temperature",
            )
            _err(await _post(c, {"messages": good, "model": "gpt-9"}), 400, "model_not_found")
            _err(await _post(c, {"messages": good, "stream": True}), 400, None, "stream")
            r = await c.post(
                "/v1/chat/completions",
                content=b"{not json",
                headers={**AUTH, "Content-Type": "application/json"},
            )
            _err(r, 400, "invalid_json")
            r = await c.post(
                "/v1/chat/completions",
                content=b"{}",
                headers={**AUTH, "Content-Type": "text/plain"},
            )
            _err(r, 415)
            big = {"messages": [{"role": "user", "content": "x" * (33 * 1024 * 1024)}]}
            _err(await _post(c, big), 413)
            _err(await _post(c, {"messages": good}, headers={}), 401)
            _err(await _post(c, {"messages": good}, headers={"Authorization": "Bearer nope"}), 401)
            _err(
                await _post(
                    c, {"messages": good}, headers={**AUTH, "Origin": "http://evil.example"}
                ),
                403,
            )
            _err(
                await _post(c, {"messages": good}, headers={**AUTH, "Host": "evil.example:8000"}),
                403,
            )
            _err(
                await _post(
                    c, {"messages": good}, headers={**AUTH, "Sec-Fetch-Site": "cross-site"}
                ),
                403,
            )
            _err(await c.get("/v1/nothing", headers=AUTH), 404)
            # the server's own origin is fine
            r = await _post(
                c,
                {"messages": good, "max_tokens": 2},
                headers={**AUTH, "Origin": "http://127.0.0.1:8000"},
            )
            assert r.status_code == 200, r.text
            r = await c.get("/v1/models", headers=AUTH)
            assert r.json()["data"][0]["id"] == "tiny"

    asyncio.run(run())


LONG = "0123456789abcdef-long"  # a token of the length a non-guessable one needs


def test_token_rules():
    tok, made = resolve_token("127.0.0.1", None, False)
    assert made and len(tok) >= 32
    assert resolve_token("127.0.0.1", None, True) == (None, False)
    assert resolve_token("0.0.0.0", LONG, False) == (LONG, False)
    for host in ("0.0.0.0", "127.0.0.1"):  # loopback is shared with every local user
        with pytest.raises(ValueError, match="has 15 characters, fewer than 16"):
            resolve_token(host, LONG[:15], False)
    with pytest.raises(ValueError, match="non-loopback"):
        resolve_token("0.0.0.0", None, False)
    with pytest.raises(ValueError, match="no-token"):
        resolve_token("10.0.0.1", None, True)
    with pytest.raises(ValueError, match="contradict"):
        resolve_token("127.0.0.1", LONG, True)


def test_stop_strings_n_choices_and_seeds(app):
    msgs = _first_turn(_screen(5), "stop test")

    async def run():
        async with _client(app) as c:
            r = await _post(c, {"messages": msgs, "temperature": 0, "max_tokens": 8})
            full = r.json()["choices"][0]["message"]["content"]
            stop = full[len(full) // 2 : len(full) // 2 + 2]
            r = await _post(c, {"messages": msgs, "temperature": 0, "max_tokens": 8, "stop": stop})
            cut = r.json()["choices"][0]
            body = {"messages": msgs, "temperature": 1.0, "max_tokens": 6, "n": 3, "seed": 11}
            a = (await _post(c, body)).json()
            b = (await _post(c, body)).json()
            c2 = (await _post(c, {**body, "seed": 12})).json()
            return full, stop, cut, a, b, c2

    full, stop, cut, a, b, c2 = asyncio.run(run())
    assert stop and stop not in cut["message"]["content"]
    assert full.startswith(cut["message"]["content"]) and cut["finish_reason"] == "stop"
    ids = lambda j: [ch["token_ids"] for ch in j["choices"]]  # noqa: E731
    assert len(a["choices"]) == 3 and [ch["index"] for ch in a["choices"]] == [0, 1, 2]
    assert ids(a) == ids(b)  # the same seed samples the same choices
    assert ids(a) != ids(c2) and len({tuple(x) for x in ids(a)}) > 1
    assert a["usage"]["completion_tokens"] == sum(len(x) for x in ids(a))


def test_embedded_server_reports_the_live_weights_version(engine, proc, model):
    """A trainer serving its live policy on its own loop: update_params moves the replies to
    the new version."""
    import aiohttp
    from flax import nnx

    from tools.serve import EmbeddedServer

    async def run():
        srv = await EmbeddedServer.start(engine, proc, token="t", model_name="live")
        try:
            async with aiohttp.ClientSession() as s:
                body = {"messages": _first_turn(_screen(7)), "temperature": 0, "max_tokens": 3}
                headers = {"Authorization": "Bearer t"}
                url = srv.url + "/chat/completions"
                async with s.post(url, json=body, headers=headers) as r:
                    before = await r.json()
                engine.update_params(nnx.state(model), 7)
                async with s.post(url, json=body, headers=headers) as r:
                    after = await r.json()
                async with s.post(url, json=body) as r:
                    assert r.status == 401
        finally:
            await srv.stop()
            engine.update_params(nnx.state(model), 0)
        return before, after

    before, after = asyncio.run(run())
    assert before["policy_version"] == 0 and after["policy_version"] == 7
    assert after["system_fingerprint"] == "cua_jax-v7"
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]  # same weights


def test_a_client_that_leaves_stops_its_generation(engine, proc, caplog):
    """A client that disconnects mid-generation cancels it: the engine stops decoding for it
    (it went on to max_tokens, ~1000 tokens here, and the next request waited 1.9 s for it).
    A client that leaves mid-body, or sends JSON nested 100k deep, is a 400, not a 500 with a
    traceback in the log."""
    import time

    from tools.serve import EmbeddedServer

    async def run():
        srv = await EmbeddedServer.start(engine, proc, token=None, max_tokens=8)
        chat = srv.server.config.app.state.chat
        host, port = srv.url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
        for body in (b"[" * 100_000 + b"]" * 100_000, b'{"messages": [{"role": "us'):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                "Content-Type: application/json\r\nContent-Length: 200000\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            if len(body) == 200_000:
                deep = (await reader.read()).split(b"\r\n")[0]
            writer.close()  # the second leaves mid-body
        await asyncio.sleep(0.2)
        body = json.dumps(
            {
                "messages": [{"role": "user", "content": "hello"}],
                "temperature": 0,
                "max_tokens": 1000,
            }
        ).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        try:
            before = engine.stats["useful_tokens"]
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(head.encode() + body)
            await writer.drain()
            t0 = time.monotonic()
            while engine.stats["useful_tokens"] == before and time.monotonic() - t0 < 60:
                await asyncio.sleep(0.01)  # generating (after compiling, on a cold engine)
            writer.close()  # the client leaves
            t0 = time.monotonic()
            while engine.has_work() and time.monotonic() - t0 < 60:
                await asyncio.sleep(0.01)
            return engine.stats["useful_tokens"] - before, chat.abandoned, deep
        finally:
            await srv.stop()

    made, abandoned, deep = asyncio.run(run())
    assert deep == b"HTTP/1.1 400 Bad Request"
    assert not [r for r in caplog.records if r.exc_info], caplog.text
    assert abandoned == 1 and not engine.has_work()
    assert 0 < made < 200, made  # this greedy reply runs to the 1000-token cap if not stopped


def _serve_config(**kw):
    from ml_collections import ConfigDict

    from cua_jax.job.builders import serve_settings

    return serve_settings(
        ConfigDict({"serve": {"port": 0, "host": "127.0.0.1", "token": "", "max_tokens": 4, **kw}})
    )


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_run_serves_its_live_policy_with_a_made_up_token_in_serve_json(
    engine, proc, model, tmp_path, monkeypatch
):
    """config.serve.port: the trainer's helper starts the server on its loop; serve.json (owner
    only) names the URL, model and made-up token, which the server then requires."""
    import json
    import os

    import aiohttp

    from cua_jax.evaluation.live import serve_live_policy

    monkeypatch.delenv("CUA_SERVE_TOKEN", raising=False)
    wd = tmp_path / "run7"
    wd.mkdir()
    banned = model.config.vision_placeholder_ids

    async def run():
        assert await serve_live_policy(_serve_config(), str(wd), engine, proc, banned) is None
        port = _free_port()
        srv = await serve_live_policy(_serve_config(port=port), str(wd), engine, proc, banned)
        try:
            info = json.loads((wd / "serve.json").read_text())
            assert info["url"] == f"http://127.0.0.1:{port}/v1" and info["model"] == "run7"
            body = {"messages": _first_turn(_screen(3)), "temperature": 0}
            async with aiohttp.ClientSession() as s:
                url = info["url"] + "/chat/completions"
                async with s.post(url, json=body) as r:
                    assert r.status == 401
                auth = {"Authorization": f"Bearer {info['token']}"}
                async with s.post(url, json=body, headers=auth) as r:
                    return info, await r.json()
        finally:
            await srv.stop()

    info, reply = asyncio.run(run())
    assert os.stat(wd / "serve.json").st_mode & 0o777 == 0o600
    assert reply["model"] == "run7" and reply["policy_version"] == engine.version
    assert 1 <= len(reply["choices"][0]["token_ids"]) <= 4  # serve.max_tokens is the default


def test_live_serving_refuses_what_it_cannot_do_by_name(engine, proc, model, tmp_path, monkeypatch):
    """Several processes, a public address without a token, a port already taken: ConfigError
    naming the config key (launch/tpu.py prints it as one line, exit 2)."""
    import socket

    import jax

    from cua_jax.config.checks import ConfigError
    from cua_jax.evaluation.live import serve_live_policy

    monkeypatch.delenv("CUA_SERVE_TOKEN", raising=False)
    banned = model.config.vision_placeholder_ids

    def start(**kw):
        return asyncio.run(
            serve_live_policy(_serve_config(**kw), str(tmp_path), engine, proc, banned)
        )

    with pytest.raises(ConfigError, match=r"config.serve.host='0.0.0.0'.*needs --token"):
        start(port=_free_port(), host="0.0.0.0")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"config.serve.port={port}: cannot serve"):
            start(port=port, token=LONG)
    with pytest.raises(ConfigError, match=r"config.serve.token.*has 3 characters"):
        start(port=_free_port(), token="abc")
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"config.serve.port=.*2 processes"):
        start(port=_free_port(), token=LONG)
