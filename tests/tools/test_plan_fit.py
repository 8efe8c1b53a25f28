"""The plan's arithmetic of fitting a preset to a smaller slice, by hand (no TPU compile).

The figures are those of `tools/plan.py --config=configs/qwen3vl_grpo.py:2b --topology=v5e-8`
(2026-11-27, session 19), whose three chunk programs the TPU compiler refused: "the total
memory required for HLO temporaries (31.61G) exceeds available HBM (15.75G)" for 32x4096,
21.05G for 16x8192, 18.02G for 8x16384. Before, a refused chunk stopped the token budget's
refit and the plan blamed the KV pool; now it counts at the compiler's figure.
"""

import pytest

from configs import qwen3vl_grpo
from cua_jax import plan as plan_lib

GiB = 2**30
MiB = 2**20
CHIP = plan_lib.CHIPS["v5e"]
OOM = (
    "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory "
    "required for HLO temporaries (18.02G) exceeds available HBM (15.75G). HLO module: "
    "jit_rl_grads."
)


def _refused_chunk(temp: str = "18.02G") -> plan_lib.ProgramPlan:
    """2b's 8x16384 chunk program on v5e-8 (fsdp=8) as the plan recorded it: params, the
    gradient accumulator and the optimizer state of 2,127,532,032 f32 parameters over 8
    devices, the chunk's text and screens, no pool yet (it is sized after)."""
    shard = 2_127_532_032 * 4 // 8
    prog = plan_lib.ProgramPlan(
        "rl_grads 8x16384",
        CHIP,
        {
            "params (trainable)": shard,
            "params (frozen)": 0,
            "gradient accumulator": shard,
            "chunk (text)": 545_000,
            plan_lib._SCREENS_ARG: 200 * MiB,
        },
        {"optimizer state (resident)": 2 * shard, "KV pool (sampler, resident)": 0},
        rows=8,
        row_length=16384,
    )
    prog.compile_error = OOM.replace("18.02G", temp)
    prog.temp_bytes = plan_lib.compiler_oom_temp_bytes(prog.compile_error)
    return prog


def test_the_compilers_out_of_memory_figure_is_read_in_bytes():
    assert plan_lib.compiler_oom_temp_bytes(OOM) == int(18.02 * GiB)
    assert plan_lib.compiler_oom_temp_bytes("... HLO temporaries (512.5M) exceeds ...") == int(
        512.5 * MiB
    )
    assert plan_lib.compiler_oom_temp_bytes("RESOURCE_EXHAUSTED: out of memory") == 0


def test_a_refused_program_counts_its_temporaries_and_the_plan_says_what_to_lower():
    prog = _refused_chunk()
    shard = 2_127_532_032 * 4 // 8  # 0.99 GiB
    assert prog.total_bytes == 4 * shard + 545_000 + 200 * MiB + int(18.02 * GiB)
    assert next(iter(prog.consumers())) == "temp (activations, scratch)"
    plan = plan_lib.Plan(plan_lib.TOPOLOGIES["v5e-8"], {"fsdp": 8}, 0.1, [prog], {})
    plan.summary.update(tokens_per_chip=16384, least_tokens_per_chip=8192)
    why = plan.reason()
    assert not plan.fits
    assert "needs 22.2 GiB per device > 14.4 GiB" in why and "compiler's count" in why
    assert "temp (activations, scratch) 18.0 GiB" in why
    assert "--config.rl.tokens_per_chip (now 16384; the least is 8192" in why


