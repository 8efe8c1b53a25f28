r"""Greedy evaluation of a policy on a task source: a training run's checkpoint, a local Hugging
Face checkpoint, or a preset at random init. No training, no optimizer.

    python tools/eval.py --workdir=/tmp/cua_smoke [--step=N|best] [--tasks=JSON] [--out=DIR]
    python tools/eval.py --config=configs/qwen3vl_grpo.py:8b \
        --config.model.hf_path=/ckpts/Qwen3-VL-8B-Instruct \
        --tasks='{"source_type": "miniwob", "names": ["click-button", "click-tab"]}' --out=DIR

With --workdir the run's own config (`WORKDIR/config.json`) rebuilds the model, sampler, env and
prompt settings and the checkpoint at --step (default: the latest) is restored; the same step of
the same run on the same tasks gives the success rate its training-time eval logged. With
--config (and `--config.a.b=value` overrides, as in launch/tpu.py) the model is the config's:
`model.hf_path`, or random init for the tiny presets. --tasks is a task-source dict or a list of
them, as JSON (default: the config's `eval_tasks`).

Agents (`tools/agents.py`): --agent=checkpoint (default) plays the policy above with the
project's sampler; --agent=openai plays any OpenAI-compatible endpoint instead (tools/serve.py,
vLLM serving Qwen-VL or OpenCUA, ...) with the config's prompt, action format and env;
--agent=anthropic plays Anthropic's computer-use tool (--model, $ANTHROPIC_API_KEY):

    python tools/eval.py --config=configs/qwen3vl_grpo.py:8b --agent=openai \
        --base_url=http://127.0.0.1:8000/v1 --model=qwen3-vl-8b --out=DIR
    # (the key: --api_key, else $OPENAI_API_KEY; the model's weights are not loaded here, only
    # its processor: model.hf_path's, or the shipped tokenizer for the tiny presets)

Writes OUT/eval.json (success overall and per category with a 95% Wilson interval, per-task
results), OUT/episodes.html (screenshots with the clicks drawn on them, model outputs,
feedback) and OSWorld-style per-episode folders under --result_dir (default OUT/results:
`tools/show_results.py OUT/results` summarizes them, `--compare=OTHER` puts two agents side by
side). --samples=N plays every task N times with sampling (--temperature) and adds pass@k
(unbiased, k = 1, 2, 4, ... N) to eval.json. OUT defaults to WORKDIR/eval/step_N.
OSWorld's own task lists: --osworld_meta=evaluation_examples/test_all.json (`{domain: [ids]}`;
the task files under `examples/` beside it, or --osworld_examples) with --domain=all|NAME[,NAME]
and --config.env.kind=vm plays those tasks and writes OSWorld's result layout,
`RESULT_DIR/<action_space>/<observation_type>/<model>/<domain>/<id>/result.txt` (--action_space,
--observation_type; <model> is --model, else step_N), which `tools/show_results.py RESULT_DIR
--model=M` reads as OSWorld's show_result.py does:

    python tools/eval.py --config=configs/qwen3vl_grpo.py:8b --config.env.kind=vm \
        --agent=openai --base_url=http://127.0.0.1:8000/v1 --model=cua --out=DIR \
        --osworld_meta=OSWorld/evaluation_examples/test_all.json --domain=os,chrome

An eval that measured nothing (most episodes infrastructure faults, e.g. an endpoint that does
not serve --model; or a number that is NaN) exits 1 naming the cause: it writes
OUT/eval.failed.json, and eval.json and the database keep the last good result.
The episodes also go to the trajectory database (`tools/monitor.py`, tag tools_step_N or
tools_agent_MODEL): with --workdir the run's own, else OUT/trajectories.sqlite (or
`log.db_url` / $DATABASE_URL) as a run of kind "eval"; none when the config has `log.db=False`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import sys
import time
from types import SimpleNamespace
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

# What loads here is JAX-free (a bad flag fails fast); the model, the sampler and the config
# checks load inside the functions that need them.
from configs.common import load_run_config  # noqa: E402
from cua_jax import metrics as metrics_lib  # noqa: E402
from cua_jax.evaluation import results as results_lib  # noqa: E402
from cua_jax.evaluation import stats, verdict  # noqa: E402
from cua_jax.rl.rollout import AgentLoop, episode_seed  # noqa: E402
from launch import compose  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file with a preset (instead of --workdir): configs/FILE.py:PRESET"
)
_WORKDIR = flags.DEFINE_string("workdir", None, "A training run's directory (its checkpoint).")
_STEP = flags.DEFINE_string(
    "step",
    None,
    "Checkpoint step of --workdir (default: the latest), or 'best': the RL phase's best in-run "
    "eval (summary.json's eval_best_step; the in-run eval tasks are the validation set).",
)
_TASKS = flags.DEFINE_string(
    "tasks", None, "Task source(s) as JSON: a dict or a list of dicts (default: eval_tasks)."
)
_OUT = flags.DEFINE_string("out", None, "Output directory (default: WORKDIR/eval/step_N).")
_CONCURRENCY = flags.DEFINE_integer("concurrency", None, "Environments at once (default: config).")
_LOG_EPISODES = flags.DEFINE_integer("log_episodes", 32, "Episodes written to episodes.html.")
_AGENT = flags.DEFINE_enum(
    "agent",
    "checkpoint",
    ["checkpoint", "openai", "anthropic"],
    "Who plays: the policy, an OpenAI-compatible endpoint, or Anthropic's computer-use API.",
)
_BASE_URL = flags.DEFINE_string(
    "base_url", None, "--agent=openai: the endpoint, e.g. http://127.0.0.1:8000/v1"
)
_MODEL = flags.DEFINE_string("model", None, "--agent=openai|anthropic: the model id to ask for.")
_API_KEY = flags.DEFINE_string(
    "api_key", None, "The endpoint's key (default $OPENAI_API_KEY / $ANTHROPIC_API_KEY)."
)
_SAMPLES = flags.DEFINE_integer(
    "samples", 0, "Sampled episodes per task, for pass@k up to it (0: one greedy episode)."
)
_TEMPERATURE = flags.DEFINE_float(
    "temperature", None, "With --samples: the sampling temperature (default rl.temperature)."
)
_RESULT_DIR = flags.DEFINE_string(
    "result_dir", None, "OSWorld-style per-episode folders (default OUT/results)."
)
_OSWORLD_META = flags.DEFINE_string(
    "osworld_meta",
    None,
    "OSWorld's meta file ({domain: [ids]}, e.g. evaluation_examples/test_all.json): its tasks "
    "instead of --tasks, results in OSWorld's layout under --result_dir.",
)
_OSWORLD_EXAMPLES = flags.DEFINE_string(
    "osworld_examples", None, "With --osworld_meta: the task files (default: examples/ beside it)."
)
_DOMAIN = flags.DEFINE_string(
    "domain", "all", "With --osworld_meta: the domain(s) to run, comma-separated, or 'all'."
)
_ACTION_SPACE = flags.DEFINE_string(
    "action_space", "pyautogui", "With --osworld_meta: <action_space> of the result layout."
)
_OBSERVATION_TYPE = flags.DEFINE_string(
    "observation_type", "screenshot", "With --osworld_meta: <observation_type> of the layout."
)


class EvalError(SystemExit):
    """A bad command line: one clear line on stderr, exit status 2."""

    def __init__(self, msg: str):
        print(f"tools/eval.py: error: {msg}", file=sys.stderr)
        super().__init__(2)


def checkpoint_step(value: str | None, workdir: str | None) -> int | None:
    """--step as a checkpoint step (`cua_jax.job.loading.checkpoint_step`)."""
    from cua_jax.job.loading import checkpoint_step as resolve

    try:
        return resolve(value, workdir)
    except ValueError as e:
        raise EvalError(str(e)) from None


def _load_config():
    if (_WORKDIR.value is None) == (_CONFIG.value is None):
        raise EvalError("pass exactly one of --workdir (a training run) or --config (a preset)")
    if _WORKDIR.value is not None:
        try:
            config = load_run_config(_WORKDIR.value)
        except FileNotFoundError as e:
            raise EvalError(str(e)) from None
    else:
        if _STEP.value is not None:
            raise EvalError("--step needs --workdir (a --config model has no checkpoints)")
        config = _CONFIG.value
        if _OUT.value is None:
            raise EvalError("--out is required with --config")
    if _OSWORLD_META.value is not None:
        if _TASKS.value is not None:
            raise EvalError("--osworld_meta and --tasks both pick the tasks: pass one of them")
        if config.env.kind != "vm":
            raise EvalError("OSWorld's tasks run on desktops: add --config.env.kind=vm")
        tasks = [osworld_meta_source()]
    elif _TASKS.value is not None:
        try:
            tasks = json.loads(_TASKS.value)
        except json.JSONDecodeError as e:
            raise EvalError(f"--tasks is not JSON ({e}): {_TASKS.value!r}") from None
        tasks = [tasks] if isinstance(tasks, dict) else tasks
    else:
        tasks = [dict(t) for t in config.eval_tasks]
    return config, tasks


def osworld_meta_source() -> dict:
    """The task source of --osworld_meta, --osworld_examples and --domain."""
    meta = os.path.abspath(_OSWORLD_META.value)
    if not os.path.isfile(meta):
        raise EvalError(f"--osworld_meta={_OSWORLD_META.value}: no such file")
    examples = _OSWORLD_EXAMPLES.value or os.path.join(os.path.dirname(meta), "examples")
    domains = [d.strip() for d in _DOMAIN.value.split(",") if d.strip()]
    return {
        "source_type": "osworld",
        "path": examples,
        "meta": meta,
        "domains": domains or ["all"],
        "skip_unsupported": True,  # one line names what was skipped and why
    }


def osworld_result_dir(root: str, model: str) -> str:
    """OSWorld's `root/<action_space>/<observation_type>/<model>` (model made one path part)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", model).strip("._") or "model"
    return os.path.join(root, _ACTION_SPACE.value, _OBSERVATION_TYPE.value, name)


