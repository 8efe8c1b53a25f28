"""Multi-turn trajectories exactly as the sampler produced them, and their training samples.

A `Turn` keeps the token ids the sampler was given and the ids it generated, never
re-tokenized (re-tokenizing decoded text changes ids and silently biases the policy gradient),
with the behaviour log-probs log μ(o_t) of the generated tokens.

Images: ``Turn.pixel_values`` / ``image_grid_thw`` hold the images whose placeholder tokens are
*new* in this turn's prompt: all of the prompt's images when ``extends_previous`` is False, and
only those after the previous turn's full sequence when it is True (a prefix-cached sampler
sees exactly these; storing earlier screenshots again would grow memory quadratically).

Training samples (`Sample`): a maximal chain of turns in which every turn's prompt extends the
previous turn's full sequence (prompt + generated) becomes ONE sample — the last turn's full
sequence, with the loss on the generated tokens of every turn of the chain and the observation /
template tokens masked. When a history window dropped old screenshots (``extends_previous``
False) a new chain starts, so each such turn is trained with the exact context the sampler saw.

MoE routing replay: ``Turn.routes`` (from the sampler's `GenerateOutput.routes`) holds the
experts each sparse layer chose for each generated token when it was fed back; a `Sample` of a
MoE policy carries them token-aligned in ``Sample.routes`` i32[T, L, K], -1 wherever nothing was
recorded (prompt and observation tokens, each turn's last token), where the learner lets its own
router choose.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from cua_jax.data.positions import get_rope_index
from cua_jax.env_api import CheckerReport

# (input_ids i32[T], image_grid_thw i32[I, 3] | None) -> M-RoPE position ids i32[3, T]
PositionFn = Callable[[np.ndarray, np.ndarray | None], np.ndarray]


@dataclasses.dataclass
class Turn:
    """One sampler call and the environment's answer to it."""

    prompt_ids: np.ndarray  # i32[P] exactly as the sampler saw them
    generated_ids: np.ndarray  # i32[G] exactly as produced (EOS included if generated)
    logprobs: np.ndarray  # f32[G] behaviour log-probs log μ of generated_ids
    pixel_values: np.ndarray | None = None  # f[N_patches, C*tps*ps*ps] of the new images
    image_grid_thw: np.ndarray | None = None  # i32[I, 3] of the new images
    extends_previous: bool = False  # prompt_ids starts with the previous turn's full sequence
    action: Any = None  # the parsed action (any object; not persisted unless JSON-able)
    feedback: str = ""  # env feedback text shown to the model next turn
    # False: the turn is context only, its tokens get no loss (the scripted wrong first step
    # of a recovery demonstration).
    trained: bool = True
    # MoE samplers: i32[G, L, K] the experts of the L sparse layers chosen for each generated
    # token when it was fed back (-1: not recorded); None for dense models.
    routes: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, np.int32).reshape(-1)
        self.generated_ids = np.asarray(self.generated_ids, np.int32).reshape(-1)
        self.logprobs = np.asarray(self.logprobs, np.float32).reshape(-1)
        if self.logprobs.shape != self.generated_ids.shape:
            raise ValueError(
                f"Turn.logprobs has {self.logprobs.size} entries but generated_ids has "
                f"{self.generated_ids.size}; pass one behaviour log-prob per generated token"
            )
        if self.routes is not None:
            self.routes = np.asarray(self.routes, np.int32)
            if self.routes.ndim != 3 or self.routes.shape[0] != self.generated_ids.size:
                raise ValueError(
                    f"Turn.routes has shape {self.routes.shape} but needs "
                    f"[G={self.generated_ids.size}, L, K]: one row of experts per generated token "
                    "(GenerateOutput.routes)"
                )
        if (self.pixel_values is None) != (self.image_grid_thw is None):
            raise ValueError("Turn needs both pixel_values and image_grid_thw, or neither")
        if self.image_grid_thw is not None:
            self.image_grid_thw = np.asarray(self.image_grid_thw, np.int32).reshape(-1, 3)
            if len(self.image_grid_thw) == 0:
                self.pixel_values = self.image_grid_thw = None

    @property
    def full_ids(self) -> np.ndarray:
        """i32[P + G]: the prompt followed by the generated tokens."""
        return np.concatenate([self.prompt_ids, self.generated_ids])


