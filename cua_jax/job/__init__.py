"""The training job's phases below `cua_jax.train`: each takes typed settings, not the config.

sft.mid_training / sft.sft_warmup   # the SFT learner's phases before RL
resume.resume_source / save_checkpoint / process_meta   # a run's checkpoints and resume
steps.next_groups / job_metrics / env_pool_metrics      # pieces of one GRPO step
"""
