"""tools/plan.py: AOT compiles for a TPU slice that is not here (libtpu's topology description).

One small plan is compiled once (a tiny model with head_dim 128, so JAX's Pallas TPU
paged-attention kernel really compiles through Mosaic) for v5e-4 on an fsdp=2 x tensor=2 mesh,
and its figures are checked against hand arithmetic. The exit statuses of the tool are checked
with a preset far too big for its slice (exit 1) and bad input (exit 2); those never compile.
"""

import math

import pytest

pytest.importorskip("libtpu", reason="libtpu (the TPU compiler) is not installed: no TPU plans")

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from configs import qwen3vl_grpo  # noqa: E402
from cua_jax import plan as plan_lib  # noqa: E402
from cua_jax import sharding as shd  # noqa: E402
from cua_jax.models import qwen_vl  # noqa: E402
from tests.tools.plan_setup import (  # noqa: E402
    PAGE,
    PAGES,
    ROW_LEN,
    ROWS,
    SEQ,
    SLOTS,
    write_hf_dir,
)
from tests.tools.plan_setup import last_line as _last_line  # noqa: E402
from tests.tools.plan_setup import plan_config as _config  # noqa: E402
from tests.tools.plan_setup import run_tool as _tool  # noqa: E402
from tests.tools.plan_setup import tiny_128 as _tiny_128  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_hf_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def plan(hf_dir):
    # conftest sets "highest" matmul precision for CPU parity tests; runs use the default, and
    # Mosaic cannot compile the TPU kernel's f32-precision dot of bf16 K/V ("Bad rhs type")
    with jax.default_matmul_precision("default"):
        return plan_lib.make_plan(_config(hf_dir), "v5e-4", rows=ROWS, row_len=ROW_LEN)


def test_both_programs_compile_with_positive_figures(plan):
    assert [p.name for p in plan.programs] == ["train_step", "decode_step"]
    for p in plan.programs:
        assert p.compile_error is None, p.compile_error
        assert p.argument_bytes > 0 and p.temp_bytes > 0 and p.output_bytes > 0, p
        assert p.flops > 0 and p.bytes_accessed > 0 and p.roofline_s > 0, p
        assert 0 < p.total_bytes < plan.budget_bytes
    assert plan.fits and plan.reason() == ""
    text = plan_lib.format_plan(plan)
    assert "## train_step" in text and "## decode_step" in text and "fits:" in text
    assert "tpu kernel" in text  # head_dim 128: the Pallas TPU kernel, not the jnp fallback