@dataclasses.dataclass
class Trajectory:
    """One episode of one task: its turns and outcome."""

    task_id: str
    group_id: str  # the GRPO group (same task, same prompt) this rollout belongs to
    turns: list[Turn]
    reward: float = 0.0  # the RL reward (the task's score after the rollout's reward_fn)
    success: bool = False  # the task's score reached the success threshold
    policy_version: int = 0  # learner version of the params that sampled (the oldest, if mixed)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    failure_reason: str | None = None  # e.g. "max_steps", "env_error: ...", None when it ended
    score: float | None = None  # the task's own score (env.evaluate()), before reward shaping
    # The task's position in the training task order (`cua_jax.rl.sources.TaskCursor`) when a
    # rollout source took it from there; None for eval episodes and demonstrations.
    task_position: int | None = None
    # What the task's checker said beyond the score (`env_api.CheckerReport`; None where the env
    # has no report or a fault ended the episode), and its text with positions in the policy's
    # coordinate frame (`CheckerReport.message`): SDPO's "checker_message" feedback.
    checker_report: CheckerReport | None = None
    checker_message: str = ""
    # The screen after the episode's last action, preprocessed as the turns' screenshots are:
    # (pixel_values f32[N, D], grid i32[1, 3]); kept for failed episodes when
    # `RolloutSettings.keep_final_screen` (SDPO's "final_screenshot" feedback), else None.
    final_screen: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def route_shape(self) -> tuple[int, int] | None:
        """(L, K) of the turns' recorded MoE routes; None when no turn has routes."""
        shapes = {t.routes.shape[1:] for t in self.turns if t.routes is not None}
        if len(shapes) > 1:
            raise ValueError(f"the turns' routes have different [L, K] shapes: {sorted(shapes)}")
        return next(iter(shapes), None)

    @property
    def num_tokens(self) -> int:
        return sum(t.prompt_ids.size + t.generated_ids.size for t in self.turns)

    @property
    def num_generated(self) -> int:
        return sum(t.generated_ids.size for t in self.turns)

    @property
    def infra_fault(self) -> bool:
        """The episode was ended by the environment, the sampler or the task's checker failing,
        not by the policy: its reward says nothing about the policy (GRPO leaves it out)."""
        return (self.failure_reason or "").startswith(INFRA_FAULTS)


# failure_reason prefixes of episodes ended by infrastructure faults (see Trajectory.infra_fault)
INFRA_FAULTS = ("env_error", "sampler_error", "evaluate_error")

# A GRPO group needs this many episodes not ended by an infrastructure fault to be trained on.
MIN_LIVE_EPISODES = 2


def live_episodes(group: list[Trajectory]) -> list[Trajectory]:
    """The episodes of a group that were not ended by an infrastructure fault; the group is
    trained on only when there are at least `MIN_LIVE_EPISODES` of them."""
    return [t for t in group if not t.infra_fault]


@dataclasses.dataclass
class Sample:
    """One training sequence; arrays are token-aligned (entry t describes token t)."""

    input_ids: np.ndarray  # i32[T]
    loss_mask: np.ndarray  # bool[T] True where token t was generated by the policy
    behaviour_logprobs: np.ndarray  # f32[T] log μ(token t), 0 where loss_mask is False
    position_ids: np.ndarray  # i32[3, T] M-RoPE positions
    advantage: float
    pixel_values: np.ndarray | None = None  # images of every placeholder in input_ids, in order
    image_grid_thw: np.ndarray | None = None  # i32[I, 3]
    policy_version: int = 0
    task_id: str = ""
    # The rollout this sample came from (>= 0): samples of one episode (its chains, when the
    # history window splits it) are one sequence for the seq-mean loss modes. -1: on its own.
    episode: int = -1
    # MoE: i32[T, L, K] the sampler's experts for token t (fed at position t), -1 unrecorded.
    routes: np.ndarray | None = None

    @property
    def length(self) -> int:
        return int(self.input_ids.size)


