"""tools/eval.py --step: a step number, or "best" from the run's summary.json, each bad value a
clear error. (The parsing lives in cua_jax.job.loading: importing tools/eval.py here would
define its absl flags a second time in a test process that has launch/tpu.py's.)"""

import json

import pytest

from cua_jax.job.loading import checkpoint_step


def test_step_numbers_and_best_from_the_summary(tmp_path):
    assert checkpoint_step(None, str(tmp_path)) is None  # the latest
    assert checkpoint_step("30", str(tmp_path)) == 30
    (tmp_path / "summary.json").write_text(json.dumps({"eval_best_step": 20}))
    assert checkpoint_step("best", str(tmp_path)) == 20


@pytest.mark.parametrize(
    "value,summary,message",
    [
        ("x", None, "--step='x' is neither a step number nor 'best'"),
        ("best", None, "--step=best reads"),
        ("best", {"eval_best_step": None}, "has no eval_best_step"),
    ],
)
def test_bad_steps_are_named(tmp_path, value, summary, message):
    if summary is not None:
        (tmp_path / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match=message.replace("?", r"\?").replace("(", r"\(")):
        checkpoint_step(value, str(tmp_path))
    with pytest.raises(ValueError, match="needs --workdir"):
        checkpoint_step("best", None)
