"""The learner's fixed shape set: every batch of a run is packed into one of a few (rows, row
length, patches) shapes decided from the config before the first step, so the train step
compiles once per shape at start-up and never again (BENCHMARKS.md "Compile once").

    shapes = ShapeSet.build(settings, image_config, row_multiple=learner.row_multiple)
    print(shapes.describe())
    shape = shapes.pick("rl", samples)         # the smallest shape that holds them, or None

`settings` is a `ShapeSettings`, the config's fields this module needs (`cua_jax.job.builders
.shape_settings` reads them from the run's config). A shape is (rows R, row length L, patch
budget P). RL batches use R = `rl.learner_rows` (0: one
row per episode of a step, group_size x groups_per_batch, rounded up to the learner's row
multiple; when the history window drops screens, env.max_history_images < env.max_turns, an
episode's turns are separate samples, so R x env.max_turns rows as well), SFT batches R =
`rl.rows_per_step`; L is each of `rl.row_lengths`. A batch goes to
the smallest shape of its mode whose rows hold its first-fit packing and whose patch budget
holds its images; a batch too big for one is tried in the next larger one (never cut: no
sample is dropped). The patch budget of a shape is R x `rl.images_per_row` screens (0: as many
as a row of L tokens can hold, at most env.max_turns x env.max_history_images) of the config's
screen size; the images of a batch are padded up to it with blank screens (`pad_images`), so
the vision tower sees one shape and its static layout (query chunks, key windows) stays the
same from batch to batch.

With `rl.tokens_per_chip` > 0 the set is a token budget instead (`ShapeSet._budget`): one shape
per row length, a *chunk* of max(1, T // L) rows a batch-parallel device; a batch is as many
chunks as it needs (`chunks_for`, `cua_jax.rl.batching.pack_chunks`), so no worst case of
turns and screens has to fit one program.

A batch that fits no shape of its mode (`pick` returns None) is packed as before (row count and
patches rounded to powers of two): that is a new compile, logged and counted by
`cua_jax.job.compile_stats`, and with `rl.strict_shapes` an error. A sample that can never fit (it
is longer than the longest row, or carries more patches than the largest budget) is an error
naming it (`check_sample`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from cua_jax.data.image import smart_resize
from cua_jax.rl.trajectory import Sample

Mode = Literal["rl", "sft", "teacher"]


class ShapeError(ValueError):
    """A batch or a sample that does not fit the run's shape set."""


@dataclasses.dataclass(frozen=True)
class Shape:
    rows: int
    length: int
    patches: int  # patch budget of the batch (0: text-only programs)
    # A token-budget shape (`rl.tokens_per_chip`): rows and patches are one chunk's, a batch
    # is any number of chunks; each (micro-batch, device) group of a chunk holds at most this
    # many screens. 0: a shape of the row-count set (a batch is one call).
    group_screens: int = 0

    def __str__(self) -> str:
        s = f"{self.rows}x{self.length}" + (f" +{self.patches} patches" if self.patches else "")
        return s + (" per chunk" if self.group_screens else "")


