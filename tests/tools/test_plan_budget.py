"""tools/plan.py's token budget and SDPO plans: AOT compiles for a TPU slice that is not here.

The same tiny model and config as `test_plan.py` (`plan_setup`); these are the plans that
compile several programs each (the SDPO step and teacher pass, the token budget's chunk
programs, both together), in their own module so that a second test worker takes them.
"""

import json
import os

import pytest

pytest.importorskip("libtpu", reason="libtpu (the TPU compiler) is not installed: no TPU plans")

import jax  # noqa: E402

from cua_jax import plan as plan_lib  # noqa: E402
from tests.tools.plan_setup import (  # noqa: E402
    PAGE,
    PAGES,
    ROW_LEN,
    ROWS,
    SEQ,
    SLOTS,
    write_hf_dir,
)
from tests.tools.plan_setup import plan_config as _config  # noqa: E402
from tests.tools.plan_setup import run_tool as _tool  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_hf_dir(tmp_path_factory)


def test_sdpo_plans_its_step_and_teacher_pass_for_tpu(hf_dir):
    """rl.algorithm="sdpo": the SDPO step (the RL step with the teacher's top-k targets as
    inputs) and the teacher pass (one length longer, for the feedback message and screen)
    compile for v5e-4 beside the GRPO step; the top-k targets are in the SDPO step's
    arguments (by hand: rows x length x k x (4 + 4) bytes, rows split over fsdp), and the EMA
    teacher's params are resident."""
    from cua_jax.job.builders import shape_settings
    from cua_jax.rl.shapes import teacher_row_length

    c = _config(hf_dir)
    c.rl.algorithm, c.rl.sdpo_topk, c.rl.sdpo_teacher = "sdpo", 16, "ema"
    with jax.default_matmul_precision("default"):
        p = plan_lib.make_plan(c, "v5e-4", rows=ROWS, row_len=ROW_LEN, programs=("train_step",))
    assert [q.name for q in p.programs] == ["train_step", "sdpo_step", "sdpo_teacher"]
    train, step, teacher = p.programs
    for q in p.programs:
        assert q.compile_error is None, q.compile_error
        assert q.temp_bytes > 0 and q.flops > 0 and q.total_bytes < p.budget_bytes
    # rows are split over fsdp=2 (tensor replicates them): ids and log-probs of 16, mask, weight
    targets = (ROWS * ROW_LEN * 16 * (4 + 4) + ROWS * ROW_LEN * (1 + 4)) // 2
    assert step.arguments["batch with teacher targets"] == train.arguments["batch"] + targets
    assert step.resident["EMA teacher params (resident)"] == train.arguments["params (trainable)"]
    unit = 16 * 2  # patch 16, merge 2: 32-pixel screen units
    screen = -(-c.env.viewport_height // unit) * -(-c.env.viewport_width // unit)
    t_len = teacher_row_length(shape_settings(c), screen, ROW_LEN)
    assert ROW_LEN < t_len < max(c.rl.row_lengths) and f"x {t_len} tokens" in teacher.notes[0]
    assert "## sdpo_teacher" in plan_lib.format_plan(p)
    # the teacher pass runs its decoder over the learner's micro-batches, as the step does:
    # with 2 of them its temporaries (one micro-batch's activations) are smaller
    c.rl.num_substeps = 2
    with jax.default_matmul_precision("default"):
        p2 = plan_lib.make_plan(c, "v5e-4", rows=ROWS, row_len=ROW_LEN, programs=("sdpo_teacher",))
    (teacher2,) = p2.programs
    assert teacher2.compile_error is None and "in 2 micro-batches" in teacher2.notes[0]
    assert teacher2.temp_bytes < teacher.temp_bytes, (teacher2.temp_bytes, teacher.temp_bytes)


def test_token_budget_plan_writes_json_with_every_chunk_program(hf_dir, tmp_path):
    """With rl.tokens_per_chip the default programs are the run's: each RL shape's chunk
    gradient program with its screens, the update, the SFT warm-up's learner's (the smoke
    preset's sft.steps) chunk program of each SFT shape and its update, the decode step and
    the prefill; `--json` lists them with their kinds and the tool exits 0 when all fit. The
    chunk's screens argument is its (micro-batch, device) groups' budget in bf16, by hand: a
    64 x 64 screen is 4 x 4 patches, a 1024-token row holds 256 screens of 4 tokens, so a
    group holds 256 (tokens_per_chip // 4 too)."""
    out = tmp_path / "plan.json"
    r = _tool(
        "--config=configs/qwen3vl_grpo.py:smoke",
        f"--config.model.hf_path={hf_dir}",
        "--config.model.dtype=bfloat16",
        "--config.mesh.fsdp=2",
        "--config.mesh.tensor=2",
        f"--config.sampler.num_pages={PAGES}",
        f"--config.sampler.page_size={PAGE}",
        f"--config.sampler.max_slots={SLOTS}",
        f"--config.sampler.max_seq_len={SEQ}",
        "--config.rl.tokens_per_chip=1024",
        "--config.rl.row_lengths=(1024,)",
        "--config.env.viewport_width=64",
        "--config.env.viewport_height=64",
        "--config.sampler.kv_memory_fraction=0.5",
        "--topology=v5e-4",
        f"--json={out}",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["preset"] == "smoke" and record["topology"] == "v5e-4" and record["fits"]
    assert record["processes"] == 1 and record["hbm_bytes"] == 16 * 2**30
    assert 0 <= record["padding_share"] < 1
    names = [p["name"] for p in record["programs"]]
    assert names == [
        "rl_grads 2x1024",
        "apply_update",
        "sft_grads 2x1024",
        "apply_update (sft)",
        "decode_step",
        "prefill_turn",
    ], names
    kinds = [p["kind"] for p in record["programs"]]
    assert kinds == ["learner", "learner", "sft", "sft", "sampler", "sampler"], kinds
    grads, sft = record["programs"][0], record["programs"][2]
    assert grads["kind"] == "learner" and (grads["rows"], grads["row_length"]) == (2, 1024)
    assert grads["screens"] == 256 * 2 and grads["fits"] and grads["bytes"] > 0
    # the SFT shapes of a token budget are the RL ones, their screens grouped the same way
    assert (sft["rows"], sft["row_length"], sft["screens"]) == (2, 1024, 256 * 2)
    assert sft["fits"] and sft["bytes"] > 0 and sft["est_mfu"] is not None
    assert "| sft_grads 2x1024 | sft | 2 x 1024 | 512 |" in r.stdout
    # a turn: one 64 x 64 screen (4 tokens and its 2 markers) and a 600-token prompt, in a
    # prefill of the sampler's max_seq_len (256 here), which says the turn is longer
    assert record["programs"][5]["row_length"] == SEQ and record["programs"][5]["fits"]
    assert "a turn is longer than sampler.max_seq_len=256" in r.stdout
    pixels = 256 * 16 * 3 * 16 * 16 * 1  # a group's screens x patches x row width, as bytes
    row = next(ln for ln in r.stdout.splitlines() if "argument: chunk screens" in ln)
    mib = float(row.split("|")[2].split()[0])
    assert pixels / 2**20 <= mib < (pixels + 2**19) / 2**20  # + the tower's index arrays
    assert "the RL batch drawn from the preset's env settings" in r.stdout
    # the KV pool: half the chip's 16 GiB less the largest learner program (no pool in it)
    assert "of 16 GiB less the largest learner program's" in r.stdout


@pytest.mark.skipif(
    not os.environ.get("CUA_LONG_TESTS"),
    reason="eight TPU compiles (minutes on a 2-core machine); CUA_LONG_TESTS=1 runs it",
)
def test_the_token_budget_shrinks_to_leave_the_kv_pool_its_share(hf_dir):
    """`sampler.kv_min_fraction`: a largest chunk program above (kv_memory_fraction -
    kv_min_fraction) of HBM is planned again at a smaller `rl.tokens_per_chip`, row lengths
    above it dropped: its chunk bytes scaled linearly, rounded down to a power of two, never
    below the shortest row length that holds the preset's longest sample. Here the limit is
    set between the 2048-token chunk's fixed part and its peak, at 30% of its chunk bytes."""
    c = _config(hf_dir)
    c.rl.tokens_per_chip, c.rl.row_lengths = 2048, (1024, 2048)
    c.rl.screens_per_chip = 4  # a few screens a group: the vision tower's compile stays small
    c.env.viewport_width = c.env.viewport_height = 64
    c.env.max_turns = c.env.max_history_images = 1
    c.sampler.kv_memory_fraction = 0.5
    with jax.default_matmul_precision("default"):
        big = plan_lib.make_plan(c, "v5e-4", programs=("train_step_screens",))
        top = max((p for p in big.programs if p.rows), key=lambda p: p.total_bytes)
        assert (top.rows, top.row_length) == (2, 2048) and big.summary["tokens_per_chip"] == 2048
        chunk = top.arguments["chunk (text)"] + top.arguments[plan_lib._SCREENS_ARG]
        chunk += top.temp_bytes
        peak = top.total_bytes - top.resident["KV pool (sampler, resident)"]  # the pool it left
        limit = peak - chunk + int(0.3 * chunk)
        hbm = plan_lib.CHIPS["v5e"].hbm_bytes
        c.sampler.kv_min_fraction = 0.5 - limit / hbm
        small = plan_lib.make_plan(c, "v5e-4", programs=("train_step_screens",))
    # 2048 x 0.3 = 614 -> 512 tokens, but the longest sample (600 + 48 + 16 + a 4-token
    # screen and its markers) needs a 1024 row: 1024, the floor
    assert plan_lib.longest_sample_tokens(c, 4) == 600 + 48 + 16 + 6
    assert small.summary["tokens_per_chip"] == 1024
    assert small.summary["row_lengths"] == (1024,)
    grads = [p for p in small.programs if p.rows]
    assert [(p.rows, p.row_length) for p in grads] == [(2, 1024)]
    pool = grads[0].resident["KV pool (sampler, resident)"]
    assert grads[0].total_bytes - pool <= limit  # the linear estimate held
    assert "rl.tokens_per_chip 2048 -> 1024" in small.summary["token_budget"]
    assert "--config.rl.tokens_per_chip=1024" in plan_lib.format_plan(small)


@pytest.mark.skipif(
    not os.environ.get("CUA_LONG_TESTS"),
    reason="SDPO's and the token budget's programs together (~3 min of TPU compiles; each is "
    "planned alone above): CUA_LONG_TESTS=1",
)
def test_sdpo_with_a_token_budget_plans_its_gradient_and_teacher_chunks(hf_dir):
    """rl.algorithm=sdpo with rl.tokens_per_chip: the run's programs are SDPO's chunk gradient
    program (the teacher's top-k targets among its inputs) for each RL shape, the update, and
    the teacher pass for each teacher shape (the RL rows and one row length longer for the
    feedback message), all with their screens; no fused SDPO step."""
    c = _config(hf_dir)
    c.rl.tokens_per_chip, c.rl.row_lengths = 1024, (1024,)
    c.rl.screens_per_chip = 4  # a few screens a group: the vision tower's compile stays small
    c.env.viewport_width = c.env.viewport_height = 64
    c.rl.algorithm, c.rl.sdpo_topk = "sdpo", 8
    with jax.default_matmul_precision("default"):
        p = plan_lib.make_plan(c, "v5e-4", programs=("train_step_screens", "sdpo_step"))
    names = [q.name for q in p.programs]
    # the update is named by its learner since the SFT programs joined the plan (bff0f6b)
    assert names[0] == "sdpo_grads 2x1024" and names[1].startswith("apply_update"), names
    teacher = [q for q in p.programs if q.name.startswith("sdpo_teacher")]
    assert [q.row_length for q in teacher][0] == 1024 and len(teacher) == 2, names
    assert all(q.compile_error is None and q.kind == "sdpo" for q in teacher), names
    grads = p.programs[0]
    # the targets: ids i32 and log-probs f32 [2, 1024, 8], mask and weights [2, 1024], per chip
    # of the batch axes (fsdp=2)
    targets = (2 * 1024 * 8 * (4 + 4) + 2 * 1024 * (1 + 4)) // 2
    assert grads.arguments["chunk (text)"] >= targets
    assert grads.kind == "sdpo" and grads.compile_error is None and grads.screens > 0