async def _sampled_episodes(agent, pool, played, seed, screens, on_episode):
    """Sampled episodes of the checkpoint (one per entry of `played`, each its own seed)."""
    per = [[] for _ in played]
    screens.extend(per)

    async def one(j, task):
        async with pool.acquire() as env:
            traj = await agent.run_episode(
                env, task, seed=episode_seed(seed, j), group_id=f"eval/{j}", screens=per[j]
            )
        on_episode(traj)
        return traj

    return list(await asyncio.gather(*(one(j, t) for j, t in enumerate(played))))


def _check_flags() -> None:
    """The flag combinations that make no eval, before anything heavy is loaded."""
    try:
        verdict.check_sampling(_SAMPLES.value, _TEMPERATURE.value)
    except ValueError as e:
        raise EvalError(str(e)) from None
    if _AGENT.value == "openai" and _BASE_URL.value is None:
        raise EvalError("--agent=openai needs --base_url (e.g. http://127.0.0.1:8000/v1)")
    if _AGENT.value == "checkpoint" and _BASE_URL.value is not None:
        raise EvalError("--base_url goes with --agent=openai or --agent=anthropic")
    if _AGENT.value == "anthropic" and not _MODEL.value:
        raise EvalError("--agent=anthropic needs --model")
    if _AGENT.value != "checkpoint" and _STEP.value is not None:
        raise EvalError("--step picks a checkpoint; with --agent=openai the endpoint plays")


