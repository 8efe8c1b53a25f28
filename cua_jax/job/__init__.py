"""The training job: the run (`train`), what it is built from (`builders`: the config becomes
typed settings and objects here), the ahead-of-time compiles (`warmup`, `compile_stats`), and
its phases, each taking typed settings, not the config.

train.main / train.run                                   # the whole job, phase by phase
builders.build_learner / build_engine / ...              # the config's one reader below train
warmup.begin                                             # the shape set compiled in a thread
state.RunState                                           # the run's parts, phase to phase
sft.mid_training / sft.sft_warmup                        # the SFT learner's phases before RL
grpo.grpo / grpo.RLSignal                                # the GRPO steps; did any update?
resume.resume_source / save_checkpoint / process_meta    # a run's checkpoints and resume
steps.next_groups / job_metrics / env_pool_metrics       # pieces of one GRPO step
loading.load_policy / export.export_checkpoint           # a run's policy for eval, serving, HF
"""
