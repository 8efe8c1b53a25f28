"""The agent loop against a scripted env: transcripts, history window, oracle demos, bad output.

The env here is a small in-process double (a square to click on a 64x64 screen) so the loop's
bookkeeping can be checked exactly; the real browser env runs in tests/test_train_smoke.py.
"""

import asyncio
import contextlib
import dataclasses

import numpy as np
import pytest

from cua_jax import actions as A
from cua_jax.data.processor import QwenVLProcessor
from cua_jax.demos.sft_batches import feedback_demo_samples, oracle_sft_batches
from cua_jax.env_api import (
    INFO_DONE_REASON,
    INFO_INVALID_ACTION,
    CheckerReport,
    EnvError,
    Observation,
    StepResult,
    Task,
)
from cua_jax.models import qwen_vl
from cua_jax.rl import sdpo
from cua_jax.rl.learner import Learner
from cua_jax.rl.policies import OraclePolicy
from cua_jax.rl.rollout import (
    OMITTED_SCREENSHOT,
    AgentLoop,
    RolloutSettings,
    _Transcript,
    count_infra_faults,
    default_reward,
    render_transcript,
)
from cua_jax.rl.trajectory import (
    Trajectory,
    rope_position_fn,
    text_position_ids,
    trajectory_to_samples,
)
from cua_jax.sampler import Engine
from cua_jax.sampler.scheduler import prompt_inputs

W = H = 64


class SquareEnv:
    """Click the square, then say done. Screens differ per step so screenshots are distinct."""

    def __init__(self):
        self.steps = 0
        self.hit = False
        self.actions = []

    def _obs(self):
        img = np.full((H, W, 3), 30 * self.steps % 255, np.uint8)
        img[40:56, 8:24] = (255, 0, 0)
        return Observation(img, "click the red square")

    async def reset(self, task, seed=None):
        self.steps, self.hit, self.actions = 0, False, []
        return self._obs()

    async def step(self, action):
        self.steps += 1
        self.actions.append(action)
        info = {}
        done = False
        if isinstance(action, A.InvalidAction):
            info[INFO_INVALID_ACTION] = action.reason
        elif isinstance(action, A.Click):
            self.hit |= 8 <= action.x < 24 and 40 <= action.y < 56
        elif isinstance(action, A.Done):
            done = True
            info[INFO_DONE_REASON] = "done"
        return StepResult(self._obs(), done, 0.0, info)

    async def evaluate(self):
        return 1.0 if self.hit else 0.0

    async def oracle_next(self):  # looks at the state, as the browser suite's oracle does
        return [A.Move(30, 30), A.Click(16, 48), A.Done()][min(self.steps, 2)]

    async def close(self):
        pass


class Pool:
    def __init__(self, n):
        self.envs = [SquareEnv() for _ in range(n)]
        self.free = None

    def __len__(self):
        return len(self.envs)

    @contextlib.asynccontextmanager
    async def acquire(self):
        if self.free is None:
            self.free = asyncio.Queue()
            for e in self.envs:
                self.free.put_nowait(e)
        env = await self.free.get()
        try:
            yield env
        finally:
            self.free.put_nowait(env)


TASK = Task(id="square/0", instruction="click the red square", source="test")


@pytest.fixture(scope="module")
def proc():
    return QwenVLProcessor.default("qwen3_vl", max_pixels=64 * 64, min_pixels=32 * 32)


@pytest.fixture(scope="module")
def model(proc):
    tok = proc.tokenizer
    cfg = qwen_vl.tiny(
        "qwen3_vl",
        vocab_size=tok.vocab_size,
        **tok.vision_token_ids(),
    )
    return qwen_vl.init_random(cfg, seed=0)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, max_slots=4, page_size=16, num_pages=512, max_seq_len=2048, decode_chunk=8)


def _loop(engine, proc, **kw):
    settings = RolloutSettings(**{"max_turns": 4, "max_new_tokens": 12, **kw})
    return AgentLoop(engine, proc, settings)