def _load_tasks(config, task_sources):
    """The validated config's env factory and the tasks of `task_sources`."""
    from cua_jax.config.checks import ConfigError, validate_config  # loads JAX

    try:
        validate_config(config)
    except ConfigError as e:
        raise EvalError(str(e)) from None
    compose.enable_compile_cache(config.get("compile_cache_dir"))
    if _CONCURRENCY.value is not None:
        config.env.concurrency = _CONCURRENCY.value
    try:
        env_factory, load_tasks = compose.build_env_factory(config)
        tasks = load_tasks(task_sources)
    except (ValueError, FileNotFoundError) as e:
        raise EvalError(str(e)) from None
    if not tasks:
        raise EvalError(f"the task source(s) {task_sources} hold no task")
    return env_factory, tasks


@dataclasses.dataclass
class Player:
    """Who plays the episodes: the project's agent loop over a checkpoint's policy, or over a
    remote endpoint (`remote`), with the prompt and action settings of the config."""

    agent: Any  # AgentLoop | tools.agents.AgentEvalLoop
    processor: Any
    settings: Any  # RolloutSettings
    name: str  # eval.json's "agent"
    tag: str  # step_N | agent_MODEL: the default output directory and the database tag
    step: int | None = None  # the checkpoint's step (None: an endpoint plays)
    remote: Any = None  # tools.agents.OpenAIAgent | AnthropicAgent

    def texts(self, trajs) -> list[list[str]]:
        """Each turn's generated text (the policy's ids decoded, stop tokens dropped)."""
        stop = set(self.processor.tokenizer.stop_ids)
        decode = self.processor.tokenizer.decode
        return [
            [decode([int(i) for i in t.generated_ids if i not in stop]) for t in traj.turns]
            for traj in trajs
        ]


