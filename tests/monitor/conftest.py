"""A trajectory database holding synthetic runs (real Trajectory objects), for the monitor."""

from __future__ import annotations

import pytest

from cua_jax import db as db_lib
from tests.db import synth
from tests.db.conftest import pg_server  # noqa: F401 -- the PostgreSQL server fixture

GROUPS, GROUP_SIZE, STEPS = 3, 4, 6


def fill_run(workdir: str, url: str, name: str, steps: int, *, close: bool = True):
    db = db_lib.open_run(
        workdir, url, run_name=name, config={"rl": {"group_size": GROUP_SIZE}}, decode=synth.decode
    )
    db.truncate_after(-1)
    trajs, tasks, screens = synth.eval_batch(0)
    db.log_eval(0, "step0", trajs, tasks, screens=screens, metrics={"eval/success": 0.5})
    db.log_step(0, {"eval/success": 0.5})
    for s in range(1, steps + 1):
        groups, screens = synth.step_groups(s, GROUPS, GROUP_SIZE, version=s - 1)
        row = synth.metrics_row(s)
        if s == steps:
            trajs, tasks, shots = synth.eval_batch(s)
            db.log_eval(s, f"step{s}", trajs, tasks, screens=shots)
            row["eval/success"] = 0.5
        db.log_step(s, row, groups, screens=screens, version=s)
    if close:
        db.close("finished")
    else:
        assert db.flush(30)
    return db


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """(url, workdir of run 1): run 1 finished with STEPS steps, run 2 a shorter one."""
    root = tmp_path_factory.mktemp("monitor_db")
    url = str(root / "shared.sqlite")
    fill_run(str(root / "run_a"), url, "run-a", STEPS)
    fill_run(str(root / "run_b"), url, "run-b", 2)
    return url, root / "run_a"