def test_a_refused_chunk_is_planned_again_at_the_budget_its_figure_asks():
    """The limit is (kv_memory_fraction - kv_min_fraction) of 16 GiB = 9.6 GiB; the fixed part
    (params, accumulator, optimizer state) 3.96 GiB; the chunk 18.02 GiB of temporaries plus
    0.2 GiB of screens and text scaled to 16384 x 5.64 / 18.22 = 5072 tokens -> 4096, below the
    8192 row the preset's longest turn sample needs: 8192, the rows above it dropped."""
    c = qwen3vl_grpo.get_config("2b")
    limit = int(16 * GiB * (0.85 - 0.25))
    assert c.sampler.kv_memory_fraction == 0.85 and c.sampler.kv_min_fraction == 0.25
    assert plan_lib.least_tokens_per_chip(c, 880) == 8192
    assert plan_lib.next_budget(c, [_refused_chunk()], limit, 880) == (8192, (4096, 8192))
    # a refusal without a figure stops the refit (nothing to scale)
    blind = _refused_chunk()
    blind.temp_bytes = 0
    assert plan_lib.next_budget(c, [blind], limit, 880) is None
    # at the floor already: nothing smaller to try, the misfit is reported as planned
    c.rl.tokens_per_chip, c.rl.row_lengths = 8192, (4096, 8192)
    assert plan_lib.next_budget(c, [_refused_chunk("9.5G")], limit, 880) is None
    # a chunk within the limit is not planned again
    c.rl.tokens_per_chip = 16384
    fits = _refused_chunk("4.0G")
    fits.compile_error = None
    assert fits.total_bytes <= limit and plan_lib.next_budget(c, [fits], limit, 880) is None


def test_the_pool_gives_up_the_sampler_programs_own_scratch():
    """2b's prefill_turn on v5e-8 with the 1201-page pool the learner's programs left: 15.55
    GiB (params 0.99, the pool 8.21, the optimizer state 1.98, its temporaries 4.27) against
    85% of 16 GiB = 13.6 GiB: 1.95 GiB over, 286 pages of 7 MiB (K and V of 28 layers, 8 kv
    heads of 128, 64 tokens, bf16)."""
    cfg = plan_lib.model_config(qwen3vl_grpo.get_config("2b"))
    per_page = plan_lib.kv_pool_bytes_per_device(cfg, 1, 64, cfg.dtype, 1)
    assert per_page == 28 * 8 * 128 * 2 * 64 * 2 == 7 * MiB
    prefill = plan_lib.ProgramPlan(
        "prefill_turn", CHIP, {"params": 0}, {}, argument_bytes=int(15.55 * GiB)
    )
    decode = plan_lib.ProgramPlan(
        "decode_step", CHIP, {"params": 0}, {}, argument_bytes=int(11.77 * GiB)
    )
    over = int(15.55 * GiB) - int(16 * GiB * 0.85)
    cut = plan_lib.sampler_pool_cut([decode, prefill], 16 * GiB, 0.85, per_page)
    assert cut == -(-over // per_page) == 286
    assert plan_lib.sampler_pool_cut([decode], 16 * GiB, 0.85, per_page) == 0


@pytest.mark.parametrize(
    ("pages", "min_frac", "expected"),
    [
        (586, 0.25, ""),  # 586 x 7 MiB = 4102 MiB >= a quarter of 16 GiB
        (585, 0.25, "less than sampler.kv_min_fraction=0.25 of 16 GiB (4.00 GiB)"),
        (257, 0.0, ""),  # 256 pages of 64 past the scratch page: one 16384-token sequence
        (256, 0.0, "not one sequence of sampler.max_seq_len=16384"),
    ],
)
def test_a_pool_a_run_would_refuse_is_a_plan_problem(pages, min_frac, expected):
    c = qwen3vl_grpo.get_config("2b")
    cfg = plan_lib.model_config(c)
    why = plan_lib.kv_pool_problem(cfg, c.sampler, pages, 1, 16 * GiB, min_frac)
    assert (expected in why) if expected else why == ""
    plan = plan_lib.Plan(plan_lib.TOPOLOGIES["v5e-8"], {}, 0.1, [], {}, [why] if why else [])
    assert plan.fits == (not expected) and plan.reason() == why


def test_a_pool_too_small_names_freezing_a_trained_vision_tower():
    c = qwen3vl_grpo.get_config("2b")
    cfg = plan_lib.model_config(c)
    trained = plan_lib.kv_pool_problem(cfg, c.sampler, 100, 1, 16 * GiB, 0.25, True)
    frozen = plan_lib.kv_pool_problem(cfg, c.sampler, 100, 1, 16 * GiB, 0.25, False)
    assert "--config.model.freeze_vision=True, lower --config.rl.tokens_per_chip" in trained
    assert "freeze_vision" not in frozen and "lower --config.rl.tokens_per_chip" in frozen