def _player(config) -> Player:
    """--agent's player: the endpoint (only the processor is loaded: coordinates, recorded ids)
    or the checkpoint's policy on the project's sampler."""
    from cua_jax.job import builders

    if _AGENT.value != "checkpoint":
        from cua_jax.job.loading import build_processor
        from tools.agents import AgentEvalLoop, AnthropicAgent, OpenAIAgent

        processor = build_processor(config)
        no_model = SimpleNamespace(config=SimpleNamespace(vision_placeholder_ids=()))
        settings = builders.build_rollout_settings(config, no_model)
        if _AGENT.value == "openai":
            key = _API_KEY.value or os.environ.get("OPENAI_API_KEY")
            remote = OpenAIAgent(_BASE_URL.value, _MODEL.value, key)
        else:
            key = _API_KEY.value or os.environ.get("ANTHROPIC_API_KEY")
            url = _BASE_URL.value or "https://api.anthropic.com"
            remote = AnthropicAgent(url, _MODEL.value, key)
        tag = "agent_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", _MODEL.value or _BASE_URL.value)
        agent = AgentEvalLoop(processor, settings)
        return Player(agent, processor, settings, remote.name, tag, remote=remote)
    from cua_jax.checkpoint.orbax_io import CheckpointError
    from cua_jax.job.loading import load_policy

    try:
        model, processor, step, mesh, rules = load_policy(
            config, _WORKDIR.value, checkpoint_step(_STEP.value, _WORKDIR.value)
        )
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    settings = builders.build_rollout_settings(config, model)
    engine = builders.build_engine(model, config, processor.tokenizer, mesh=mesh, rules=rules)
    name = f"checkpoint:{_WORKDIR.value or config.model.get('hf_path') or 'init'}"
    agent = AgentLoop(engine, processor, settings)
    return Player(agent, processor, settings, name, f"step_{step}", step)


