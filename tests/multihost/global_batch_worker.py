"""One process of the global-batch check (`test_global_batch.py`): two GRPO steps of the smoke
model on 8 fixed samples (half with a screenshot), this process packing its
share (every process_count-th sample); prints the steps' metrics as one JSON line.

    python -m tests.multihost.global_batch_worker AGG_MODE:VARIANT [AGG_MODE:VARIANT ...]

Each VARIANT (plain, shapes, sdpo, entropulse, budget, budget_mixed) builds its own learner from
the same initial params and prints `RESULT AGG_MODE:VARIANT {json}`; one process start serves
them all. `budget_mixed` is `budget` with screens of two sizes.

With `shapes`, the learner has a strict shape set (one RL shape: 8 rows x 512 tokens, 8
screens of 4x6 patches), compiled ahead by `learner.warmup("rl")`; the result then also holds
how often the train step compiled after the warm-up.

With `sdpo`, the steps are SDPO steps (`SelfDistiller.train_step`, λ = 0.5) on 4 groups of a
failed and a successful one-turn episode, this process taking every process_count-th group:
each process runs the teacher pass on its share of the failures. With `entropulse`, an
Entropulse phase (2 SFT steps) on the successes of those groups (of every second group only:
on 2 processes the second has none), each process its own.
"""

import json
import os
import sys

import numpy as np

from launch.process import maybe_initialize_distributed


def samples(cfg, n=8, seed=0, wide=False):
    """`n` samples, every odd one with a 4x6-patch screenshot (`wide`: every fourth one's is
    4x8 instead, a second screen size in the batch)."""
    from cua_jax.rl.trajectory import Sample, rope_position_fn

    rng = np.random.default_rng(seed)
    v = cfg.vision
    pos_fn = rope_position_fn(cfg)
    out = []
    for i in range(n):
        text = rng.integers(16, 1000, 20 + 7 * i).astype(np.int32)
        pv = grid = None
        if i % 2:  # a 4x6-patch screenshot: 6 merged image tokens after the first 5 tokens
            grid = np.array([[1, 4, 8 if wide and i % 4 == 3 else 6]], np.int32)
            k = int(grid.prod()) // v.spatial_merge_size**2
            ids = np.concatenate(
                [
                    text[:5],
                    [cfg.vision_start_token_id],
                    [cfg.image_token_id] * k,
                    [cfg.vision_end_token_id],
                    text[5:],
                ]
            ).astype(np.int32)
            n = int(grid.prod())  # the screen in the model's form: bytes or floats
            if cfg.pixel_dtype == "uint8":
                pv = rng.integers(0, 256, (n, cfg.pixel_width), np.uint8)
            else:
                pv = rng.standard_normal((n, cfg.pixel_width)).astype(np.float32)
        else:
            ids = text
        mask = np.zeros(ids.size, bool)
        mask[-12:] = True
        out.append(
            Sample(
                input_ids=ids,
                loss_mask=mask,
                behaviour_logprobs=np.where(mask, -7.0, 0.0).astype(np.float32),
                position_ids=pos_fn(ids, grid),
                advantage=1.0 if i % 3 else -1.5,
                pixel_values=pv,
                image_grid_thw=grid,
                episode=i // 2,  # two samples per episode (the seq-mean modes' unit)
            )
        )
    return out


def sdpo_groups(processor, size, n_groups=4, hit_every=1):
    """Groups of two one-turn episodes at a screen of `size`, recorded as the agent loop records
    them: a miss (with the checker's message) and a hit (in every `hit_every`-th group; two
    misses in the others); the same on every process."""
    from cua_jax.rl.rollout import _Transcript
    from cua_jax.rl.trajectory import Trajectory, Turn

    tok = processor.tokenizer
    rng = np.random.default_rng(1)
    groups = []
    for g in range(n_groups):
        group = []
        for success, text in ((False, "click(x=10, y=20)"), (True, f"click(x={500 + g}, y=300)")):
            tr = _Transcript(processor, f"Press B{g}.", "You operate a computer.", 1)
            screen = rng.integers(0, 255, (size[1], size[0], 3), np.uint8)
            prompt = tr.prompt("", screen)
            gen = np.asarray(tok.encode(text) + [tok.im_end_id], np.int32)
            turn = Turn(
                prompt.ids,
                gen,
                np.full(gen.size, -1.0, np.float32),
                pixel_values=prompt.new_pixel_values,
                image_grid_thw=prompt.new_grid,
                extends_previous=prompt.extends,
            )
            success = success and g % hit_every == 0
            traj = Trajectory(
                f"t{g}",
                f"g{g}",
                [turn],
                reward=float(success),
                success=success,
                failure_reason=None if success else "max_turns",
            )
            if not success:
                traj.checker_message = f'Clicked at (10, 20); the target was "B{g}" at (500, 300).'
            group.append(traj)
        groups.append(group)
    return groups