def screen_grid(width: int, height: int, image_config: Any) -> tuple[int, int, int]:
    """(t, h, w) patch grid of one screenshot of `width` x `height` pixels (the processor's
    resize: `cua_jax.data.image.smart_resize`)."""
    ic = image_config
    h, w = smart_resize(height, width, ic.factor, ic.min_pixels, ic.max_pixels)
    return (1, h // ic.patch_size, w // ic.patch_size)


def first_fit_rows(lengths: Sequence[int], row_len: int) -> int:
    """Rows first-fit-decreasing packing needs for samples of `lengths` (as `packing.pack`)."""
    free: list[int] = []
    for n in sorted(lengths, reverse=True):
        for r, f in enumerate(free):
            if f >= n:
                free[r] -= n
                break
        else:
            free.append(row_len - n)
    return len(free)


@dataclasses.dataclass(frozen=True)
class ShapeSettings:
    """What the shape set is decided from: the run's `rl`, `env`, `sft` and `model` fields
    (`cua_jax.job.builders.shape_settings`). Field names say the config key each comes from."""

    row_lengths: tuple[int, ...]  # rl.row_lengths
    episodes: int  # rl.group_size x rl.groups_per_batch: a step's episodes
    sft_rows: int  # rl.rows_per_step
    viewport: tuple[int, int]  # env.viewport_width, env.viewport_height
    max_turns: int  # env.max_turns
    max_history_images: int  # env.max_history_images
    learner_rows: int = 0  # rl.learner_rows (0: one row an episode)
    images_per_row: int = 0  # rl.images_per_row (0: as many as a row holds)
    tokens_per_chip: int = 0  # rl.tokens_per_chip (> 0: a token-budget set)
    screens_per_chip: int = 0  # rl.screens_per_chip
    strict: bool = False  # rl.strict_shapes
    sdpo: bool = False  # rl.algorithm == "sdpo"
    feedback_kinds: frozenset[str] = frozenset()  # of rl.sdpo_feedback
    max_tokens: int = 0  # rl.max_tokens: an action call's tokens at most
    sft_feedback: bool = False  # sft.feedback_share > 0
    row_unit: int = 128  # rows round up to this (the splash kernel's block with attn_impl=splash)


# Tokens SDPO's feedback message takes besides its screenshot and a peer's tool calls: the chat
# template's turn, the header and footer, and the checker's message (a click report and a note:
# about 60-120 tokens on the built-in pages)
FEEDBACK_TEXT_TOKENS = 192


def teacher_row_length(s: ShapeSettings, image_tokens: int, longest: int | None = None) -> int:
    """The row length that holds the longest RL row's sample (`longest`, default the longest
    of `rl.row_lengths`) with SDPO's feedback message before it (its screenshot, a peer's tool
    calls and `FEEDBACK_TEXT_TOKENS` of text), rounded up to a multiple of `s.row_unit`."""
    extra = FEEDBACK_TEXT_TOKENS
    if "final_screenshot" in s.feedback_kinds:
        extra += image_tokens + 2  # <|vision_start|> ... <|vision_end|>
    if "peer_success" in s.feedback_kinds:
        extra += s.max_turns * (s.max_tokens + 8)  # "N. " and a newline a call
    longest = max(s.row_lengths) if longest is None else longest
    return -(-(longest + extra) // s.row_unit) * s.row_unit


def sample_patches(s: Sample) -> int:
    return 0 if s.pixel_values is None else int(np.asarray(s.pixel_values).shape[0])


@dataclasses.dataclass(frozen=True)
class ShapeSet:
    """The shapes of each mode's train step (see the module docstring)."""

    rl: tuple[Shape, ...]
    sft: tuple[Shape, ...]
    grid: tuple[int, int, int] | None  # the screen's patch grid: the padding unit
    strict: bool = False
    # SDPO's teacher pass (rl.algorithm="sdpo"): its batches are the step's failed samples with
    # their feedback, up to the RL rows, each with one screen more (the final screenshot);
    # empty: teacher batches take the SFT shapes
    teacher: tuple[Shape, ...] = ()
    # > 0: a token-budget set (`_budget`): tokens of one (micro-batch, device) group
    tokens_per_chip: int = 0

    @staticmethod
    def build(s: ShapeSettings, image_config: Any, *, row_multiple: int = 1) -> ShapeSet:
        """The shape set of `s` for screens resized by `image_config`, rows rounded up to
        `row_multiple` (the learner's micro-batches x batch-parallel devices)."""
        grid = screen_grid(*s.viewport, image_config)
        unit = grid[0] * grid[1] * grid[2]
        image_tokens = unit // image_config.merge_size**2
        rl_rows = s.learner_rows or s.episodes

        def up(n: int) -> int:
            return -(-n // row_multiple) * row_multiple

        def shapes(
            rows: int, most_screens: int = 0, extra: int = 0, lengths: Sequence[int] = ()
        ) -> tuple[Shape, ...]:
            out = []
            for length in sorted(lengths or s.row_lengths):
                per_row = s.images_per_row or min(
                    length // image_tokens, s.max_turns * s.max_history_images + extra
                )
                screens = up(rows) * per_row
                if most_screens and not s.images_per_row:
                    screens = min(screens, most_screens)
                out.append(Shape(up(rows), length, screens * unit))
            return tuple(out)

        if s.tokens_per_chip > 0:
            return ShapeSet._budget(s, grid, image_tokens, row_multiple)
        rl_shapes = shapes(rl_rows)
        # SDPO's teacher batches: the failed samples of a step with their feedback, i.e. the
        # RL rows with one more screen a sample (the screen after the last action)
        final_screen = s.sdpo and "final_screenshot" in s.feedback_kinds
        # ... and one row length more: the longest RL row with the feedback message before it
        t_lengths = (*s.row_lengths, teacher_row_length(s, image_tokens)) if s.sdpo else ()
        teacher = shapes(rl_rows, extra=int(final_screen), lengths=t_lengths) if s.sdpo else ()
        if not s.learner_rows and s.max_history_images < s.max_turns:
            # The history window drops screens, so an episode's turns are separate samples
            # (up to max_turns of them): a second row count gives each its own row at worst;
            # a step still holds at most max_turns x max_history_images screens an episode,
            # so the patch budget (blank screens through the vision tower) stays that
            most = s.episodes * s.max_turns * s.max_history_images
            rl_shapes += shapes(rl_rows * s.max_turns, most)
            if s.sdpo:
                most_fb = s.episodes * s.max_turns * (s.max_history_images + final_screen)
                teacher += shapes(
                    rl_rows * s.max_turns, most_fb, extra=int(final_screen), lengths=t_lengths
                )
        # feedback demonstrations (sft.feedback_share) carry the final screenshot too
        sft_shapes = shapes(s.sft_rows, extra=int(final_screen and s.sft_feedback))
        return ShapeSet(rl_shapes, sft_shapes, grid, s.strict, teacher)

    @staticmethod
    def _budget(
        s: ShapeSettings, grid: tuple[int, int, int], image_tokens: int, row_multiple: int
    ) -> ShapeSet:
        """The token-budget set (`rl.tokens_per_chip` = T > 0): for each row length L of
        `rl.row_lengths`, a chunk of max(1, T // L) rows per (micro-batch, device) group, i.e.
        `row_multiple` (= micro-batches x batch-parallel devices) times that, each group
        holding at most `rl.screens_per_chip` screens (0: T // a screen's tokens, all a
        chip's tokens can hold; never fewer than one row of L holds). A batch is as many
        chunks of its shape as its samples need (`chunks_for`): memory is one chunk's whatever
        `env.max_turns` and `env.max_history_images` are. SFT and SDPO teacher batches take
        the same shapes (the teacher's rows longer by its feedback message)."""
        T = s.tokens_per_chip
        unit = grid[0] * grid[1] * grid[2]

        def shapes(lengths: Sequence[int]) -> tuple[Shape, ...]:
            out = []
            for length in sorted(set(lengths)):
                per_group = max(s.screens_per_chip or T // image_tokens, 0)
                per_group = max(per_group, length // image_tokens)
                rows = max(1, T // length) * row_multiple
                out.append(Shape(rows, length, per_group * row_multiple * unit, per_group))
            return tuple(out)

        rl_shapes = shapes(s.row_lengths)
        teacher: tuple[Shape, ...] = ()
        if s.sdpo:
            teacher = shapes((*s.row_lengths, teacher_row_length(s, image_tokens)))
        return ShapeSet(rl_shapes, rl_shapes, grid, s.strict, teacher, T)

    @property
    def budgeted(self) -> bool:
        """A token-budget set: batches are chunks of a shape (`chunks_for`)."""
        return self.tokens_per_chip > 0

    def chunks_for(self, mode: Mode, samples: Sequence[Sample]) -> tuple[Shape, int]:
        """(shape, chunks) of a token-budget set for `samples`: of the shapes whose rows are
        long enough for the longest sample, the one whose first-fit packing needs the fewest
        padded tokens (chunks x rows x length; the shorter rows on a tie). The chunk count
        covers the rows; `Learner.pack` adds chunks when the screens need them."""
        for i, s in enumerate(samples):
            self.check_sample(s, i)
        lengths = [s.length for s in samples] or [1]
        best = None
        for sh in self.of(mode):
            if sh.length < max(lengths):
                continue
            k = max(1, -(-first_fit_rows(lengths, sh.length) // sh.rows))
            cost = (k * sh.rows * sh.length, sh.length)
            if best is None or cost < best[0]:
                best = (cost, sh, k)
        assert best is not None  # check_sample: some shape is long enough
        return best[1], best[2]

    def of(self, mode: Mode) -> tuple[Shape, ...]:
        if mode == "teacher":
            return self.teacher or self.sft
        return self.rl if mode == "rl" else self.sft

    def describe(self) -> str:
        g = "x".join(map(str, self.grid)) if self.grid else "-"
        return (
            f"learner shapes (rows x row length + patch budget; screen grid {g}): "
            f"rl {', '.join(map(str, self.rl))}; sft {', '.join(map(str, self.sft))}"
            + (f"; teacher {', '.join(map(str, self.teacher))}" if self.teacher else "")
            + (f"; {self.tokens_per_chip} tokens a chip a micro-batch" if self.budgeted else "")
            + ("; strict" if self.strict else "")
        )

    def check_sample(self, s: Sample, index: int = 0) -> None:
        """Raises `ShapeError` naming a sample no shape can ever hold."""
        longest = max(sh.length for sh in self.rl + self.sft + self.teacher)
        budget = max(sh.patches for sh in self.rl + self.sft + self.teacher)
        where = f"sample {index} (task {s.task_id!r}, episode {s.episode})"
        if s.length > longest:
            raise ShapeError(
                f"{where} has {s.length} tokens, longer than the longest row {longest} "
                "(rl.row_lengths); add a longer row length or cut the history window / max_tokens"
            )
        if sample_patches(s) > budget:
            raise ShapeError(
                f"{where} has {sample_patches(s)} image patches, more than the largest patch "
                f"budget {budget} (rl.images_per_row x rows x {self.grid} screens)"
            )

    def by_size(self, mode: Mode) -> tuple[Shape, ...]:
        """The shapes of `mode`, smallest (rows x length) first: the order `pick` tries."""
        return tuple(sorted(self.of(mode), key=lambda sh: (sh.rows * sh.length, sh.length)))

    def pick(self, mode: Mode, samples: Sequence[Sample]) -> Shape | None:
        """The smallest shape of `mode` that holds `samples` (rows of its first-fit packing,
        patches), or None when none does."""
        i = self.pick_index(mode, samples)
        return None if i < 0 else self.by_size(mode)[i]

    def pick_index(self, mode: Mode, samples: Sequence[Sample], parts: int = 1) -> int:
        """Index in `by_size(mode)` of the smallest shape whose 1/`parts` share (rows / parts
        rows, patches / parts) holds `samples`, or -1. parts > 1: one process's share of a
        multi-process batch, whose rows and images are concatenated over the processes."""
        for i, s in enumerate(samples):
            self.check_sample(s, i)
        if not samples:
            return 0
        longest = max(s.length for s in samples)
        patches = sum(sample_patches(s) for s in samples)
        lengths = [s.length for s in samples]
        for i, sh in enumerate(self.by_size(mode)):
            if sh.rows % parts or sh.length < longest or patches > sh.patches // parts:
                continue
            if first_fit_rows(lengths, sh.length) <= sh.rows // parts:
                return i
        return -1

    def miss_message(self, mode: Mode, samples: Sequence[Sample]) -> str:
        patches = sum(sample_patches(s) for s in samples)
        return (
            f"a {mode} batch of {len(samples)} samples (longest {max(s.length for s in samples)} "
            f"tokens, {patches} patches) fits none of the run's {mode} shapes "
            f"{', '.join(map(str, self.of(mode)))}; raise rl.learner_rows / rl.images_per_row "
            "(or rl.rows_per_step for SFT)"
        )


def pad_images(
    pixel_values: np.ndarray | None,
    image_grid_thw: np.ndarray | None,
    budget: int,
    grid: tuple[int, int, int],
    merge: int,
    patch_dim: int,
    dtype: Any = np.float32,
) -> tuple[np.ndarray, np.ndarray]:
    """Pads the flat patches to exactly `budget` with blank screens of `grid` (then one blank
    (1, m, k) image for any remainder), so every batch's vision input has one shape and, with
    images of the screen size, one static layout.

    A blank image attends only to itself in the vision tower and its merged features come after
    every real one, so no image-pad token takes them: outputs are unchanged."""
    if pixel_values is None:
        pixel_values = np.zeros((0, patch_dim), dtype)
        image_grid_thw = np.zeros((0, 3), np.int32)
    P = pixel_values.shape[0]
    if P > budget:
        raise ShapeError(f"{P} patches exceed the shape's budget of {budget}")
    extra = budget - P
    unit = grid[0] * grid[1] * grid[2]
    grids = [np.asarray(image_grid_thw, np.int32).reshape(-1, 3)]
    grids += [np.asarray([grid], np.int32)] * (extra // unit)
    rest = extra % unit
    if rest:
        if rest % (merge * merge):
            raise ShapeError(f"a patch budget remainder of {rest} is not a multiple of {merge}²")
        grids.append(np.asarray([[1, merge, rest // merge]], np.int32))
    if extra == 0:
        return pixel_values, grids[0]
    blank = np.zeros((extra, pixel_values.shape[1]), pixel_values.dtype)
    return np.concatenate([pixel_values, blank]), np.concatenate(grids)