async def _play(player: Player, env_factory, tasks, played, n_samples: int, seed: int, on_episode):
    """Plays `played` (each task once greedily, or n_samples times sampled): the trajectories,
    each episode's screenshots and each turn's text."""
    screens: list = []
    async with env_factory() as pool:
        if player.remote is not None:
            try:
                trajs, texts = await player.agent.evaluate_agent(
                    pool, played, player.remote, seed=seed, screens=screens, on_episode=on_episode
                )
            finally:
                await player.remote.close()
            return trajs, screens, texts
        if n_samples:
            trajs = await _sampled_episodes(player.agent, pool, played, seed, screens, on_episode)
        else:
            trajs = await player.agent.evaluate(
                pool, tasks, seed=seed, screens=screens, on_episode=on_episode
            )
    return trajs, screens, player.texts(trajs)


def _pass_at_k(trajs, n_samples: int) -> dict[str, float]:
    """Unbiased pass@k (k = 1, 2, 4, ... n_samples) from n_samples episodes a task, each in
    order; a task's infrastructure faults are not samples."""
    per_task = [
        (sum(not t.infra_fault for t in g), sum(t.success for t in g if not t.infra_fault))
        for g in (trajs[i : i + n_samples] for i in range(0, len(trajs), n_samples))
    ]
    per_task = [(n, c) for n, c in per_task if n > 0]
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, 128, n_samples) if k <= n_samples})
    return {
        str(k): stats.mean_pass_at_k([(n, c) for n, c in per_task if n >= k], k)
        for k in ks
        if any(n >= k for n, _ in per_task)
    }


def _write_episodes(result_dir, player: Player, trajs, played, screens, texts, n_samples) -> str:
    """OSWorld-style per-episode folders under `result_dir` (with --osworld_meta, in OSWorld's
    own layout under it); returns the folder the episodes went to."""
    osworld_layout = _OSWORLD_META.value is not None
    if osworld_layout:  # <domain>/<OSWorld's task id>/ under <action_space>/<obs>/<model>/
        result_dir = osworld_result_dir(result_dir, _MODEL.value or player.tag)
    for j, (traj, task, shots, tx) in enumerate(zip(trajs, played, screens, texts, strict=True)):
        if osworld_layout:
            task = dataclasses.replace(task, id=str(task.spec.get("id", task.id)))
        sample = j % n_samples if n_samples else None
        results_lib.write_episode(
            result_dir, task, traj, shots, tx, agent=player.name, sample=sample
        )
    return result_dir


