r"""Offline step-level evaluation (AgentNetBench style): predicted vs gold action per recorded
step, no environment (`cua_jax.evaluation.offline` has the matching rules).

    # the run's model on its own oracle demos (WORKDIR/sft_demos), or the oracle / random baselines
    python tools/offline_eval.py --workdir=/tmp/cua_smoke [--step=N] \
        --demos=/tmp/cua_smoke/sft_demos [--out=report.json]
    python tools/offline_eval.py --workdir=/tmp/cua_smoke --demos=... --policy=random
    # any agent on JSONL steps (screenshot + gold action per line; see steps_from_jsonl)
    python tools/offline_eval.py --config=configs/qwen3vl_grpo.py:8b --steps=steps.jsonl \
        --policy=openai --base_url=http://127.0.0.1:8000/v1 --model=qwen3-vl-8b

Prints the step accuracy with its 95% interval, per gold action type and per task; --out writes
the same as JSON. --radius is the click tolerance in screen fractions (when a step has no box).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from configs.common import load_run_config  # noqa: E402  (these load without JAX)
from cua_jax.evaluation import offline, stats  # noqa: E402
from tools.agents import OpenAIAgent, agent_predictor  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config with a preset (or --workdir).")
_WORKDIR = flags.DEFINE_string("workdir", None, "A training run (its config and checkpoint).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of --workdir (default: the latest).")
_DEMOS = flags.DEFINE_string("demos", None, "A trajectory directory (e.g. WORKDIR/sft_demos).")
_STEPS = flags.DEFINE_string("steps", None, "A JSONL file of screenshot + gold action steps.")
_POLICY = flags.DEFINE_enum(
    "policy", "model", ["model", "oracle", "random", "openai"], "Who predicts."
)
_BASE_URL = flags.DEFINE_string("base_url", None, "--policy=openai: the endpoint.")
_MODEL = flags.DEFINE_string("model", None, "--policy=openai: the model id.")
_API_KEY = flags.DEFINE_string("api_key", None, "--policy=openai: token ($OPENAI_API_KEY).")
_RADIUS = flags.DEFINE_float("radius", 0.05, "Click tolerance, screen fractions.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of --policy=random.")
_OUT = flags.DEFINE_string("out", None, "Write the report here as JSON.")


def fail(msg: str):
    """One error line on stderr and exit status 2."""
    print(f"tools/offline_eval.py: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def format_report(report, title: str) -> str:
    """The report as text: overall accuracy with its interval, then by action kind and, when few
    enough, by task."""
    lo, hi = report.interval
    lines = [
        f"{title}: {report.correct}/{report.n} steps correct = {report.accuracy:.3f} "
        f"[{lo:.3f}, {hi:.3f}]",
        "",
        stats.format_table(report.by_kind),
    ]
    if len(report.by_task) <= 50:
        lines += ["", stats.format_table(report.by_task)]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """The command line: runs what the module docstring describes."""
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    if (_DEMOS.value is None) == (_STEPS.value is None):
        fail("pass exactly one of --demos (a trajectory directory) or --steps (a JSONL file)")
    if (_WORKDIR.value is None) == (_CONFIG.value is None):
        fail("pass exactly one of --workdir (a training run) or --config (a preset)")
    if _WORKDIR.value is not None:
        try:
            config = load_run_config(_WORKDIR.value)
        except FileNotFoundError as e:
            fail(str(e))
    else:
        config = _CONFIG.value
    policy = _POLICY.value
    if (policy == "openai") != (_BASE_URL.value is not None):
        fail("--base_url goes with --policy=openai (and --policy=openai needs it)")

    from cua_jax.job import builders  # loads JAX (so does loading)
    from cua_jax.job.loading import build_processor, load_policy

    fmt_name = config.env.action_format
    processor = build_processor(config)
    try:
        if _DEMOS.value is not None:
            from cua_jax.rl.store import TrajectoryReader

            steps = offline.steps_from_trajectories(
                TrajectoryReader(_DEMOS.value), processor, fmt_name
            )
        else:
            steps = offline.steps_from_jsonl(_STEPS.value, fmt_name)
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    if not steps:
        fail("no gold step found (only successful episodes' trained, parseable turns count)")

    close = None
    if policy == "oracle":
        predictor = offline.oracle_predictor(fmt_name)
    elif policy == "random":
        predictor = offline.random_click_predictor(_SEED.value)
    elif policy == "model":
        if _STEPS.value is not None:
            fail(
                "--policy=model predicts on recorded prompts (--demos); for screenshot steps "
                "serve it (tools/serve.py) and use --policy=openai"
            )
        from cua_jax.checkpoint.orbax_io import CheckpointError

        try:
            model, processor, _, mesh, rules = load_policy(config, _WORKDIR.value, _STEP.value)
        except CheckpointError as e:
            fail(str(e))
        engine = builders.build_engine(model, config, processor.tokenizer, mesh=mesh, rules=rules)
        predictor = offline.engine_predictor(
            engine,
            processor,
            fmt_name,
            max_new_tokens=config.rl.max_tokens,
            banned_token_ids=model.config.vision_placeholder_ids,
        )
    else:
        agent = OpenAIAgent(
            _BASE_URL.value, _MODEL.value, _API_KEY.value or os.environ.get("OPENAI_API_KEY")
        )
        predictor = agent_predictor(agent, processor, config)
        close = agent.close

    async def run():
        try:
            return await offline.evaluate_steps(steps, predictor, radius=_RADIUS.value)
        finally:
            if close is not None:
                await close()

    report = asyncio.run(run())
    print(format_report(report, f"{policy} on {_DEMOS.value or _STEPS.value}"))
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump({"policy": policy, "radius": _RADIUS.value, **report.to_json()}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