def test_oracle_demo_transcript_and_samples(engine, proc):
    loop = _loop(engine, proc, max_history_images=4)
    (traj,) = asyncio.run(loop.demonstrations(Pool(1), [TASK]))
    assert traj.reward == 1.0 and traj.success and traj.failure_reason is None
    assert len(traj.turns) == 3  # move, click, done
    tok = proc.tokenizer
    for k, turn in enumerate(traj.turns):
        assert turn.extends_previous == (k > 0)
        assert turn.generated_ids[-1] == tok.im_end_id
        text = tok.decode(turn.generated_ids[:-1])
        (act,) = loop.fmt.parse(text, loop.space_for(np.zeros((H, W, 3), np.uint8)))
        assert type(act) is [A.Move, A.Click, A.Done][k]
        # each turn after the first adds exactly one new screenshot (4 merged tokens at 64x64)
        assert turn.image_grid_thw.tolist() == [[1, 4, 4]]
        if k:
            prev = traj.turns[k - 1]
            full = np.concatenate([prev.prompt_ids, prev.generated_ids])
            np.testing.assert_array_equal(turn.prompt_ids[: full.size], full)
    (sample,) = trajectory_to_samples(
        traj, 1.0, rope_position_fn(engine.config)
    )  # one chain -> one sample
    gen_total = sum(t.generated_ids.size for t in traj.turns)
    assert sample.loss_mask.sum() == gen_total
    assert (sample.input_ids == tok.image_pad_id).sum() == 3 * 4


def test_the_tasks_step_budget_ends_the_episode(engine, proc):
    """min(task.max_steps, max_turns) turns: the oracle needs 3, the task allows 2."""
    loop = _loop(engine, proc, max_history_images=4)  # max_turns 4
    short = dataclasses.replace(TASK, max_steps=2)
    (traj,) = asyncio.run(loop.demonstrations(Pool(1), [short]))
    assert len(traj.turns) == 2 and traj.failure_reason == "max_turns"  # move, click; no done


def test_recovery_demo_trains_only_on_the_recovery(engine, proc):
    """A detour makes the first turn a scripted miss (no loss on it); the oracle then recovers
    from the state the miss left."""
    loop = _loop(engine, proc, max_history_images=4)
    pool = Pool(1)
    miss = A.Click(50, 10)
    plain, recovered = asyncio.run(loop.demonstrations(pool, [TASK, TASK], [None, miss]))
    assert recovered.success and recovered.failure_reason is None
    assert [t.trained for t in recovered.turns] == [False, True, True]
    assert [type(a) for t in recovered.turns for a in t.action] == [A.Click, A.Click, A.Done]
    assert recovered.turns[0].action[0].x == pytest.approx(50, abs=1)
    assert [t.trained for t in plain.turns] == [True, True, True]
    (sample,) = trajectory_to_samples(recovered, 1.0, rope_position_fn(engine.config))
    trained = sum(t.generated_ids.size for t in recovered.turns[1:])
    assert sample.loss_mask.sum() == trained
    first = recovered.turns[0]
    start = first.prompt_ids.size
    assert not sample.loss_mask[start : start + first.generated_ids.size].any()
    with pytest.raises(ValueError, match="1 detours for 2 tasks"):
        asyncio.run(loop.demonstrations(pool, [TASK, TASK], [miss]))
    # A callable detour is placed on the screen the episode really has.
    seen = []
    (placed,) = asyncio.run(
        loop.demonstrations(pool, [TASK], [lambda w, h: seen.append((w, h)) or A.Click(50, 10)])
    )
    assert seen == [(W, H)] and placed.success
    assert [t.trained for t in placed.turns] == [False, True, True]


def test_history_window_drops_old_screenshots(engine, proc):
    loop = _loop(engine, proc, max_history_images=1)
    (traj,) = asyncio.run(loop.demonstrations(Pool(1), [TASK]))
    assert [t.extends_previous for t in traj.turns] == [False, False, False]
    tok = proc.tokenizer
    for k, turn in enumerate(traj.turns):
        assert (turn.prompt_ids == tok.image_pad_id).sum() == 4  # only the latest screenshot
        assert turn.image_grid_thw.tolist() == [[1, 4, 4]]
        text = tok.decode(turn.prompt_ids)
        assert text.count(OMITTED_SCREENSHOT) == k
        assert "click the red square" in text  # the instruction always stays
    assert len(trajectory_to_samples(traj, 0.5, rope_position_fn(engine.config))) == 3


