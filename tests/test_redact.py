"""Secrets never leave a run in clear: the redaction rule itself, config.json (redacted and
owner-only), the trajectory database's runs.config, W&B's run config and the monitor's config
pane."""

from __future__ import annotations

import json
import os
import stat
import sys
import types

import sqlalchemy as sa
from ml_collections import ConfigDict
from starlette.testclient import TestClient

from cua_jax import db as db_lib
from cua_jax import metrics as metrics_lib
from cua_jax.redact import REDACTED, is_secret_key, redact, write_run_config

SECRETS = ("serve-s3cret", "browser-s3cret", "vm-s3cret", "db-pa55word", "wandb-0123abcd")


def secret_config() -> dict:
    """A run config (the shape of configs/common.py) holding every kind of secret."""
    return {
        "serve": {"token": "serve-s3cret", "max_tokens": 256, "port": 0},
        "env": {
            "browser_token": "browser-s3cret",
            "vm_token": "vm-s3cret",
            "vm_endpoints": ["http://10.0.0.2:5000/?token=vm-s3cret&x=1"],
        },
        "log": {
            "db_url": "postgresql://cua:db-pa55word@db.example:5432/cua",
            "wandb_project": "p",
            "wandb_api_key": "wandb-0123abcd",
        },
        "rl": {"max_tokens": 128, "group_size": 4},
        "unset": {"token": "", "api_key": None},
    }


def assert_no_secret(text: str) -> None:
    for s in SECRETS:
        assert s not in text, f"{s!r} leaked: {text[:2000]}"


def test_redact_hides_secrets_and_keeps_the_rest():
    out = redact(secret_config())
    assert_no_secret(json.dumps(out))
    assert out["serve"] == {"token": REDACTED, "max_tokens": 256, "port": 0}
    assert out["env"]["browser_token"] == out["env"]["vm_token"] == REDACTED
    assert out["env"]["vm_endpoints"] == [f"http://10.0.0.2:5000/?token={REDACTED}&x=1"]
    assert out["log"]["db_url"] == f"postgresql://cua:{REDACTED}@db.example:5432/cua"
    assert out["log"]["wandb_api_key"] == REDACTED and out["log"]["wandb_project"] == "p"
    assert out["rl"] == {"max_tokens": 128, "group_size": 4}
    assert out["unset"] == {"token": "", "api_key": None}  # unset stays visibly unset
    assert redact(ConfigDict(secret_config()))["serve"]["token"] == REDACTED
    assert secret_config()["serve"]["token"] == "serve-s3cret"  # a copy, not in place
    assert not any(map(is_secret_key, ("max_tokens", "pad_token_id", "tokenizer", "tokens")))
    assert redact("postgresql://user@host/db") == "postgresql://user@host/db"


def test_run_config_file_is_redacted_and_owner_only(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{}")
    os.chmod(path, 0o644)  # an older run's world-readable file is tightened, not kept
    assert write_run_config(str(tmp_path), ConfigDict(secret_config())) == str(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text()
    assert_no_secret(text)
    assert json.loads(text)["rl"]["group_size"] == 4


def test_a_run_config_read_back_leaves_redacted_secrets_unset(tmp_path):
    """`load_run_config` (tools/eval.py --workdir, tools/serve.py) reads a redacted token as
    unset, this version's default, so it comes from the environment rather than being sent as
    the literal "<redacted>"."""
    from configs import common, qwen3vl_grpo

    c = qwen3vl_grpo.get_config("smoke")
    c.serve.token = "s3cret-token-value"
    c.rl.group_size = 3
    write_run_config(str(tmp_path), c)
    back = common.load_run_config(str(tmp_path))
    assert back.serve.token == common.base_config("qwen3_vl").serve.token
    assert back.rl.group_size == 3
    assert "s3cret" not in (tmp_path / "config.json").read_text()


def test_database_and_monitor_never_show_a_secret(tmp_path):
    from tools import monitor
    from tools.monitor_app.app import make_app

    url = str(tmp_path / "t.sqlite")
    db = db_lib.open_run(str(tmp_path / "run"), url, config=secret_config())
    db.log_step(0, {"eval/success": 0.5})
    db.close("finished")
    engine = sa.create_engine(f"sqlite:///{url}")
    with engine.begin() as c:
        stored = c.execute(sa.text("SELECT config FROM runs")).scalar()
        assert_no_secret(stored if isinstance(stored, str) else json.dumps(stored))
        # a row written before redaction existed: the monitor's pane still hides it
        c.execute(sa.text("UPDATE runs SET config = :c"), {"c": json.dumps(secret_config())})
    engine.dispose()
    page = TestClient(make_app(monitor.open_database(url))).get("/runs/1")
    assert page.status_code == 200 and "max_tokens" in page.text
    assert_no_secret(page.text)


def test_wandb_gets_a_redacted_config(tmp_path, monkeypatch):
    seen = {}

    def init(**kw):
        seen.update(kw)
        return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    w = metrics_lib.MetricsWriter(str(tmp_path), wandb_project="p", config=secret_config())
    w.close()
    assert seen["config"]["serve"]["max_tokens"] == 256
    assert_no_secret(json.dumps(seen["config"]))
