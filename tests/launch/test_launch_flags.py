"""Bad command lines fail before any work starts, with one line naming the problem."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch(*args):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch", "tpu.py"), *args, "--workdir=/tmp/unused"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--config=configs/qwen3vl_grpo.py:huge"], "unknown preset 'huge'"),
        (["--config=configs/nope.py"], "no config file 'configs/nope.py'"),
        (
            ["--config=configs/qwen3vl_grpo.py:smoke", "--config.rl.group_size=abc"],
            "--config.rl.group_size=abc",
        ),
        (
            ["--config=configs/qwen3vl_grpo.py:smoke", "--config.rl.gruop_size=3"],
            "unknown config key in an override: 'gruop_size'",
        ),
        (
            ["--config=configs/qwen3vl_grpo.py:smoke", "--config.rl.top_p=0.9"],
            "config.rl.top_p=0.9 needs config.rl.old_logprobs='learner'",
        ),
        (
            [
                "--config=configs/qwen3vl_grpo.py:smoke",
                "--config.env.action_format=pyautogui",
                "--config.env.constrain_actions=True",
            ],
            "config.env.constrain_actions=True needs a tool-call format with a grammar",
        ),
        (
            ["--config=configs/qwen3vl_grpo.py:smoke", "--config.rl.temperature=0"],
            "config.rl.temperature=0.0 is out of range: a finite number > 0",
        ),
        (
            ["--config=configs/qwen3vl_grpo.py:smoke", "--config.ckpt.init_params_from=/nope"],
            "config.ckpt.init_params_from='/nope' is not a directory",
        ),
        (
            ["--config=configs/qwen3vl_grpo.py:smoke", "--config.sft.recovery_share=1.5"],
            "config.sft.recovery_share=1.5 is out of range: a finite number in [0, 1]",
        ),
        (
            ["--config=configs/qwen3vl_grpo.py:smoke", "--config.rl.logits_chunk=-1"],
            "config.rl.logits_chunk=-1 is out of range: an integer >= 0",
        ),
        (
            ["--config=configs/qwen3vl_grpo.py:smoke", "--config.sft.source=/nope/demos.jsonl"],
            "config.sft.source='/nope/demos.jsonl' does not exist",
        ),
        (
            [
                "--config=configs/qwen3vl_grpo.py:smoke",
                "--config.env.kind=vm",
                "--config.env.vm_qemu_image=/nope/Ubuntu.qcow2",
            ],
            "config.env.vm_qemu_image='/nope/Ubuntu.qcow2' is not a file",
        ),
        (
            ["--config=configs/qwen3vl_grpo.py:smoke", "--config.env.vm_qemu_cpus=0"],
            "config.env.vm_qemu_cpus=0 is out of range: an integer in [1, 64]",
        ),
        (
            ["--config=configs/qwen3vl_grpo.py:smoke", "--config.log.eval_every=0"],
            "config.log.eval_every=0 is out of range: an integer >= 1",
        ),
        (
            ["--config=configs/qwen3vl_grpo.py:smoke", "--config.ckpt.keep=0"],
            "config.ckpt.keep=0 is out of range: an integer >= 1",
        ),
        (
            ["--config=configs/qwen3vl_grpo.py:smoke", "--config.rl.loss_norm=-1"],
            "config.rl.loss_norm=-1.0 is out of range: a finite number >= 0",
        ),
        (
            ["--config=configs/qwen3vl_grpo.py:smoke", "--config.sampler.num_pages=32"],
            "config.sampler.max_seq_len=1024 needs 64 KV pages",
        ),
        (
            ["--config=configs/qwen3vl_grpo.py:smoke", "--config.sampler.gpu_kernel=warps=8"],
            "config.sampler.gpu_kernel='warps=8': GPU kernel option 'warps=8'",
        ),
        (
            [
                "--config=configs/qwen3vl_grpo.py:smoke",
                "--config.model.attn_impl=splash",
                "--config.model.attn_block=384",
            ],
            "attn_block=384 tokens: the block must be a multiple of 128 and divide every "
            "config.rl.row_lengths entry (these do not: [512, 1024])",
        ),
        (
            ["--config=configs/qwen3vl_grpo.py:smoke", "--config.model.attn_impl=flash"],
            "config.model.attn_impl='flash' is not one of xla, splash",
        ),
        (  # a traceback from train.py's dict(t) before (the other bad task files: test_tasks.py)
            ["--config=configs/qwen3vl_grpo.py:smoke", "--config.tasks=junk"],
            "config.tasks: source #0 must be a dict like {'source_type': 'builtin'}, got str",
        ),
        (
            [
                "--config=configs/qwen3vl_grpo.py:smoke",
                "--config.rl.algorithm=sdpo",
                "--config.rl.sdpo_feedback=final_screenshot,hint",
            ],
            "config.rl.sdpo_feedback='final_screenshot,hint': use some of",
        ),
    ],
)
def test_bad_command_line_fails_at_start(args, expected):
    r = _launch(*args)
    assert r.returncode == 2, r.stderr
    assert "launch/tpu.py: error:" in r.stderr
    assert expected in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_workdir_task_file_and_mesh_fail_with_one_line(tmp_path):
    """Problems found only once the run starts (a workdir that is a file, a malformed task
    file, a mesh the model cannot be divided over) are one line too, exit 2, no traceback."""
    afile = tmp_path / "afile"
    afile.write_text("")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"bad json\n')
    smoke = "--config=configs/qwen3vl_grpo.py:smoke"
    cases = [
        ([smoke, f"--workdir={afile}"], f"--workdir={afile} exists and is not a directory", {}),
        (
            [smoke, f"--config.tasks=({{'source_type': 'file', 'path': '{tasks}'}},)"],
            f"{tasks}:1: not valid JSON",
            {},
        ),
        (
            [smoke, "--config.mesh.tensor=3", "--config.mesh.fsdp=1"],
            "is not divisible by mesh axes tensor (size 3)",
            {"XLA_FLAGS": "--xla_force_host_platform_device_count=3"},
        ),
    ]
    for args, expected, env in cases:
        r = subprocess.run(
            [sys.executable, os.path.join(ROOT, "launch", "tpu.py"), *args]
            + ([] if any(a.startswith("--workdir") for a in args) else [f"--workdir={tmp_path}/w"]),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **env},
        )
        assert r.returncode == 2, (args, r.stderr[-3000:])
        assert "launch/tpu.py: error: " in r.stderr and expected in r.stderr, r.stderr[-3000:]
        assert "Traceback" not in r.stderr, r.stderr[-3000:]


def test_a_bad_value_is_refused_before_jax_loads():
    """The launcher checks the config's values with modules that load no JAX (the config's
    checks, the task sources), so a bad value fails in about half a second, not after the
    trainer's imports (3-4 s on this machine)."""
    code = (
        "import sys\n"
        "import launch.process\n"
        "assert 'jax' not in sys.modules and 'flax' not in sys.modules, "
        "sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax'))[:5]\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