def test_sampled_episodes_never_raise_on_garbage(engine, proc):
    """A random tiny model writes garbage: every action is invalid, episodes end at max_turns."""
    loop = _loop(engine, proc, max_history_images=2, max_turns=3)
    pool = Pool(2)
    group = asyncio.run(loop.run_group(pool, TASK, 3, seed=7, group_id="g0"))
    assert len(group) == 3
    for traj in group:
        assert traj.failure_reason == "max_turns" and traj.reward == 0.0
        assert len(traj.turns) == 3
        assert traj.timings["invalid_actions"] >= 3
        for turn in traj.turns:
            assert turn.logprobs.shape == turn.generated_ids.shape
            assert np.all(turn.logprobs <= 0.0)
            assert "Your last action was invalid" in turn.feedback
        assert [t.extends_previous for t in traj.turns] == [False, True, False]
    # same seeds -> same episodes (resumable sampling)
    again = asyncio.run(loop.run_group(Pool(2), TASK, 3, seed=7, group_id="g0"))
    for a, b in zip(group, again, strict=True):
        for ta, tb in zip(a.turns, b.turns, strict=True):
            np.testing.assert_array_equal(ta.generated_ids, tb.generated_ids)


def test_reward_shaping_penalizes_invalid_actions_and_is_pluggable(engine, proc):
    """reward = score - penalty x invalid actions; success, eval and oracle demos keep the task's
    own score; a custom reward_fn sees the finished trajectory and the score."""
    loop = _loop(engine, proc, max_turns=2, invalid_action_penalty=0.25)
    group = asyncio.run(loop.run_group(Pool(2), TASK, 2, seed=7, group_id="p"))
    for traj in group:  # the random model's outputs are all invalid
        assert traj.score == 0.0 and not traj.success
        assert traj.timings["invalid_actions"] == 2
        assert traj.reward == pytest.approx(-0.5)
        # Where the episode's time went: the parts are positive and within the whole.
        parts = [traj.timings[k] for k in ("reset", "prompt", "generate", "env", "evaluate")]
        assert all(t > 0 for t in parts) and sum(parts) <= traj.timings["total"]
    (demo,) = asyncio.run(loop.demonstrations(Pool(1), [TASK]))
    assert demo.score == demo.reward == 1.0 and demo.success
    (ev,) = asyncio.run(loop.evaluate(Pool(1), [TASK]))
    assert ev.reward == ev.score == 0.0

    seen = []

    def reward_fn(traj, score, settings):
        seen.append((len(traj.turns), score, settings.max_turns))
        return 10.0 + score

    custom = AgentLoop(engine, proc, RolloutSettings(max_turns=1, max_new_tokens=12), reward_fn)
    (traj,) = asyncio.run(custom.run_group(Pool(1), TASK, 1, seed=3, group_id="c"))
    assert traj.reward == 10.0 and traj.score == 0.0 and seen == [(1, 0.0, 1)]
    with pytest.raises(ValueError, match="invalid_action_penalty"):
        RolloutSettings(invalid_action_penalty=-1.0)


def test_policy_version_comes_from_the_weights_that_sampled(engine, model):
    """update_params is applied at the engine's next step: the label must follow the tokens."""
    from flax import nnx

    engine.update_params(nnx.state(model), version=5)
    proc = QwenVLProcessor.default("qwen3_vl", max_pixels=W * H, min_pixels=32 * 32)
    loop = _loop(engine, proc, max_turns=1)
    (traj,) = asyncio.run(loop.run_group(Pool(1), TASK, 1, seed=7, group_id="v"))
    assert traj.policy_version == 5


# ---- infrastructure faults ---------------------------------------------------------------------


class ScriptedEngine:
    """A sampler double that writes the given texts in turn (then repeats the last), or fails."""

    def __init__(self, tokenizer, texts, *, version=3, fail=None):
        self.tok, self.texts, self.version, self.fail = tokenizer, texts, version, fail
        self.calls, self.dropped = [], []

    async def generate(
        self, prompt_ids, pixel_values, image_grid_thw, params, session_id, image_hashes=None
    ):
        self.calls.append((session_id, params))
        if self.fail:
            return dataclasses.make_dataclass("Out", ["finish_reason", "error", "version"])(
                "error", self.fail, self.version
            )
        text = self.texts[min(len(self.calls) - 1, len(self.texts) - 1)]
        ids = [*self.tok.encode(text), self.tok.im_end_id]
        out = dataclasses.make_dataclass("Out", ["tokens", "logprobs", "finish_reason", "version"])
        return out(np.asarray(ids), np.full(len(ids), -0.5, np.float32), "stop", self.version)

    def drop_session(self, session_id):
        self.dropped.append(session_id)


