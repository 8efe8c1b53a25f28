"""tools/bench_setup.py, the set-up the benchmark scripts share, against hand numbers; and every
bench script still imports (their set-up now comes from that one module)."""

import importlib
import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tools import bench_setup

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"


class FakeClock:
    """A perf_counter whose every second call (a timing's end) is the next of `durations` later."""

    def __init__(self, durations):
        self.now, self.durations, self.started = 0.0, list(durations), False

    def __call__(self):
        if self.started:
            self.now += self.durations.pop(0)
        self.started = not self.started
        return self.now


def test_timed_rounds_interleaves_and_takes_medians(monkeypatch):
    calls = []
    # Round 1: a 1 s, b 5 s; round 2: a 3 s, b 4 s; round 3: a 2 s, b 9 s.
    monkeypatch.setattr(bench_setup.time, "perf_counter", FakeClock([1, 5, 3, 4, 2, 9]))
    med = bench_setup.timed_rounds(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3
    )
    assert calls == ["a", "b"] * 3
    assert med == {"a": 2.0, "b": 5.0}


def test_median_s(monkeypatch):
    monkeypatch.setattr(bench_setup.time, "perf_counter", FakeClock([0.5, 0.1, 0.3, 0.9]))
    assert bench_setup.median_s(lambda: None, 4) == pytest.approx(0.4)


def test_compile_and_time_reads_scratch_and_skips_the_first_call(monkeypatch):
    steps = []
    compiled = SimpleNamespace(memory_analysis=lambda: SimpleNamespace(temp_size_in_bytes=1234))
    learner = SimpleNamespace(
        lower_step=lambda batch: SimpleNamespace(compile=lambda: compiled),
        train_step=lambda batch: steps.append(batch) or {"loss": len(steps)},
    )
    # compile 7 s, then steps of 10 s (first), 1, 3, 2 s.
    monkeypatch.setattr(bench_setup.time, "perf_counter", FakeClock([7, 10, 1, 3, 2]))
    temp, compile_s, step_s, metrics = bench_setup.compile_and_time(learner, "B", 3)
    assert (temp, compile_s, step_s, metrics) == (1234, 7, 2, {"loss": 4})
    assert steps == ["B"] * 4


def test_pin_cpu_threads(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--before")
    assert bench_setup.pin_cpu_threads(0) == (os.cpu_count() or 1)
    assert os.environ["XLA_FLAGS"] == "--before"  # all cores: XLA's default, nothing pinned
    assert bench_setup.pin_cpu_threads(3) == 3
    flags = os.environ["XLA_FLAGS"].split()
    assert flags == [
        "--before",
        "--xla_cpu_multi_thread_eigen=true",
        "intra_op_parallelism_threads=3",
    ]
    monkeypatch.setenv("XLA_FLAGS", "")
    bench_setup.pin_cpu_threads(1)
    assert "--xla_cpu_multi_thread_eigen=false" in os.environ["XLA_FLAGS"]


def test_cpu_unless_set(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    bench_setup.cpu_unless_set()
    assert os.environ["JAX_PLATFORMS"] == "tpu"
    monkeypatch.delenv("JAX_PLATFORMS")
    bench_setup.cpu_unless_set()
    assert os.environ["JAX_PLATFORMS"] == "cpu"


@pytest.mark.parametrize("name", sorted(p.stem for p in TOOLS.glob("bench_*.py")))
def test_every_bench_script_imports(name):
    path = TOOLS / f"{name}.py"
    if "DEFINE_" in path.read_text():
        # a script with absl flags: in a fresh interpreter (this worker may hold launch.tpu's
        # flags of the same names, e.g. --config)
        r = subprocess.run(
            [sys.executable, "-c", f"import tools.{name}"],
            cwd=TOOLS.parent,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-2000:]
    else:
        importlib.import_module(f"tools.{name}")


def test_round_times_keeps_every_round_and_the_last_results(monkeypatch):
    monkeypatch.setattr(bench_setup.time, "perf_counter", FakeClock([1, 5, 3, 4]))
    n = iter(range(10))
    seen = []
    times, last = bench_setup.round_times(
        {"a": lambda: next(n), "b": lambda: next(n)},
        2,
        after_round=lambda t: seen.append({k: list(v) for k, v in t.items()}),
    )
    assert times == {"a": [1, 3], "b": [5, 4]}
    assert last == {"a": 2, "b": 3}
    assert seen == [{"a": [1], "b": [5]}, {"a": [1, 3], "b": [5, 4]}]
    # another clock: only it is read
    med = bench_setup.timed_rounds({"a": lambda: None}, 3, clock=FakeClock([2, 9, 4]))
    assert med == {"a": 4}


def test_timed_and_timed_calls(monkeypatch):
    monkeypatch.setattr(bench_setup.time, "perf_counter", FakeClock([0.25, 1, 2, 3]))
    assert bench_setup.timed(lambda: "x") == ("x", 0.25)
    n = iter(range(10))
    assert bench_setup.timed_calls(lambda: next(n), 3) == ([1, 2, 3], 2)


def test_median_ratio_and_flags(monkeypatch):
    assert bench_setup.median_ratio([2, 9, 3], [1, 3, 2]) == 2.0
    monkeypatch.setenv("XLA_FLAGS", "--a")
    bench_setup.add_xla_flags(bench_setup.host_devices_flag(8), bench_setup.eigen_flag(1))
    assert os.environ["XLA_FLAGS"].split() == [
        "--a",
        "--xla_force_host_platform_device_count=8",
        "--xla_cpu_multi_thread_eigen=false",
    ]


def test_arg_parser_describes_by_the_first_line_or_paragraph():
    doc = "One line\nand its rest.\n\nMore."
    assert bench_setup.arg_parser(doc).description == "One line"
    assert bench_setup.arg_parser(doc, paragraph=True).description == "One line\nand its rest."
