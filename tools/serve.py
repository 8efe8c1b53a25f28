r"""An OpenAI-compatible chat-completions server for a policy of this project.

    python tools/serve.py --workdir=/tmp/cua_smoke [--step=N] --port=8000
    python tools/serve.py --config=configs/qwen3vl_grpo.py:8b \
        --config.model.hf_path=/ckpts/Qwen3-VL-8B-Instruct --port=8000
    curl -H "Authorization: Bearer $TOKEN" -H "Content-Type: application/json" \
        http://127.0.0.1:8000/v1/chat/completions -d '{"messages": [...], "temperature": 0}'

Routes: POST /v1/chat/completions, GET /v1/models, GET /health. A request is rendered by the
project's chat renderer (`cua_jax.evaluation.openai_chat`: the trainer's exact ids for a
conversation built like the agent loop's transcript, generated ids reused for replies this server
wrote) and decoded by the project's `Engine` (continuous batching over all requests in flight,
the K/V of a conversation's previous turn reused when a request extends it).

Request fields: model, messages (text and `image_url` data-URI parts, multi-turn), temperature
(0 = greedy), top_p, max_tokens / max_completion_tokens, stop, seed, logprobs, n; an unknown
field, a bad image, a too-long prompt get a 400 `{"error": {"message", "type", "param",
"code"}}`. Each reply carries the weights version that produced it (`policy_version`, and
`system_fingerprint` = "cua_jax-v<version>") and, per choice, the generated `token_ids` (the
stop token included; `content` leaves it out) that `tools/agents.py` records.

Security: it binds 127.0.0.1 by default and needs `Authorization: Bearer <token>`; without
--token it makes one up and prints it once (as Jupyter does); --no-token turns the check off (on
loopback only); a non-loopback --host needs --token; a token (--token, $CUA_SERVE_TOKEN, the
trainer's config.serve.token) under 16 characters is refused on any address. Browsers are
refused: a `Host` that is not loopback or the bound host (DNS rebinding), an `Origin` other than
the server's own, or `Sec-Fetch-Site: cross-site` get 403. POSTs need `Content-Type:
application/json` (415) and a body under --max_body_mb (413).
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from cua_jax.evaluation.server import (  # noqa: E402,F401  (tests and tools import these here)
    DEFAULT_MAX_BODY,
    ChatServer,
    EmbeddedServer,
    Guard,
    MiB,
    create_app,
    error_response,
    is_loopback,
    resolve_token,
)

# ------------------------------------------------------------------------------------ CLI


def _define_flags():
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file(
        "config", None, "Config file with a preset (instead of --workdir): configs/FILE.py:PRESET"
    )
    flags.DEFINE_string("workdir", None, "A training run's directory (its checkpoint).")
    flags.DEFINE_integer("step", None, "Checkpoint step of --workdir (default: the latest).")
    flags.DEFINE_string("host", "127.0.0.1", "Bind address (non-loopback needs --token).")
    flags.DEFINE_integer("port", 8000, "Port.")
    flags.DEFINE_string("token", None, "Bearer token (default $CUA_SERVE_TOKEN, else made up).")
    flags.DEFINE_boolean("no_token", False, "No token check (loopback only); also --no-token.")
    flags.DEFINE_multi_string("allow_host", [], "A Host name clients use besides loopback/--host.")
    flags.DEFINE_string("model_name", None, "Model id in replies (default: the run's name).")
    flags.DEFINE_integer("max_tokens", 256, "Default max_tokens of a request that sets none.")
    flags.DEFINE_integer("max_body_mb", DEFAULT_MAX_BODY // MiB, "Request body cap, MiB.")


def main(argv: list[str]) -> None:
    """The command line: runs what the module docstring describes."""
    from absl import flags, logging

    f = flags.FLAGS
    if len(argv) > 1:
        raise SystemExit(f"tools/serve.py: error: unexpected arguments {argv[1:]}")
    if not f["verbosity"].present:
        logging.set_verbosity(logging.WARNING)

    def fail(msg: str):
        print(f"tools/serve.py: error: {msg}", file=sys.stderr)
        raise SystemExit(2)

    try:
        token, generated = resolve_token(f.host, f.token, f.no_token)
    except ValueError as e:
        fail(str(e))
    if not 1 <= f.port <= 65535:
        fail(f"--port={f.port} must be in [1, 65535]")
    if not 1 <= f.max_body_mb <= 1024:
        fail(f"--max_body_mb={f.max_body_mb} must be in [1, 1024] (MiB)")
    if f.max_tokens < 1:
        fail(f"--max_tokens={f.max_tokens} must be >= 1")
    if (f.workdir is None) == (f.config is None):
        fail("pass exactly one of --workdir (a training run) or --config (a preset)")
    if f.workdir is not None:
        from configs.common import load_run_config

        try:
            config = load_run_config(f.workdir)
        except FileNotFoundError as e:
            fail(str(e))
    else:
        if f.step is not None:
            fail("--step needs --workdir (a --config model has no checkpoints)")
        config = f.config

    import uvicorn

    from cua_jax.checkpoint.orbax_io import CheckpointError
    from cua_jax.job import builders
    from cua_jax.job.loading import load_policy
    from launch import compose

    compose.enable_compile_cache(config.get("compile_cache_dir"))
    try:
        model, processor, step, mesh, rules = load_policy(config, f.workdir, f.step)
    except CheckpointError as e:
        fail(str(e))
    engine = builders.build_engine(model, config, processor.tokenizer, mesh=mesh, rules=rules)
    if step is not None:  # replies name the checkpoint's step as their version (same arrays)
        engine.update_params(model, step)
    name = f.model_name or (
        f"{os.path.basename(os.path.abspath(f.workdir))}@{step}"
        if f.workdir
        else os.path.basename(str(config.model.get("hf_path") or config.get("preset", "cua_jax")))
    )
    hosts = None if f.host in ("0.0.0.0", "::", "") else {f.host, *f.allow_host}
    app = create_app(
        engine,
        processor,
        token=token,
        hosts=hosts,
        model_name=name,
        max_tokens=f.max_tokens,
        banned_token_ids=model.config.vision_placeholder_ids,
        max_body_bytes=f.max_body_mb * MiB,
    )
    url = f"http://{f.host}:{f.port}/v1"
    if token is None:
        print(f"serving {name} at {url} (no token)", file=sys.stderr)
    elif generated:
        print(f"serving {name} at {url}\n  token: {token}", file=sys.stderr)
    else:
        print(f"serving {name} at {url} (token from --token / $CUA_SERVE_TOKEN)", file=sys.stderr)
    uvicorn.run(app, host=f.host, port=f.port, log_level="warning")


if __name__ == "__main__":
    from absl import app as absl_app

    _define_flags()
    sys.argv = ["--no_token" if a == "--no-token" else a for a in sys.argv]
    absl_app.run(main)