class FaultyEnv(SquareEnv):
    """SquareEnv whose `fault` call fails: raises `exc` (or, for "step_info", ends the step with
    info["error"]) on the calls numbered in `when` (1-based, per call kind)."""

    def __init__(self, fault, exc=None, when=(1,)):
        super().__init__()
        self.fault, self.exc, self.when = fault, exc, set(when)
        self.count = {"reset": 0, "step": 0, "evaluate": 0}

    def _fails(self, kind):
        self.count[kind] += 1
        return self.fault == kind and self.count[kind] in self.when

    async def reset(self, task, seed=None):
        if self._fails("reset"):
            raise self.exc
        return await super().reset(task, seed)

    async def step(self, action):
        if self.fault == "step_info":
            res = await super().step(action)
            return StepResult(res.observation, True, 0.0, {"error": "page crashed"})
        if self._fails("step"):
            raise self.exc
        return await super().step(action)

    async def evaluate(self):
        if self._fails("evaluate"):
            raise self.exc
        return await super().evaluate()


class OnePool(Pool):
    def __init__(self, env):
        self.envs, self.free = [env], None


def _solver(proc):
    """Texts that click the square, then say done (in the qwen3vl format on the 64x64 screen)."""
    loop = AgentLoop(None, proc, RolloutSettings())
    space = loop.space_for(np.zeros((H, W, 3), np.uint8))
    return [loop.fmt.format(a, space) for a in (A.Click(16, 48), A.Done())]


@pytest.mark.parametrize(
    "fault,exc,reason",
    [
        ("reset", EnvError("no page"), "env_error: reset: no page"),
        ("reset", TimeoutError("slow"), "env_error: reset: TimeoutError: slow"),
        ("step", EnvError("vm gone"), "env_error: step: vm gone"),
        ("step", RuntimeError("crash"), "env_error: step: RuntimeError: crash"),
        ("step_info", None, "env_error: page crashed"),
        ("evaluate", EnvError("browser is gone"), "evaluate_error: EnvError: browser is gone"),
        ("evaluate", RuntimeError("checker"), "evaluate_error: RuntimeError: checker"),
    ],
)
def test_env_and_checker_faults_are_infra_faults_in_training_and_eval(proc, fault, exc, reason):
    """A raising reset/step/evaluate (say, evaluate on a dead browser) or a step that ends with
    info["error"] is an infrastructure fault, never a 0-score failure of the policy; the episode
    never raises out of the loop. Eval retries it once, then reports it apart."""
    engine = ScriptedEngine(proc.tokenizer, _solver(proc))
    # env_retries=0: the episode as it faulted (retries: tests/envs/test_fleet_faults.py)
    loop = AgentLoop(engine, proc, RolloutSettings(max_turns=4, env_retries=0))
    env = FaultyEnv(fault, exc)
    (traj,) = asyncio.run(loop.run_group(OnePool(env), TASK, 1, seed=1, group_id="f"))
    assert traj.failure_reason == reason and traj.infra_fault and not traj.success
    if fault == "reset":
        assert traj.turns == [] and env.count["step"] == 0
    elif fault in ("step", "step_info"):
        assert len(traj.turns) == 1 and env.count["evaluate"] == 0  # no checker on a dead env
    else:
        assert len(traj.turns) == 2 and traj.score == 0.0  # it would have scored 1.0

    env = FaultyEnv(fault, exc, when=(1, 2))  # fails both attempts
    screens, seen = [], []
    (ev,) = asyncio.run(
        loop.evaluate(OnePool(env), [TASK], screens=screens, on_episode=seen.append)
    )
    assert ev.failure_reason == reason and ev.infra_fault
    assert count_infra_faults([ev]) == 1 and seen == [ev]
    assert env.count["reset"] == 2  # retried once, not more
    assert len(screens) == 1 and len(screens[0]) == len(ev.turns)  # the last attempt's screens