def run_variant(agg, variant):
    """Two steps of `variant` ("plain", "shapes", "sdpo", "entropulse", "budget") on a fresh
    learner (the same initial params on every process and in every variant); its metrics."""
    import jax

    from configs.qwen3vl_grpo import get_config
    from cua_jax import multihost
    from cua_jax.job import builders

    c = get_config("smoke")
    c.mesh.fsdp = -1
    c.rl.loss_agg = agg
    c.rl.learning_rate = 1e-3
    mesh, rules = builders.mesh_and_rules(c)
    model, processor = builders.build_model_and_processor(c, mesh, rules)
    learner = builders.build_learner(model, c, mesh, rules, sft=False)
    mine = samples(learner.config)[jax.process_index() :: jax.process_count()]
    out = {}
    if variant == "sdpo":
        from cua_jax.rl import sdpo

        size = (c.env.viewport_width, c.env.viewport_height)
        groups = sdpo_groups(processor, size)[jax.process_index() :: jax.process_count()]
        distiller = sdpo.SelfDistiller(processor.chat, weight=0.5, topk=16)
        keys = ("loss", "grad_norm", "num_tokens", "sdpo_loss", "sdpo_tokens", "sdpo_divergence")
        for k in range(2):
            batch, _ = learner.prepare_batch(groups)
            m = distiller.train_step(learner, batch, groups)
            out.update({f"sdpo{k}/{key}": m[key] for key in keys})
            out[f"sdpo{k}/teacher_samples"] = int(
                multihost.allgather_ints([int(m["sdpo/teacher_samples"])]).sum()
            )
        return out
    if variant == "entropulse":
        from cua_jax.rl.entropulse import Entropulse

        size = (c.env.viewport_width, c.env.viewport_height)
        # successes in groups 0 and 2 only: on 2 processes the second has none to train on
        groups = sdpo_groups(processor, size, hit_every=2)
        groups = groups[jax.process_index() :: jax.process_count()]
        pulse = Entropulse(every=1, sft_steps=2, rows=4 // jax.process_count())
        m = pulse.after_step(1, learner, groups)
        keys = ("entropy_before", "entropy_after", "sft_loss_first", "sft_loss_last")
        return {f"entropulse/{k}": m[f"entropulse/{k}"] for k in keys}
    if variant in ("budget", "budget_mixed"):
        from cua_jax.rl.image_groups import ImageGroups
        from cua_jax.rl.shapes import Shape, ShapeSet

        # a chunk: one 256-token row a device (4 rows), 6 screens of 4x6 patches a device;
        # 16 samples of 20-133 tokens need two
        shape = Shape(4, 256, 4 * 6 * 24, 6)
        learner.shapes = ShapeSet(
            rl=(shape,), sft=(shape,), grid=(1, 4, 6), strict=True, tokens_per_chip=256
        )
        wide = variant == "budget_mixed"  # screens of two sizes: one size a chunk
        mine = samples(learner.config, n=16, wide=wide)
        mine = mine[jax.process_index() :: jax.process_count()]
        for k in range(2):
            batch = learner.pack(mine, mode="rl")
            grouped, shards = True, set()
            for part, _ in learner.chunks(batch):
                _, images = learner.layout.device_batch(part, learner.num_substeps)
                grouped &= isinstance(images, ImageGroups)
                if isinstance(images, ImageGroups):  # each device holds only its own group
                    shard = images.pixel_values.addressable_shards[0].data
                    shards.add(tuple(shard.shape[:2]))
            m = learner.train_step(batch)
            out.update({f"rl{k}/{key}": m[key] for key in ("loss", "grad_norm", "num_tokens")})
            out[f"rl{k}/grouped"] = grouped
            out[f"rl{k}/chunks_gt_1"] = batch.chunks > 1
            out[f"rl{k}/screen_shard"] = sorted(list(s) for s in shards)
            out[f"rl{k}/chunk_grids"] = sorted({str(g) for g in batch.chunk_grids})
        return out
    with_shapes = variant == "shapes"
    if with_shapes:
        from cua_jax.job import compile_stats
        from cua_jax.rl.shapes import Shape, ShapeSet

        learner.shapes = ShapeSet(
            rl=(Shape(8, 512, 8 * 24),), sft=(Shape(8, 512, 8 * 24),), grid=(1, 4, 6), strict=True
        )
        stats = compile_stats.install()
        learner.warmup("rl")
        mark = stats.snapshot()
        stats.expect_no_compiles(("rl_step",), strict=True)
    for k in range(2):
        batch = learner.pack(mine, mode="rl")
        m = learner.train_step(batch)
        out.update({f"rl{k}/{key}": m[key] for key in ("loss", "grad_norm", "num_tokens")})
        if with_shapes:
            stats.check()
            out[f"rl{k}/rows"] = batch.shape[0] * jax.process_count()
    if with_shapes:
        out["compiles_after_warmup"] = stats.since(mark).per_program.get("rl_step", 0)
        stats.reset_expectations()  # the next variant compiles its own steps
    return out


def main():
    maybe_initialize_distributed()
    for spec in sys.argv[1:]:  # AGG_MODE:VARIANT, run in this order on every process
        agg, variant = spec.split(":")
        print(f"RESULT {spec} " + json.dumps(run_variant(agg, variant)), flush=True)
    os._exit(0)  # no distributed shutdown handshake needed for a test worker


if __name__ == "__main__":
    main()
