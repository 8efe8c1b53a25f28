r"""Throughput of tools/serve.py against direct `Engine` use, side by side on one engine.

    python tools/bench_serve.py [--config=configs/qwen3vl_grpo.py:smoke] [--requests=64] \
        [--max_tokens=32] [--repeats=3] [--screens=ui|noise] [--client=process|inline]

The same N chat requests (a system prompt, a screenshot, an instruction; greedy, `max_tokens`
each, every token generated: no stop tokens) go
  direct: rendered by the project's renderer (the server's, in-process) and sent to
          `engine.generate` all at once (asyncio.gather), as the rollout workers do;
  server: as JSON bodies (screenshots as PNG data URIs; bodies serialised before the clock
          starts, as a load generator holds them) POSTed all at once to tools/serve.py on a
          loopback port (uvicorn; an aiohttp client in its own process by default, as a real
          load generator is, or inline in the server's process), which decodes, renders and
          calls the same engine.
Screenshots are page-like (--screens=ui: flat colours, boxes, text bars) or uniform noise (the
worst case for the server's PNG decoding). A warm-up pass of each compiles every shape first;
the timed passes alternate (direct, server, ...). Prints generated tokens/s of each (best of
--repeats) and the ratio server/direct. Timing only here, never in a test.
"""

from __future__ import annotations

import os