def test_eval_retries_an_infra_fault_once_and_keeps_the_retry(proc):
    engine = ScriptedEngine(proc.tokenizer, _solver(proc) * 2)
    loop = AgentLoop(engine, proc, RolloutSettings(max_turns=4))
    env = FaultyEnv("evaluate", RuntimeError("browser is gone"), when=(1,))
    screens, seen = [], []
    (ev,) = asyncio.run(
        loop.evaluate(OnePool(env), [TASK], screens=screens, on_episode=seen.append)
    )
    assert ev.success and ev.score == ev.reward == 1.0 and ev.failure_reason is None
    assert env.count == {"reset": 2, "step": 4, "evaluate": 2} and seen == [ev]
    assert len(screens) == 1 and len(screens[0]) == 2  # the retry's screenshots only
    assert count_infra_faults([ev]) == 0
    # greedy, and one engine session per attempt (each dropped)
    assert all(p.temperature == 0.0 and p.top_p == 1.0 for _, p in engine.calls)
    sessions = list(dict.fromkeys(s for s, _ in engine.calls))
    assert len(sessions) == 2 and engine.dropped == sessions
    # a plain policy failure (never clicks) is not retried
    miss = ScriptedEngine(proc.tokenizer, _solver(proc)[1:])
    env = FaultyEnv(None)
    (ev,) = asyncio.run(AgentLoop(miss, proc, RolloutSettings()).evaluate(OnePool(env), [TASK]))
    assert ev.score == 0.0 and not ev.infra_fault and env.count["reset"] == 1


def test_sampler_errors_are_infra_faults(proc):
    engine = ScriptedEngine(proc.tokenizer, [""], fail="out of pages")
    loop = AgentLoop(engine, proc, RolloutSettings(max_turns=4))
    env = FaultyEnv(None)
    (traj,) = asyncio.run(loop.run_group(OnePool(env), TASK, 1, seed=1, group_id="s"))
    assert traj.failure_reason == "sampler_error: out of pages" and traj.infra_fault
    assert traj.turns == [] and env.count["step"] == 0 and len(engine.dropped) == 1
    assert traj.policy_version == 3  # the engine's version: no tokens were sampled


def test_a_scripted_policy_plays_through_the_loop(proc):
    """`AgentLoop.play` with a policy of one's own: the loop steps, records and scores."""
    from cua_jax.rl.policies import Reply, Stop

    class Clicker:
        shaped_reward = True

        def __init__(self):
            self.seen = []

        async def act(self, ctx):
            self.seen.append((ctx.turn, ctx.prompt_ids.size, ctx.image_grid_thw.tolist()))
            if ctx.turn == 2:
                return Stop()
            text = loop.fmt.format(A.Click(16, 48), ctx.space)
            ids = [*proc.tokenizer.encode(text), proc.tokenizer.im_end_id]
            return Reply(ids, np.full(len(ids), -1.0, np.float32), trained=ctx.turn == 1)

        def finish(self):
            return 11

    loop = AgentLoop(None, proc, RolloutSettings(max_turns=4, invalid_action_penalty=0.5))
    policy, env = Clicker(), SquareEnv()
    traj = asyncio.run(loop.play(env, TASK, policy, group_id="own"))
    assert [s[0] for s in policy.seen] == [0, 1, 2]
    assert [s[2] for s in policy.seen] == [[[1, 4, 4]], [[1, 4, 4]] * 2, [[1, 4, 4]] * 2]
    assert policy.seen[0][1] < policy.seen[1][1] < policy.seen[2][1]
    assert len(traj.turns) == 2 and [t.trained for t in traj.turns] == [False, True]
    assert traj.failure_reason is None and traj.success and traj.policy_version == 11
    assert traj.reward == 1.0 and traj.group_id == "own"  # shaped, but no invalid action
    assert [type(a) for a in env.actions] == [A.Click, A.Click]


@pytest.mark.parametrize("system_prompt", ["tools", "compact"])
def test_the_tasks_api_actions_are_in_the_prompt_and_only_then(engine, proc, system_prompt):
    """A task that allows API actions shows them to the policy (in the prompt the episode's turns
    were sampled from); a task that allows none shows none."""
    loop = _loop(engine, proc, max_history_images=4, system_prompt=system_prompt)
    api_task = dataclasses.replace(TASK, api_actions=("run_shell", "fill"))
    (with_api,) = asyncio.run(loop.demonstrations(Pool(1), [api_task]))
    (plain,) = asyncio.run(loop.demonstrations(Pool(1), [TASK]))
    tok = proc.tokenizer
    first = tok.decode(with_api.turns[0].prompt_ids)
    assert "run_shell" in first and "fill" in first
    assert "run_shell" not in tok.decode(plain.turns[0].prompt_ids)


# ---- the checker's report: message, dense shaping, the final screen ----------------------------