def main(argv: list[str]) -> None:
    """The evaluation the flags ask for (module docstring); a bad flag or config exits 2."""
    if len(argv) > 1:
        raise EvalError(f"unexpected positional arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    config, task_sources = _load_config()
    _check_flags()
    from cua_jax.evaluation import episodes  # loads JAX

    env_factory, tasks = _load_tasks(config, task_sources)
    player = _player(config)
    out_dir = _OUT.value or os.path.join(_WORKDIR.value, "eval", player.tag)
    os.makedirs(out_dir, exist_ok=True)
    n_samples = _SAMPLES.value
    temperature = player.settings.temperature if _TEMPERATURE.value is None else _TEMPERATURE.value
    played = list(tasks)
    if n_samples:  # every task n times, sampled; pass@k from them
        played = [t for t in tasks for _ in range(n_samples)]
        player.settings = dataclasses.replace(player.settings, temperature=temperature)
        player.agent.settings = player.settings
        if hasattr(player.remote, "temperature"):
            player.remote.temperature = temperature
    bar = metrics_lib.Progress(len(played), desc="eval")
    done: list[float] = []

    def on_episode(traj) -> None:
        done.append(float(traj.success))
        bar.update(1, success=sum(done) / len(done))

    t0 = time.perf_counter()
    trajs, screens, texts = asyncio.run(
        _play(player, env_factory, tasks, played, n_samples, config.seed, on_episode)
    )
    bar.close()
    result_dir = _write_episodes(
        _RESULT_DIR.value or os.path.join(out_dir, "results"),
        player,
        trajs,
        played,
        screens,
        texts,
        n_samples,
    )
    ran = [t for t in trajs if not t.infra_fault]
    extra = {}
    if n_samples:
        extra = {
            "samples": n_samples,
            "temperature": temperature,
            "pass_at_k": _pass_at_k(trajs, n_samples),
        }
    source = player.name
    if player.remote is None:
        source = _WORKDIR.value or config.model.get("hf_path") or f"{config.preset} (random init)"
    result = {
        "source": source,
        "agent": player.name,
        "result_dir": result_dir,
        "success_ci95": list(stats.wilson_interval(sum(t.success for t in ran), len(ran))),
        **extra,
        "step": player.step,
        "tasks": task_sources,
        "num_tasks": len(tasks),
        **episodes.success_by_category(trajs, played),
        "wall_s": time.perf_counter() - t0,
        "episodes": [
            {
                "task_id": t.task_id,
                "category": task.category,
                "success": bool(t.success),
                "score": t.score,
                "turns": len(t.turns),
                "invalid_actions": t.timings.get("invalid_actions", 0.0),
                "failure_reason": t.failure_reason,
            }
            for t, task in zip(trajs, played, strict=True)
        ],
    }
    # A result that measured nothing never replaces the last good eval.json or database row.
    failure = verdict.eval_failure(result, trajs)
    written = verdict.write_result(out_dir, result, failure)
    if failure is not None:
        print(
            f"tools/eval.py: error: the eval failed: {failure}; {written} holds what ran, "
            f"{out_dir}/{verdict.RESULT_FILE} and the database were left as they were",
            file=sys.stderr,
        )
        raise SystemExit(1)
    _log_to_database(
        config, out_dir, player.step, player.tag, trajs, played, screens, result, player.processor
    )
    n = _LOG_EPISODES.value
    episodes.write_episodes(
        os.path.join(out_dir, "episodes.html"),
        list(zip(trajs[:n], screens[:n], strict=True)),
        player.processor.tokenizer.decode,
        f"eval of {result['source']} step {player.step}: success {result['eval/success']:.3f}",
    )
    _print_summary(result, out_dir, result_dir, len(tasks))


def _print_summary(result: dict, out_dir: str, result_dir: str, num_tasks: int) -> None:
    cats = ", ".join(
        f"{k.removeprefix('eval/success/')}: {v:.2f}"
        for k, v in result.items()
        if k.startswith("eval/success/")
    )
    show = f"tools/show_results.py {result_dir}"
    if _OSWORLD_META.value is not None:
        root = _RESULT_DIR.value or os.path.join(out_dir, "results")
        show = (
            f"tools/show_results.py {root} --action_space={_ACTION_SPACE.value} "
            f"--observation_type={_OBSERVATION_TYPE.value} --model={os.path.basename(result_dir)}"
        )
    print(
        f"eval success {result['eval/success']:.3f} over {num_tasks} tasks ({cats}); "
        f"wrote {out_dir}/eval.json and episodes.html; per-episode folders in {result_dir} "
        f"({show})"
    )


def _log_to_database(config, out_dir, step, tag, trajs, played, screens, result, processor):
    """The eval's episodes in the trajectory database (tools/monitor.py): with --workdir, the
    training run's database and run row (its status untouched), else OUT's own run of kind
    "eval"; `config.log.db=False` writes none."""
    from cua_jax import db as db_lib

    workdir = _WORKDIR.value or out_dir
    db = db_lib.open_run(
        workdir,
        config.log.db_url or None,
        run_name=os.path.basename(os.path.abspath(workdir)),
        config=config.to_dict(),
        kind="eval",
        decode=processor.tokenizer.decode,
        enabled=config.log.db,
    )
    metrics = {k: v for k, v in result.items() if k.startswith("eval/")}
    metrics.update({f"pass_at_k/{k}": v for k, v in result.get("pass_at_k", {}).items()})
    db.log_eval(step or 0, f"tools_{tag}", trajs, played, screens=screens, metrics=metrics)
    db.close("finished")


if __name__ == "__main__":
    app.run(main)