def text_position_ids(
    input_ids: np.ndarray, image_grid_thw: np.ndarray | None = None
) -> np.ndarray:
    """Text-only M-RoPE positions (the three axes equal arange(T)); refuses images."""
    if image_grid_thw is not None and len(image_grid_thw):
        raise ValueError(
            "the sample has images; pass position_fn=rope_position_fn(model.config) so M-RoPE "
            "positions come from the model's get_rope_index"
        )
    t = np.asarray(input_ids).size
    return np.broadcast_to(np.arange(t, dtype=np.int32), (3, t)).copy()


def rope_position_fn(config: Any) -> PositionFn:
    """A `PositionFn` backed by the model's `get_rope_index` (cua_jax/models/qwen_vl/rope.py)."""

    def fn(input_ids: np.ndarray, image_grid_thw: np.ndarray | None) -> np.ndarray:
        ids = np.asarray(input_ids, np.int32)[None]
        pos, _ = get_rope_index(
            ids,
            image_grid_thw,
            None,
            image_token_id=config.image_token_id,
            spatial_merge_size=config.vision.spatial_merge_size,
        )
        return np.asarray(pos, np.int32)[:, 0]

    return fn


def _concat_images(turns: list[Turn]) -> tuple[np.ndarray | None, np.ndarray | None]:
    pv = [t.pixel_values for t in turns if t.pixel_values is not None]
    grids = [t.image_grid_thw for t in turns if t.image_grid_thw is not None]
    if not pv:
        return None, None
    return np.concatenate([np.asarray(p) for p in pv]), np.concatenate(grids).astype(np.int32)


def turn_chains(traj: Trajectory) -> list[list[Turn]]:
    """Split the turns into maximal chains in which each turn extends the previous sequence.

    Raises if a turn claims ``extends_previous`` but its prompt does not start with the previous
    turn's prompt + generated ids (that would train on a context the sampler never saw).
    """
    chains: list[list[Turn]] = []
    for i, turn in enumerate(traj.turns):
        if turn.extends_previous and chains:
            prev = chains[-1][-1].full_ids
            if turn.prompt_ids.size < prev.size or not np.array_equal(
                turn.prompt_ids[: prev.size], prev
            ):
                raise ValueError(
                    f"trajectory {traj.task_id}/{traj.group_id} turn {i} has extends_previous=True "
                    "but its prompt does not start with the previous turn's prompt+generated ids; "
                    "set extends_previous=False for turns whose history was cut"
                )
            chains[-1].append(turn)
        else:
            chains.append([turn])
    return chains


def trajectory_to_samples(
    traj: Trajectory, advantage: float, position_fn: PositionFn = text_position_ids
) -> list[Sample]:
    """Training samples of one trajectory (one per chain of extending turns; see module doc),
    all with the same fresh `Sample.episode` id."""
    episode = next(_EPISODE_IDS)
    route_shape = traj.route_shape
    samples = []
    for chain in turn_chains(traj):
        if not any(turn.trained for turn in chain):
            continue  # context only: nothing to learn from
        last = chain[-1]
        ids = last.full_ids
        mask = np.zeros(ids.size, bool)
        blp = np.zeros(ids.size, np.float32)
        routes = None if route_shape is None else np.full((ids.size, *route_shape), -1, np.int32)
        for turn in chain:
            # Each turn's generated tokens sit right after its prompt in the final sequence.
            start = turn.prompt_ids.size
            end = start + turn.generated_ids.size
            mask[start:end] = turn.trained
            blp[start:end] = turn.logprobs
            if routes is not None and turn.routes is not None:
                routes[start:end] = turn.routes
        if ids.size and mask[0]:
            raise ValueError("a sample cannot start with a generated token (empty prompt)")
        pv, grid = _concat_images(chain)
        samples.append(
            Sample(
                input_ids=ids,
                loss_mask=mask,
                behaviour_logprobs=blp,
                position_ids=np.asarray(position_fn(ids, grid), np.int32),
                advantage=float(advantage),
                pixel_values=pv,
                image_grid_thw=grid,
                policy_version=traj.policy_version,
                task_id=traj.task_id,
                episode=episode,
                routes=routes,
            )
        )
    return samples


_EPISODE_IDS = itertools.count()