class ReportingEnv(SquareEnv):
    """SquareEnv whose checker also reports its clicks, the square's centre and a closeness."""

    def __init__(self, fail=False):
        super().__init__()
        self.fail = fail

    async def report(self):
        if self.fail:
            raise RuntimeError("page gone")
        clicks = tuple((a.x, a.y, "background") for a in self.actions if isinstance(a, A.Click))
        return CheckerReport(clicks=clicks, targets=(("square", 16.0, 48.0),), closeness=0.25)


class _ShapedDetour(OraclePolicy):
    shaped_reward = True  # scored as a sampled rollout is: through the reward function


def _miss(loop, env, **kw):
    policy = _ShapedDetour(loop.fmt, loop.tokenizer, detour=A.Click(50, 10))
    return asyncio.run(loop.play(env, TASK, policy, **kw))


def test_checker_report_message_shaping_and_final_screen(engine, proc):
    loop = _loop(engine, proc, max_turns=1, closeness_reward=0.4, keep_final_screen=True)
    env = ReportingEnv()
    traj = _miss(loop, env)
    assert not traj.success and traj.score == 0.0 and traj.failure_reason == "max_turns"
    ((cx, cy, hit),) = traj.checker_report.clicks  # through the model's 0..1000 frame and back
    assert (cx, cy, hit) == (pytest.approx(50, abs=0.1), pytest.approx(10, abs=0.1), "background")
    # qwen3vl's frame is 0..1000 on both axes of the 64x64 screen
    assert traj.checker_message == (
        'Clicked "background" at (781, 156); the target was "square" at (250, 750).'
    )
    assert traj.reward == pytest.approx(0.4 * 0.25)  # 0 + closeness_reward x closeness
    # the final screen is the one after the click (SquareEnv's shade changes per step)
    want = proc.preprocess_images([env._obs().screenshot])
    np.testing.assert_array_equal(traj.final_screen[0], want["pixel_values"])
    np.testing.assert_array_equal(traj.final_screen[1], want["image_grid_thw"])
    first = proc.preprocess_images([np.full((H, W, 3), 0, np.uint8)])["pixel_values"]
    assert not np.array_equal(traj.final_screen[0], first)

    # off by default: no shaping, no final screen; an env without report() has no report
    plain = _miss(_loop(engine, proc, max_turns=1), SquareEnv())
    assert plain.reward == 0.0 and plain.checker_report is None and plain.checker_message == ""
    assert plain.final_screen is None
    # a report that raises leaves the score and reward as they were
    broken = _miss(_loop(engine, proc, max_turns=1, closeness_reward=0.4), ReportingEnv(True))
    assert broken.checker_report is None and broken.reward == 0.0 and not broken.infra_fault


class ReportingPool(Pool):
    def __init__(self, n):
        self.envs = [ReportingEnv() for _ in range(n)]
        self.free = None


