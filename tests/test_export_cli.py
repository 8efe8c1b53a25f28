"""tools/export_hf.py refuses what would harm a run and fails in one line: `--out` that is the
workdir, inside its checkpoints or another run's directory; a bad workdir, step or `--out`; a
damaged checkpoint. Each is exit status 2 with one line on stderr and no traceback (the traceback
only with --verbosity=1), and nothing in the run changes."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from configs import qwen3vl_grpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = [sys.executable, os.path.join(ROOT, "tools", "export_hf.py")]


def _export(*args, timeout=120):
    return subprocess.run([*TOOL, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def _fake_run(path, steps=(1,)):
    """A run's files as train.py leaves them: its config, metrics and checkpoint step dirs
    (empty: every refusal here comes before a checkpoint is read)."""
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(qwen3vl_grpo.get_config("smoke").to_dict(), f)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write('{"step": 1}\n')
    for s in steps:
        for item in ("state", "meta"):
            os.makedirs(os.path.join(path, "checkpoints", str(s), item))
    return path


def _digest(path):
    out = {}
    for d, _, files in os.walk(path):
        for n in files:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), path)] = hashlib.sha256(f.read()).digest()
    return out


def _one_line_exit_2(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("export_hf: "), r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def run_dir(tmp_path):
    return _fake_run(str(tmp_path / "run"))


def test_out_into_the_run_is_refused_and_nothing_changes(run_dir, tmp_path):
    before = _digest(run_dir)
    other = _fake_run(str(tmp_path / "other_run"))
    hf_like = tmp_path / "old_export"  # a former export (an HF config.json): not a run
    hf_like.mkdir()
    (hf_like / "config.json").write_text('{"architectures": ["X"], "model_type": "qwen3_vl"}')
    cases = [
        (run_dir, "is the run's workdir"),
        (run_dir + "/", "is the run's workdir"),
        (os.path.join(run_dir, "checkpoints", "hf"), "inside the run's checkpoints"),
        (os.path.join(run_dir, "checkpoints", "1"), "inside the run's checkpoints"),
        (other, "holds a training run's files (config.json)"),
        (os.path.join(run_dir, "sft_demos"), "a folder of the run that holds files"),
        (os.path.join(run_dir, "tb"), "a folder of the run that holds files"),
    ]
    for sub in ("sft_demos", "tb"):  # the run's own folders, with their files
        os.makedirs(os.path.join(run_dir, sub), exist_ok=True)
        with open(os.path.join(run_dir, sub, "data.jsonl"), "w") as f:
            f.write("{}\n")
    before = _digest(run_dir)
    for out, needle in cases:
        _one_line_exit_2(_export(f"--workdir={run_dir}", f"--out={out}"), needle)
    only_metrics = tmp_path / "metrics_only"
    only_metrics.mkdir()
    (only_metrics / "metrics.jsonl").write_text("")
    _one_line_exit_2(_export(f"--workdir={run_dir}", f"--out={only_metrics}"), "metrics.jsonl")
    assert _digest(run_dir) == before
    assert not os.path.exists(os.path.join(run_dir, "checkpoints", "hf"))
    # a former export is no run: refused for no reason of its own (here: the empty checkpoint)
    r = _export(f"--workdir={run_dir}", f"--out={hf_like}", timeout=600)
    assert "holds a training run" not in r.stderr


def test_bad_workdir_step_and_out_are_one_line(run_dir, tmp_path):
    missing = str(tmp_path / "nope")
    _one_line_exit_2(_export(f"--workdir={missing}", "--out=/tmp/x"), "is not a directory")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    _one_line_exit_2(_export(f"--workdir={a_file}", "--out=/tmp/x"), "is not a directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_exit_2(_export(f"--workdir={empty}", "--out=/tmp/x"), "not a cua_jax training run")
    (empty / "config.json").write_text("{not json")
    _one_line_exit_2(_export(f"--workdir={empty}", "--out=/tmp/x"), "not a cua_jax training run")
    no_ckpt = _fake_run(str(tmp_path / "no_ckpt"), steps=())
    _one_line_exit_2(_export(f"--workdir={no_ckpt}", "--out=/tmp/x"), "has no checkpoints")
    out = str(tmp_path / "hf")
    _one_line_exit_2(
        _export(f"--workdir={run_dir}", f"--out={out}", "--step=99"), "--step=99", "[1]"
    )
    _one_line_exit_2(_export(f"--workdir={run_dir}", f"--out={a_file}"), "not a directory")
    _one_line_exit_2(_export(f"--workdir={run_dir}", f"--out={a_file}/sub"), "is not writable")


def test_damaged_checkpoint_is_one_line_and_traceback_only_when_verbose(run_dir, tmp_path):
    """Past the argument checks: the (empty, so unreadable) checkpoint fails the restore."""
    out = str(tmp_path / "hf")
    r = _export(f"--workdir={run_dir}", f"--out={out}", timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    # JAX's backend start may log lines of its own (libtpu on a host without a TPU); ours is one
    ours = [ln for ln in r.stderr.splitlines() if ln.startswith("export_hf: ")]
    assert len(ours) == 1 and ours == r.stderr.strip().splitlines()[-1:], r.stderr[-3000:]
    assert f"{run_dir}/checkpoints/1 is damaged" in ours[0]
    r = _export(f"--workdir={run_dir}", f"--out={out}", "--verbosity=1", timeout=600)
    assert r.returncode == 2 and "Traceback" in r.stderr
