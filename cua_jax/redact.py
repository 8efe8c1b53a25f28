"""Secrets out of every config that is written or shown: one helper for all of them.

    redact(config)                      # a copy with every secret replaced by "<redacted>"
    write_run_config(workdir, config)   # WORKDIR/config.json, redacted and owner-only

A run's config carries bearer tokens (`serve.token`, `env.browser_token`, `env.vm_token`) and
may carry a password inside a URL (`log.db_url=postgresql://user:pw@host/db`) or a key someone
added (`wandb_api_key`). The config is written to `WORKDIR/config.json`, the trajectory
database's `runs.config`, W&B's run config and the monitor's config pane, all readable by more
people than the run's owner: each of them goes through `redact`. A secret is a value whose key
names one (`token`, `*_token`, `password`, `secret`, `api_key`, ...; not `max_tokens`), a URL's
password, or a URL query parameter with such a name. Empty values stay as they are (an unset
token is worth seeing). A run that needs its token again reads it from the environment
(`$CUA_BROWSER_TOKEN`, `$CUA_SERVE_TOKEN`, `$DATABASE_URL`), never from its saved config.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from typing import Any

REDACTED = "<redacted>"

# A key whose value is a secret: `token`, `browser_token`, `wandb_api_key`, `db_password`, ...
# but not `max_tokens`, `pad_token_id` or `tokenizer`.
_SECRET_KEY = re.compile(
    r"(^|[_.-])(token|password|passwd|pwd|secret|api_?key|access_?key|secret_?key)$",
    re.IGNORECASE,
)
# scheme://user:password@host... (the password is group 2).
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)([^@\s/]+)(@)")


def is_secret_key(key: str) -> bool:
    """Whether a config key names a secret (`serve.token`, `api_key`, not `max_tokens`)."""
    return bool(_SECRET_KEY.search(str(key)))


def redact_string(value: str) -> str:
    """`value` with the password of every URL in it, and every secret-named query parameter,
    replaced by `REDACTED`."""
    value = _URL_PASSWORD.sub(lambda m: m.group(1) + REDACTED + m.group(3), value)
    if "?" not in value or "=" not in value:
        return value
    head, sep, query = value.partition("?")
    frag = ""
    if "#" in query:
        query, frag = query.split("#", 1)
        frag = "#" + frag
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    if not any(is_secret_key(k) and v for k, v in pairs):
        return value
    pairs = [(k, REDACTED if is_secret_key(k) and v else v) for k, v in pairs]
    return head + sep + urllib.parse.urlencode(pairs, safe="<>") + frag


def redact(config: Any) -> Any:
    """A copy of `config` (a dict, list or ml_collections ConfigDict, nested) with its secrets
    replaced by `REDACTED` (module docstring); other values are returned as they are."""
    if hasattr(config, "to_dict") and not isinstance(config, dict):
        config = config.to_dict()
    if isinstance(config, dict):
        return {
            k: (REDACTED if is_secret_key(k) and _is_set(v) else redact(v))
            for k, v in config.items()
        }
    if isinstance(config, list | tuple):
        return type(config)(redact(v) for v in config)
    if isinstance(config, str):
        return redact_string(config)
    return config


def _is_set(value: Any) -> bool:
    """A secret worth hiding: anything but None, "" and an empty container."""
    if isinstance(value, dict | list | tuple | str):
        return len(value) > 0
    return value is not None


def write_run_config(workdir: str, config: Any) -> str:
    """Writes `config` (a ConfigDict or a dict), redacted, to `WORKDIR/config.json`; on a local
    path the file is created owner-only (0600) before anything is written to it. Returns its
    path."""
    if hasattr(config, "to_json_best_effort"):
        data = json.loads(config.to_json_best_effort())
    else:
        data = config
    text = json.dumps(redact(data), indent=2)
    path = os.path.join(os.fspath(workdir), "config.json")
    if "://" in path:  # gs://...: the bucket's permissions apply
        from etils import epath

        epath.Path(path).write_text(text)
        return path
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file (an older run's) keeps its mode otherwise
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


__all__ = ["REDACTED", "is_secret_key", "redact", "redact_string", "write_run_config"]