import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from cua_jax.evaluation.openai_chat import MessageRenderer, encode_image
from cua_jax.job import builders
from cua_jax.job.loading import load_policy
from cua_jax.sampler import SamplingParams
from tools import bench_setup
from tools.serve import create_app

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(bench_setup.ROOT, "configs", "qwen3vl_grpo.py") + ":smoke",
    "Config + preset.",
)
_REQUESTS = flags.DEFINE_integer("requests", 64, "Concurrent requests per pass.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 32, "Generated tokens per request.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed passes of each (best kept).")
_SCREENS = flags.DEFINE_enum(
    "screens",
    "ui",
    ["ui", "noise"],
    "ui: flat page-like screenshots (boxes, text bars) that compress as real ones do; noise: "
    "uniform random pixels, the worst case for PNG decoding on the server.",
)


def ui_screen(rng, h, w):
    """A page-like u8[h, w, 3] screenshot: a flat background, coloured boxes (buttons, fields)
    and dark text bars, as the built-in tasks' pages look."""
    img = np.full((h, w, 3), rng.integers(230, 256), np.uint8)
    for _ in range(6):
        y, x = rng.integers(0, h - 24), rng.integers(0, w - 64)
        img[y : y + rng.integers(12, 24), x : x + rng.integers(32, 64)] = rng.integers(0, 256, 3)
    for _ in range(12):
        y, x = rng.integers(0, h - 6), rng.integers(0, w - 80)
        img[y : y + 5, x : x + rng.integers(20, 80)] = rng.integers(0, 80)
    return img


_CLIENT = flags.DEFINE_enum(
    "client",
    "process",
    ["process", "inline"],
    "process: the HTTP load generator runs in its own process, as a real client would (it "
    "still shares the machine's cores); inline: in the server's process and event loop thread "
    "pool, where its JSON and socket work take the server's GIL too.",
)


def _client_worker(conn, url: str, bodies: list[bytes]) -> None:
    """The load generator's process: on each "go" POSTs every body at once and sends back
    (completion tokens, seconds); None ends it."""
    import asyncio

    while conn.recv() is not None:
        conn.send(bench_setup.timed(lambda: asyncio.run(_post_all(url, bodies))))


async def _post_all(url: str, bodies: list[bytes]) -> int:
    """POSTs every body at once (aiohttp, no connection limit); the completion tokens."""
    import asyncio

    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one(b):
            json_type = {"Content-Type": "application/json"}
            async with s.post(url, data=b, headers=json_type) as r:
                data = await r.json()
                assert r.status == 200, data
                return data["usage"]["completion_tokens"]

        return sum(await asyncio.gather(*(one(b) for b in bodies)))


def main(argv: list[str]) -> None:
    """The command line: runs what the module docstring describes."""
    import asyncio
    import contextlib
    import json

    import jax

    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    config = _CONFIG.value
    model, processor, _, mesh, rules = load_policy(config, None)
    engine = builders.build_engine(model, config, processor.tokenizer, mesh=mesh, rules=rules)
    w, h = config.env.viewport_width, config.env.viewport_height
    rng = np.random.default_rng(0)
    if _SCREENS.value == "ui":
        shots = [ui_screen(rng, h, w) for _ in range(_REQUESTS.value)]
    else:
        shots = [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for _ in range(_REQUESTS.value)]
    system = "You operate a computer. Reply with one tool call."
    n_tok = _MAX_TOKENS.value

    def renderer_messages(i):
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"task {i}"}]},
        ]

    def body(i):
        url = encode_image(shots[i])
        return {
            "messages": [
                {"role": "system", "content": system},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": f"task {i}"},
                    ],
                },
            ],
            "temperature": 0,
            "max_tokens": n_tok,
        }

    # serialised before the clock starts, as a load generator holds its requests
    bodies = [json.dumps(body(i)).encode() for i in range(len(shots))]
    png_kib = sum(len(encode_image(x)) for x in shots) * 3 / 4 / len(shots) / 1024
    # No stop tokens: every request generates exactly max_tokens in both paths.
    params = SamplingParams(temperature=0.0, max_new_tokens=n_tok)
    renderer = MessageRenderer(processor)

    async def direct_pass():
        async def one(i):
            p = await asyncio.to_thread(renderer.render, renderer_messages(i), [shots[i]])
            out = await engine.generate(p.ids, p.pixel_values, p.grid, params=params)
            return len(out.tokens)

        return sum(await asyncio.gather(*(one(i) for i in range(len(shots)))))

    app_ = create_app(engine, processor, token=None, model_name="bench", max_tokens=n_tok)
    app_.state.chat.stop_ids = ()  # as the direct pass: no stop tokens

    expect = len(shots) * n_tok
    with bench_setup.uvicorn_thread(app_) as port, contextlib.ExitStack() as stack:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        if _CLIENT.value == "process":
            import multiprocessing

            conn, child_conn = multiprocessing.Pipe()
            client = multiprocessing.get_context("spawn").Process(
                target=_client_worker, args=(child_conn, url, bodies), daemon=True
            )
            client.start()
            stack.callback(client.join, 30)
            stack.callback(conn.send, None)

            def server_timed():
                conn.send("go")
                return conn.recv()
        else:

            def server_timed():
                return bench_setup.timed(lambda: asyncio.run(_post_all(url, bodies)))

        asyncio.run(direct_pass())  # warm-up: compiles every shape
        server_timed()
        direct, server = [], []
        for _ in range(_REPEATS.value):  # interleaved, so load changes hit both alike
            direct.append(bench_setup.timed(lambda: asyncio.run(direct_pass())))
            server.append(server_timed())
    assert all(t == expect for t, _ in direct + server), (direct, server, expect)
    best_direct = min(t for _, t in direct)
    best_server = min(t for _, t in server)
    d, s = expect / best_direct, expect / best_server
    print(
        f"{config.preset} on {jax.devices()[0].device_kind}: {len(shots)} concurrent requests "
        f"x {n_tok} tokens, one {w}x{h} {_SCREENS.value} screenshot each ({png_kib:.0f} KiB "
        f"PNG), max_slots={config.sampler.max_slots}, client {_CLIENT.value}\n"
        f"  direct Engine: {d:9.1f} tokens/s ({best_direct:.3f} s)\n"
        f"  tools/serve.py: {s:8.1f} tokens/s ({best_server:.3f} s)\n"
        f"  ratio server/direct: {s / d:.3f}"
    )


if __name__ == "__main__":
    app.run(main)