def test_param_and_optimizer_bytes_match_hand_arithmetic(plan):
    # count x 4 bytes (f32) / the product of the mesh axes each dimension is sharded over
    mesh = {"data": 1, "fsdp": 2, "tensor": 2}
    model = nnx.eval_shape(lambda: qwen_vl.QwenVL(_tiny_128(), rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    specs = shd.param_specs(state, shd.DEFAULT_RULES)
    expected = 0
    for path, var in nnx.to_flat_state(state):
        spec = specs[".".join(map(str, path))]
        shards = math.prod(
            mesh[a] for axes in spec if axes for a in ((axes,) if isinstance(axes, str) else axes)
        )
        expected += math.prod(var.get_value().shape) * 4 // shards
    train = plan.programs[0]
    assert train.arguments["params (trainable)"] + train.arguments["params (frozen)"] == expected
    # Adam: mu and nu shaped and sharded as the params, plus a few int32 counters
    opt = train.arguments["optimizer state"]
    assert 0 <= opt - 2 * train.arguments["params (trainable)"] <= 64
    # the batch: 6 [R, L] arrays of 4 or 1 bytes and i32[3, R, L], rows over fsdp=2
    per_row_token = 4 + 4 + 1 + 4 + 4 + 4 + 3 * 4
    assert train.arguments["batch"] == ROWS * ROW_LEN * per_row_token // 2
    # the compiler agrees with the hand count of its arguments (TPU tiling may pad a little)
    hand = sum(train.arguments.values())
    assert hand <= train.argument_bytes <= 1.25 * hand


def test_kv_pool_and_kernel_counts_match_hand_arithmetic(plan):
    # pages x page_size x kv_heads x head_dim x 2 (K, V) x layers x 2 bytes (bf16) / tensor
    kv = PAGES * PAGE * 2 * 128 * 2 * 2 * 2 // 2
    decode = plan.programs[1]
    assert decode.arguments[f"KV pool ({PAGES} pages)"] == kv
    assert plan.programs[0].resident["KV pool (sampler, resident)"] == kv
    assert plan.summary["kv_pool_bytes"] == kv
    # the Pallas call, counted by hand: every slot at the context the pool holds for it
    ctx = min(SEQ, (PAGES - 1) * PAGE // SLOTS)
    heads, layers, tensor = 4, 2, 2
    assert decode.pallas_flops == 4 * heads * SLOTS * ctx * 128 * layers / tensor
    assert decode.pallas_bytes == 2 * 2 * SLOTS * ctx * 128 * 2 * layers / tensor
    assert decode.flops > decode.pallas_flops  # XLA's count of the rest is added
    # the pool sized from a budget holds exactly that budget's whole pages
    cfg = _tiny_128()
    per_page = plan_lib.kv_pool_bytes_per_device(cfg, 1, PAGE, "bfloat16", 2)
    assert per_page == kv // PAGES
    assert plan_lib.kv_pages_for_budget(cfg, 10 * per_page + 1, PAGE, "bfloat16", 2) == 10


def test_the_train_step_with_splash_attention_compiles_for_tpu(hf_dir):
    """model.attn_impl="splash": the learner's attention is JAX's Pallas splash kernel, compiled
    through Mosaic for the TPU devices (forward and backward kernels, under shard_map on the
    fsdp=2 x tensor=2 mesh); its FLOPs are added by hand (9 causal matmuls of T^2 N H per
    layer and row: forward 2, dK/dV 4, dQ 3)."""
    c = _config(hf_dir)
    c.model.attn_impl, c.model.attn_block = "splash", 128
    with jax.default_matmul_precision("default"):
        p = plan_lib.make_plan(c, "v5e-4", rows=ROWS, row_len=ROW_LEN, programs=("train_step",))
    (train,) = p.programs
    assert train.compile_error is None, train.compile_error
    heads, layers = 4, 2
    assert train.pallas_flops == 9 * ROW_LEN**2 * heads * 128 * ROWS * layers / 4
    assert train.pallas_bytes > 0 and train.flops > train.pallas_flops
    assert train.temp_bytes > 0 and train.total_bytes < p.budget_bytes


def test_train_step_screens_plans_the_trainers_largest_shape_with_its_screens(hf_dir):
    """The trainer's RL step takes a step's episodes as rows (the shape set) with their screens
    through the vision tower; `train_step_screens` compiles its largest shape. The screens are
    grouped by micro-batch and device (`image_groups`), as bytes (model.pixel_dtype "uint8"):
    with fsdp = 2 a device holds its group's budget, here both screens (a row could hold them
    all), so 2 x 16 patches x (3 x 16²) x 1 byte, by hand (as bf16 pixel values they were
    2 x 16 x (3 x 2 x 16²) x 2, 4x that)."""
    from cua_jax.data.processor import QwenVLProcessor
    from cua_jax.job import builders

    c = _config(hf_dir)
    c.rl.group_size, c.rl.groups_per_batch, c.env.max_turns = 2, 1, 1
    c.env.viewport_width = c.env.viewport_height = 64  # 2 x 2 patches of 32 after merging
    with jax.default_matmul_precision("default"):
        p = plan_lib.make_plan(c, "v5e-4", programs=("train_step_screens",))
    (q,) = p.programs
    assert q.compile_error is None, q.compile_error
    assert q.temp_bytes > 0 and q.flops > 0 and q.total_bytes < p.budget_bytes
    ic = QwenVLProcessor.default("qwen3_vl", max_pixels=64 * 64, min_pixels=32 * 32).image_config
    shapes = builders.shape_set(c, ic, row_multiple=2)  # fsdp=2 splits the rows
    largest = max(shapes.rl, key=lambda sh: sh.rows * sh.length)
    assert largest.rows == 2 and largest.patches == 2 * 16  # a screen each, 4 x 4 patches
    assert f"{largest.rows} rows x {largest.length} tokens and 2 screens" in q.notes[0]
    assert "2 a (micro-batch, device) group of 1 x 2" in q.notes[0]
    pixels = 2 * 16 * 3 * 16 * 16 * 1
    screens = q.arguments["screens (pixel values by micro-batch and device, and layout)"]
    assert pixels < screens < pixels + 4096  # + the vision tower's index arrays
    assert "no MFU / MBU" in plan_lib.format_plan(p)


def test_bad_input_raises_a_plan_input_error(hf_dir, tmp_path):
    c = _config(hf_dir)
    c.model.hf_path = str(tmp_path / "missing")
    with pytest.raises(plan_lib.PlanInputError, match="is not a directory"):
        plan_lib.make_plan(c, "v5e-4")
    with pytest.raises(plan_lib.PlanInputError, match=r"unknown programs \['train'\]"):
        plan_lib.make_plan(_config(hf_dir), "v5e-4", programs=("train",))
    c = _config(hf_dir)
    c.mesh.fsdp = 1  # 1 x 1 x 2 = 2 devices on a 4-chip slice
    with pytest.raises(plan_lib.PlanInputError, match="mesh does not fit v5e-4"):
        plan_lib.make_plan(c, "v5e-4")


def test_a_preset_far_too_big_exits_1_with_one_line():
    r = _tool("--config=configs/qwen25vl_grpo.py:72b", "--topology=v5e-4", "--config.mesh.tensor=4")
    assert r.returncode == 1, r.stderr[-2000:]
    line = _last_line(r.stderr)
    # the real presets plan their token-budget chunks: the first misfit is the shortest rows'
    assert line.startswith("tools/plan.py: rl_grads 4x4096 does not fit v5e-4"), line
    assert "biggest consumer" in line and "try " in line, line
    assert "does not fit" in r.stdout  # the table is printed too


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--topology=v9-8"], "unknown topology 'v9-8'; known: v4-8, "),
        (
            ["--topology=v5p-8", "--config.model.hf_path=/nope/ckpt"],
            "--config.model.hf_path=/nope/ckpt is not a directory",
        ),
        (
            ["--topology=v5p-16", "--config.mesh.fsdp=3"],
            "mesh does not fit v5p-16 (8 chips): mesh data=1 x fsdp=3 x expert=1 x tensor=2 "
            "needs 6 devices, have 8",
        ),
        (  # two hosts, one process each: the rows' batch axes must split between them
            ["--topology=v5p-16", "--config.mesh.fsdp=1", "--config.mesh.tensor=8"],
            "v5p-16 runs 2 processes: mesh data x fsdp = 1 must be a multiple of the 2 processes",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(args, expected):
    r = _tool("--config=configs/qwen3vl_grpo.py:8b", *args)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tools/plan.py: error: "), lines
    assert expected in lines[0], lines[0]
    assert r.stdout == ""  # nothing compiled, no table


def test_help_prints_the_usage_and_every_flag():
    r = _tool("--help")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tools/plan.py --config=" in r.stdout
    for flag in ("--topology", "--programs", "--json", "--list_topologies"):
        assert flag in r.stdout


def test_plan_for_the_devices_present(hf_dir):
    # the launch-time check: the same programs compiled for the local (CPU) device
    c = _config(hf_dir)
    c.mesh.fsdp = c.mesh.tensor = 1
    devices = jax.devices()[:1]
    p = plan_lib.make_plan(c, "", devices=devices, rows=1, row_len=128)
    assert p.topology.name == f"1 x {devices[0].device_kind}"
    assert p.fits, plan_lib.format_plan(p)
    assert all(prog.compile_error is None and prog.temp_bytes > 0 for prog in p.programs)
    assert "reference kernel" in plan_lib.format_plan(p)  # CPU: the jnp attention


def test_kv_pool_from_memory_is_what_the_learner_leaves_by_hand():
    """`size_kv_pool`: pages = (fraction x HBM - the largest program's peak) // a page's bytes
    (K and V of every layer, kv heads over tensor), and every program's resident pool is it."""
    cfg = _tiny_128()
    t = cfg.text
    sc = qwen3vl_grpo.get_config("smoke").sampler
    chip = plan_lib.CHIPS["v5e"]
    big = plan_lib.ProgramPlan(
        "rl_grads", chip, {"params": 3 << 30}, {"KV pool (sampler, resident)": 0}
    )
    small = plan_lib.ProgramPlan(
        "apply_update", chip, {"params": 1 << 30}, {"KV pool (sampler, resident)": 0}
    )
    pages, kv, note = plan_lib.size_kv_pool(cfg, sc, 2, 16 << 30, 0.5, [big, small])
    # f32 K and V of 2 layers, 1 kv head on each of tensor=2, 128 wide, 16-token pages
    page = 16 * 1 * 128 * 2 * 2 * 4
    assert sc.page_size == 16 and (t.num_key_value_heads, t.head_dim, t.num_hidden_layers) == (
        2,
        128,
        2,
    )
    assert pages == ((8 << 30) - (3 << 30)) // page and kv == pages * page
    assert (
        big.resident["KV pool (sampler, resident)"]
        == kv
        == small.resident["KV pool (sampler, resident)"]
    )
    assert f"{pages} pages" in note and "3.00 GiB" in note


def test_fitted_budget_by_hand():
    """`plan._fitted_budget`: a chunk program peaking at 10 GiB at 16384 tokens, 4 GiB of it
    fixed (params, accumulator, optimizer state), under a 7 GiB limit: the chunk's 6 GiB
    scaled to 3 -> 8192 tokens (a power of two at most half), row lengths above it dropped;
    never below the row that holds the longest sample; None when nothing smaller is left."""
    c = qwen3vl_grpo.get_config("2b")
    GiB = 2**30
    assert c.rl.row_lengths == (4096, 8192, 16384)
    need = plan_lib.longest_sample_tokens(c, 880)  # three 880-token screens, 15 turns
    assert need == 600 + 15 * (256 + 16) + 3 * 882 and 4096 < need <= 8192
    fit = plan_lib._fitted_budget(c, 16384, 4 * GiB, 10 * GiB, 7 * GiB, 880)
    assert fit == (8192, (4096, 8192))
    # a tighter limit would ask 2048 tokens: the floor is the 8192 row the longest sample needs
    assert plan_lib._fitted_budget(c, 16384, 4 * GiB, 10 * GiB, 5 * GiB, 880) == (
        8192,
        (4096, 8192),
    )
    assert plan_lib._fitted_budget(c, 8192, 4 * GiB, 10 * GiB, 5 * GiB, 880) is None
    c.env.max_turns = 3  # short episodes: 600 + 3 x 272 + 3 x 882 tokens fit a 4096 row
    assert plan_lib._fitted_budget(c, 16384, 4 * GiB, 10 * GiB, 5 * GiB, 880) == (4096, (4096,))


def test_devices_present_of_one_process_take_any_row_split(hf_dir):
    # the processes check counts the processes the devices belong to (here one), not a slice's
    # hosts: tensor=2 over two local devices leaves one row block, which one process gives
    c = _config(hf_dir)
    c.mesh.fsdp, c.mesh.tensor = 1, 2
    p = plan_lib.make_plan(c, "", devices=jax.devices()[:2], programs=("decode_step",))
    assert [prog.name for prog in p.programs] == ["decode_step"]
