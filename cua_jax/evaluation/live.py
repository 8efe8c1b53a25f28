"""The live policy served while it trains: tools/serve.py's OpenAI-compatible server
(`cua_jax.evaluation.server`) on the run's own event loop, over the Engine the rollouts use.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
from absl import logging
from etils import epath

from cua_jax.config.checks import ConfigError
from cua_jax.evaluation.server import EmbeddedServer, resolve_token


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """`config.serve`: the port (0: no server), the address, the bearer token (None: made up
    on a loopback host, refused on another) and the most tokens a reply may take."""

    port: int
    host: str
    token: str | None
    max_tokens: int


async def serve_live_policy(
    sv: ServeSettings, workdir: str, engine: Any, processor: Any, banned_token_ids: Sequence[int]
) -> Any:
    """tools/serve.py's OpenAI-compatible server on this run's event loop, over the Engine the
    rollouts use (continuous batching shares it; each reply names the learner version that
    wrote it), or None when `serve.port` is 0. WORKDIR/serve.json gets the URL and model id,
    and a made-up token (owner-only file). ConfigError: more than one process (the engine is
    one SPMD program, which a request on one host alone would hang) or a refused host/token."""
    if not sv.port:
        return None
    if jax.process_count() > 1:
        raise ConfigError(
            f"config.serve.port={sv.port} serves one process's engine, and this job has "
            f"{jax.process_count()} processes: serve a checkpoint with tools/serve.py instead"
        )
    try:
        token, made_up = resolve_token(sv.host, sv.token, no_token=False)
    except ValueError as e:
        raise ConfigError(f"config.serve.host={sv.host!r}: {e}") from None
    name = os.path.basename(os.path.abspath(workdir)) or "cua_jax"
    try:
        server = await EmbeddedServer.start(
            engine,
            processor,
            host=sv.host,
            port=sv.port,
            token=token,
            model_name=name,
            max_tokens=sv.max_tokens,
            banned_token_ids=banned_token_ids,
        )
    except OSError as e:
        raise ConfigError(f"config.serve.port={sv.port}: cannot serve on {sv.host}: {e}") from None
    info = {"url": server.url, "model": name, **({"token": token} if made_up else {})}
    path = epath.Path(workdir) / "serve.json"
    path.write_text(json.dumps(info, indent=2))
    if made_up and not str(workdir).startswith("gs://"):
        os.chmod(path, 0o600)
    shown = "its token in serve.json" if made_up else "token from config.serve.token"
    logging.warning("serving the live policy as %r at %s (%s)", name, server.url, shown)
    return server