def test_failed_attempts_give_feedback_demos_as_the_sdpo_teacher_reads_them(engine, proc, model):
    """`sft.feedback_share`: a scripted failed attempt at a demo's task (a click, then the end)
    keeps its final screen and checker report even with `keep_final_screen` off; the feedback
    demo is the demo's sample with that feedback before the task, token for token what SDPO's
    teacher reads (`sdpo.teacher_sample`), trained on exactly the demo's generated tokens."""
    loop = _loop(engine, proc, max_history_images=4)
    pool = ReportingPool(2)
    (demo,) = asyncio.run(loop.demonstrations(pool, [TASK]))
    misses = [A.Click(50, 10), A.Click(16, 48)]  # the second hits the square
    failed, lucky = asyncio.run(loop.failed_attempts(pool, [TASK, TASK], misses))
    assert not failed.success and not failed.infra_fault and len(failed.turns) == 1
    assert failed.checker_message.startswith('Clicked "background" at (781, 156)')
    assert failed.final_screen is not None
    assert lucky.success and lucky.final_screen is None
    with pytest.raises(ValueError, match="detour_only needs a detour"):
        OraclePolicy(loop.fmt, loop.tokenizer, detour_only=True)

    def pos(ids, grid):
        return text_position_ids(ids, None)

    (d_sample,) = trajectory_to_samples(demo, 1.0, pos)
    decode = sdpo.action_decoder(proc.chat)
    # peer_share 1 / 0: with and without the demo's own calls as the successful peer; the pair
    # whose attempt succeeded gives nothing
    with_peer = feedback_demo_samples([(failed, demo), (lucky, demo)], proc.chat, pos, peer_share=1)
    no_peer = feedback_demo_samples([(failed, demo)], proc.chat, pos, peer_share=0)
    for got, group in [(with_peer, [failed, demo]), (no_peer, [failed])]:
        (s,) = got
        want = sdpo.teacher_sample(
            d_sample, sdpo.episode_feedback(failed, group, decode), proc.chat, pos
        ).sample
        np.testing.assert_array_equal(s.input_ids, want.input_ids)
        np.testing.assert_array_equal(s.loss_mask, want.loss_mask)
        np.testing.assert_array_equal(s.pixel_values, want.pixel_values)
        np.testing.assert_array_equal(s.image_grid_thw, want.image_grid_thw)
        assert s.advantage == 1.0
        np.testing.assert_array_equal(
            s.input_ids[s.loss_mask], d_sample.input_ids[d_sample.loss_mask]
        )
        # the attempt's final screen is the first image
        n = failed.final_screen[0].shape[0]
        np.testing.assert_array_equal(s.pixel_values[:n], failed.final_screen[0])
        assert failed.checker_message in proc.tokenizer.decode(s.input_ids)
    assert sdpo.PEER_HEADER in proc.tokenizer.decode(with_peer[0].input_ids)
    assert sdpo.PEER_HEADER not in proc.tokenizer.decode(no_peer[0].input_ids)

    # Through the SFT data path: half of 4 demos get an attempt, each failed one a sample.
    learner = Learner(model, seq_len_buckets=(4096,), donate=False)
    batches, info = asyncio.run(
        oracle_sft_batches(
            learner,
            loop,
            ReportingPool(2),
            [TASK],
            rows=8,
            episodes_per_task=4,
            recovery_share=0.0,
            seed=0,
            feedback_share=0.5,
        )
    )
    assert info["sft/demos"] == 4 and info["sft/feedback_attempts"] == 2
    assert info["sft/feedback_samples"] == info["sft/feedback_attempts_failed"] > 0
    batch = next(batches)
    assert batch.num_samples == 4 + info["sft/feedback_samples"]


def test_closeness_reward_shapes_failures_only():
    s = RolloutSettings(closeness_reward=0.3, invalid_action_penalty=0.1)
    rep = CheckerReport(closeness=0.5)
    fail = Trajectory("t", "g", [], checker_report=rep, timings={"invalid_actions": 2.0})
    assert default_reward(fail, 0.0, s) == pytest.approx(0.0 - 0.2 + 0.3 * 0.5)
    win = Trajectory("t", "g", [], success=True, checker_report=rep)
    assert default_reward(win, 1.0, s) == 1.0  # a success keeps its score
    unknown = Trajectory("t", "g", [], checker_report=CheckerReport(closeness=None))
    assert default_reward(unknown, 0.0, s) == 0.0
    with pytest.raises(ValueError, match="closeness_reward"):
        RolloutSettings(closeness_reward=1.0)


@pytest.mark.parametrize("window", [1, 2, 3, 6])
def test_each_turns_prompt_is_the_whole_transcript_rendered_anew(proc, window):
    """The transcript goes on from the previous prompt's rendering while no screenshot leaves
    the history window, and renders from the first turn when one does: either way each turn's
    ids, screens and grids are `render_transcript`'s of every record so far."""
    rng = np.random.default_rng(window)
    tr = _Transcript(proc, "click the red square", "You operate a computer.", window)
    for k in range(5):
        shot = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
        p = tr.prompt("" if k == 0 else f"after turn {k}", shot)
        rendered, pv, grid = render_transcript(
            proc.chat, "click the red square", "You operate a computer.", tr.records, window
        )
        np.testing.assert_array_equal(p.ids, rendered.input_ids)
        np.testing.assert_array_equal(p.rendered.loss_mask, rendered.loss_mask)
        assert p.rendered.text == rendered.text
        np.testing.assert_array_equal(p.pixel_values, pv)
        np.testing.assert_array_equal(p.grid, grid)
        assert p.grid.dtype == grid.dtype and p.pixel_values.dtype == pv.dtype
        # The digests handed to the sampler are those it would compute from the pixels.
        own = prompt_inputs(
            p.ids, pv, grid, image_token_id=proc.tokenizer.image_pad_id, merge_size=2
        )
        assert p.image_hashes == own.image_hashes and len(p.image_hashes) == len(grid)
        tr.reply([int(i) for i in rng.integers(0, 400, 3 + k)])
