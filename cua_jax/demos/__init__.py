"""Training data beyond the policy's inputs: demonstrations and grounding samples for the SFT
learner, streamed through grain.

    from cua_jax.demos.sft_batches import oracle_sft_batches, sft_file_batches
    from cua_jax.demos.pipeline import JsonlDemonstrations, sft_dataset, batch_iterator
    from cua_jax.demos.shards import ShardWriter, GroundingShards, GroundingDemos
    from cua_jax.demos.grounding import render_sample

`sft_batches` (the SFT warm-up's packed batches: the tasks' oracle demonstrations, or files),
`pipeline` (grain pipelines over trajectory directories, JSONL episodes and grounding shards),
`shards` (grounding samples on disk as ArrayRecord), `grounding` (the synthetic screens).
This package sits above `cua_jax.rl` (it reads its trajectories and packs its batches) and
below `cua_jax.job`, whose SFT phases use it.
"""
