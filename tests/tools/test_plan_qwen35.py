"""The planner on Qwen3.5's hybrid cache: the sampler's programs take page pools for the
full-attention layers only and every Gated DeltaNet layer's state rows, and the KV pool sized
from memory leaves room for those states, each checked against hand arithmetic."""

import pytest

from configs import qwen3vl_grpo, qwen35_grpo
from cua_jax import plan as plan_lib
from cua_jax.plan.abstract import model_config
from cua_jax.sampler import steps

# the tiny Qwen3.5: 2 decoder layers, one Gated DeltaNet layer then one full-attention layer;
# linear heads 2 key / 4 value of 32 / 16 dims, conv kernel 4; 2 kv heads of 32; bf16
SLOTS, PAGES, PAGE = 16, 1024, 16


def _config():
    c = qwen35_grpo.get_config("smoke")
    c.model.dtype = "bfloat16"
    c.mesh.fsdp, c.mesh.tensor = 2, 2
    assert (c.sampler.max_slots, c.sampler.num_pages, c.sampler.page_size) == (SLOTS, PAGES, PAGE)
    return c


def _state_bytes_by_hand(tensor: int) -> int:
    """Rows: 16 slots + 16 sessions. Conv window [rows, 3, 2*2*32 + 4*16] bf16 and recurrent
    state f32[rows, 4, 32, 16] of the one linear layer; both split over tensor (4 value heads
    and 192 channels divide by 2)."""
    rows = 2 * SLOTS
    conv = rows * 3 * (2 * 2 * 32 + 4 * 16) * 2
    recurrent = rows * 4 * 32 * 16 * 4
    return (conv + recurrent) // tensor


def test_the_tiny_models_layout_is_what_the_hand_figures_assume():
    t = model_config(_config()).text
    assert [t.layer_type(i) for i in range(t.num_hidden_layers)] == [
        "linear_attention",
        "full_attention",
    ]
    got = (t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim)
    assert got == (2, 4, 32)
    assert (t.linear_value_head_dim, t.linear_conv_kernel_dim) == (16, 4)
    assert (t.num_key_value_heads, t.head_dim) == (2, 32)


@pytest.fixture(scope="module")
def sampler_plan():
    return plan_lib.make_plan(_config(), "v5e-4", programs=("decode_step", "prefill_turn"))


def test_sampler_programs_take_pools_for_attention_layers_and_the_linear_states(sampler_plan):
    """K and V pools of the one full-attention layer only (1024 pages x 16 tokens x 1 kv head a
    device x 32 x bf16 x 2), and the state rows; the compiled programs take at least both."""
    pool = PAGES * PAGE * 1 * 32 * 2 * 2
    states = _state_bytes_by_hand(tensor=2)
    assert sampler_plan.summary["linear_state_bytes"] == states
    for p in sampler_plan.programs:
        assert p.compile_error is None, p.name
        assert p.arguments[f"KV pool ({PAGES} pages)"] == pool
        assert p.arguments[f"linear states (1 layers x {2 * SLOTS} rows)"] == states
        assert p.argument_bytes >= p.arguments["params"] + pool + states
    decode = next(p for p in sampler_plan.programs if p.name == "decode_step")
    assert "1 of 2 layers attend, the other 1 keep Gated DeltaNet states" in " ".join(decode.notes)


def test_kv_pool_from_memory_leaves_the_linear_states_their_room():
    """`size_kv_pool` with states: pages = (fraction x HBM - peak - states) // a page's bytes,
    and each learner program's resident sampler cache is the pool plus the states."""
    cfg = model_config(_config())
    sc = _config().sampler
    chip = plan_lib.CHIPS["v5e"]
    big = plan_lib.ProgramPlan(
        "rl_grads", chip, {"params": 3 << 30}, {"KV pool (sampler, resident)": 0}
    )
    states = _state_bytes_by_hand(tensor=2)
    pages, kv, note = plan_lib.size_kv_pool(cfg, sc, 2, 16 << 30, 0.5, [big], states)
    page = PAGE * 1 * 32 * 2 * 1 * 2  # tokens x kv heads a device x dim x (K, V) x layers x bf16
    assert pages == ((8 << 30) - (3 << 30) - states) // page and kv == pages * page
    assert big.resident["KV pool (sampler, resident)"] == kv + states
    assert "linear states" in note


def test_a_program_planned_with_the_states_resident_counts_them_once():
    """The learner's programs are planned with the sampler's cache (the linear states) resident;
    the pool is sized from their peak without it, so the states come out of the budget once:
    the same pages as a program planned with nothing resident (the 35B-A3B plan lost 7.68 GiB
    a device to the double count)."""
    cfg = model_config(_config())
    sc = _config().sampler
    chip = plan_lib.CHIPS["v5e"]
    states = _state_bytes_by_hand(tensor=2)
    bare = plan_lib.ProgramPlan(
        "rl_grads", chip, {"params": 3 << 30}, {"KV pool (sampler, resident)": 0}
    )
    with_states = plan_lib.ProgramPlan(
        "rl_grads", chip, {"params": 3 << 30}, {"KV pool (sampler, resident)": states}
    )
    a = plan_lib.size_kv_pool(cfg, sc, 2, 16 << 30, 0.5, [bare], states)
    b = plan_lib.size_kv_pool(cfg, sc, 2, 16 << 30, 0.5, [with_states], states)
    assert a[:2] == b[:2] and a[0] > 0
    assert with_states.total_bytes == (3 << 30) + a[1] + states  # resident: the pool + states


def test_the_linear_state_bytes_the_run_and_the_plan_share():
    """`steps.linear_state_bytes_per_device` (what `builders.kv_pages` and the plan take out of
    the KV budget): the hand figure split over tensor=2, whole on one device, 0 for Qwen3-VL."""
    cfg = model_config(_config())
    rows = steps.linear_state_rows(SLOTS)
    assert rows == 2 * SLOTS
    assert steps.linear_state_bytes_per_device(cfg, rows, 2) == _state_bytes_by_hand(2)
    assert steps.linear_state_bytes_per_device(cfg, rows, 1) == _state_bytes_by_hand(1)
    dense = model_config(qwen3vl_grpo.get_config("smoke"))
    assert steps.linear_state_bytes_per_device(dense, rows, 2) == 0
