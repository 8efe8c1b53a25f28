"""Shared pieces of every config: argument parsing and the default sections.

A config file is a small Python program (big_vision style): `get_config(arg)` builds a
`ml_collections.ConfigDict` and `arg` picks a preset. Every field that a user may override on the
command line exists here with its type, so `--config.rl.group_size=8` is type-checked and a typo
(`--config.rl.gruop_size=8`) fails before any work starts. The ConfigDict stops at `train.py`:
library code takes typed arguments.
"""

from __future__ import annotations

import ml_collections
from ml_collections import ConfigDict, FieldReference


def parse_arg(arg: str | None, *, presets: tuple[str, ...], default: str) -> str:
    """Returns the preset named by `arg` (`config.py:smoke`), or fails naming the valid ones."""
    name = (arg or default).strip()
    if name not in presets:
        raise ValueError(
            f"unknown preset {name!r}; this config file has presets {', '.join(presets)} "
            f"(use --config=FILE:PRESET)"
        )
    return name


def _str(value: str | None = None) -> FieldReference:
    """An optional string field that stays overridable when its default is None."""
    return FieldReference(value, field_type=str)


def base_config(family: str) -> ConfigDict:
    c = ConfigDict()
    c.seed = 0
    c.total_steps = 100  # GRPO learner steps
    # JAX's persistent compilation cache (reruns and resumed runs skip compiles); "" = off
    c.compile_cache_dir = _str("~/.cache/cua_jax/jax")
    # The TPU slice a real preset is sized for (its config file's TOPOLOGY): what
    # `tools/plan.py` plans when no --topology is given. None for the CPU presets.
    c.topology = _str()

    # ---- model --------------------------------------------------------------------------------
    c.model = ConfigDict()
    c.model.family = family  # "qwen2_5_vl" | "qwen3_vl"
    c.model.hf_path = _str()  # local HF directory; None -> random init of `preset`
    # used only when hf_path is None: "tiny" | "small" (twice tiny's depth and width) |
    # "tiny_moe" (Qwen3-VL-MoE)
    c.model.preset = "tiny"
    c.model.dtype = "float32"  # activations / compute
    c.model.param_dtype = "float32"
    c.model.remat = "none"  # "none" | "full" | "dots" | "ordered" (text.remat_call)
    # the learner's attention in query blocks of this many tokens (f32 scores [heads, block, L]
    # instead of [heads, L, L]); 0: dense
    c.model.attn_block = 0
    # "xla" (the jnp attention, dense or in attn_block query blocks) or "splash" (the Pallas
    # TPU splash attention kernel in attn_block tiles, 512 when 0: flash-style, no [L, L]
    # scores; a TPU kernel, interpret mode on CPU)
    c.model.attn_impl = "xla"
    # MoE models on a mesh with an expert axis: how tokens meet their experts. "all_to_all"
    # sends each (token, expert) row to the device holding its expert and back
    # (ragged_all_to_all on TPU / GPU); "all_gather" gathers every expert device's tokens and
    # psums; "auto": all_to_all where the rules split the tokens over the expert axis
    c.model.moe_dispatch = "auto"
    # Qwen3.5's chunked gated delta rule: "reference" (jnp), "pallas" (the Pallas TPU kernel,
    # interpret mode on CPU; a Pallas backward kernel too) or "auto" (pallas on TPU, reference
    # elsewhere)
    c.model.gated_delta_impl = "reference"
    # the form screens take from the processor to the device: "uint8", the frame's bytes in patch
    # order (8x fewer bytes in episodes, the store, batches and HBM; the model normalizes them on
    # the device); "float32", transformers' pixel_values
    c.model.pixel_dtype = "uint8"
    c.model.lora_rank = 0  # 0 = full fine-tuning
    c.model.lora_alpha = 16.0
    # Regexes over dotted module paths (= cua_jax.models.lora.DEFAULT_TARGETS): the language
    # model's attention and MLP projections only. Bare names such as "gate_proj" would also
    # match Qwen2.5-VL's vision MLP, which model.freeze_vision does not stop under LoRA.
    c.model.lora_targets = (
        r"language_model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj$",
        r"language_model\.layers\.\d+\.mlp\.(gate|up|down)_proj$",
    )
    c.model.freeze_vision = False

    # ---- mesh / sharding --------------------------------------------------------------------
    c.mesh = ConfigDict()
    c.mesh.data = 1
    c.mesh.fsdp = -1  # -1: all remaining devices
    c.mesh.tensor = 1
    c.mesh.expert = 1  # MoE expert parallelism: experts split over this many devices
    c.mesh.rules = ()  # extra (logical, mesh-axes) pairs overriding cua_jax.sharding.DEFAULT_RULES

    # ---- sampler -------------------------------------------------------------------------------
    c.sampler = ConfigDict()
    c.sampler.max_slots = 16
    c.sampler.page_size = 16
    c.sampler.num_pages = 512
    # > 0: the KV pool takes what the learner leaves of this share of each device's memory
    # (its params, optimizer state and largest program; cua_jax.job.builders.kv_pages, planned by
    # cua_jax.plan.size_kv_pool) instead of num_pages, which stays for devices that report no
    # memory (the CPU)
    c.sampler.kv_memory_fraction = 0.0
    # with kv_memory_fraction: the least share of a device's memory the pool must get.
    # tools/plan.py lowers rl.tokens_per_chip (and drops longer rl.row_lengths) until the
    # learner's largest program leaves it; a run whose pool comes out smaller stops at start
    c.sampler.kv_min_fraction = 0.0
    c.sampler.max_seq_len = 4096
    c.sampler.decode_chunk = 8
    c.sampler.backend = "auto"  # paged-attention backend: auto | tpu | gpu | interpret | reference
    # our Pallas GPU kernel's tuning, e.g. "pages_per_block=4,f32_dots=false" (GpuKernelOptions)
    c.sampler.gpu_kernel = ""

    # ---- rl --------------------------------------------------------------------------------------
    c.rl = ConfigDict()
    c.rl.mode = "sync"  # "sync" | "async"
    c.rl.group_size = 8
    c.rl.groups_per_batch = 4
    c.rl.learning_rate = 1e-6
    c.rl.max_tokens = 128  # new tokens per turn
    c.rl.temperature = 1.0
    c.rl.top_p = 1.0
    # reward = task score - this x (invalid actions in the episode); success uses the score
    c.rl.invalid_action_penalty = 0.0
    # dense shaping, off at 0: a failed episode's reward += this x the checker's closeness in
    # [0, 1] (how near its clicks came to the task's targets; built-in browser tasks report it)
    c.rl.closeness_reward = 0.0
    c.rl.kl_penalty_coef = 0.0
    c.rl.kl_estimator = "k3"
    c.rl.clip_low = 0.2
    c.rl.clip_high = 0.28
    # "behaviour": PPO ratio against the sampler's log-probs; "learner": against the learner's
    # own log-probs at the step's start, with truncated importance sampling (tis_cap) for the
    # sampler/learner mismatch and staleness (async mode).
    c.rl.old_logprobs = "behaviour"
    c.rl.tis_cap = 2.0
    c.rl.loss_agg = "token-mean"
    # Dr. GRPO's constant C for loss_agg="seq-mean-token-sum-norm" (0: the generation budget,
    # rl.max_tokens x env.max_turns)
    c.rl.loss_norm = 0.0
    c.rl.std_normalize = True
    c.rl.filter_zero_variance = True
    # micro-batches of gradient accumulation (memory only: one optimizer update per batch)
    c.rl.num_substeps = 1
    # ---- RL levers (cua_jax.rl.advantages / cua_jax.rl.sources; BENCHMARKS.md "RL that learns")
    c.rl.advantage = "grpo"  # "grpo" | "drgrpo" | "rloo"
    # PPO updates per batch: the step's groups are split into ppo_minibatches mini-batches and
    # each gets an optimizer update, ppo_epochs times over (needs old_logprobs="behaviour": the
    # ratio is against the sampler's log-probs, so it moves off 1 after the first update)
    c.rl.ppo_epochs = 1
    c.rl.ppo_minibatches = 1
    # DAPO dynamic sampling: zero-variance groups are replaced by new ones, at most
    # max_sampling_rounds x groups_per_batch groups sampled per step
    c.rl.dynamic_sampling = False
    c.rl.max_sampling_rounds = 3
    # ARPO success replay: an all-failed group gets a stored success of its task at most
    # replay_max_staleness learner steps old (-1: max_steps_off_policy)
    c.rl.replay_successes = False
    c.rl.replay_max_staleness = -1
    c.rl.persist_rollouts = False  # every rollout -> WORKDIR/rollouts (a source for SFT)
    # ---- SDPO (cua_jax.rl.sdpo): the policy shown feedback on a failed episode (its last
    # screen, the checker's message, a successful peer's tool calls) is a teacher distilled into
    # itself on the episode's own tokens; a step minimises (1 - sdpo_weight) GRPO + sdpo_weight SDPO
    c.rl.algorithm = "grpo"  # "grpo" | "sdpo"
    c.rl.sdpo_weight = 1.0
    c.rl.sdpo_divergence = "js"  # "kl" (forward) | "rkl" (reverse) | "js" (generalised, js_beta)
    c.rl.sdpo_js_beta = 0.5
    c.rl.sdpo_topk = 64  # the teacher's top-k ids (+ one tail bucket); 0: the whole vocabulary
    c.rl.sdpo_teacher = "current"  # "current" | "ema" (rate sdpo_ema per step)
    c.rl.sdpo_ema = 0.05
    c.rl.sdpo_feedback = "final_screenshot,checker_message,peer_success"  # any of these
    # ---- Entropulse (cua_jax.rl.entropulse): after every entropulse_every RL steps (0: off),
    # entropulse_sft_steps SFT steps on the run's own successes since the last phase
    c.rl.entropulse_every = 0
    c.rl.entropulse_sft_steps = 10
    c.rl.entropulse_reset_optimizer = False  # the next RL phase starts a fresh optimizer state
    c.rl.max_steps_off_policy = 1
    c.rl.entropy_coef = 0.0
    c.rl.row_lengths = (1024, 2048, 4096)  # packing buckets
    c.rl.rows_per_step = 8
    # The learner's log-probs / entropies are computed this many positions at a time (the chunk's
    # logits are recomputed in the backward pass): f32 logits of a 16k-token row at a ~152k
    # vocabulary are ~10 GB. 0 = every position at once.
    c.rl.logits_chunk = 1024
    # MoE: coef x the router's load-balancing loss over the trained tokens (0: off), and routing
    # replay: the learner routes each token through the experts the sampler chose for it
    c.rl.router_aux_coef = 0.0
    c.rl.routing_replay = False
    # ---- compile once (cua_jax/rl/shapes.py): the learner packs every batch into one of a
    # few (rows, row length, patches) shapes decided here, compiled at start-up. RL rows (0: one
    # per episode of a step), screens per row in the patch budget (0: what a row can hold, at
    # most env.max_turns x env.max_history_images); strict: a batch or program outside the set
    # is an error (tests), else a logged, counted recompile (production)
    c.rl.learner_rows = 0
    c.rl.images_per_row = 0
    # > 0: a token-budget shape set instead: the learner's rows hold this many tokens a chip a
    # micro-batch (max(1, T // L) rows of each row length L), a batch is as many such chunks
    # as its samples need, one gradient call each and one optimizer update (memory is one
    # chunk's whatever env.max_turns and env.max_history_images are); screens a chip a
    # micro-batch (0: all its tokens can hold). Replaces rl.learner_rows / rl.images_per_row
    c.rl.tokens_per_chip = 0
    c.rl.screens_per_chip = 0
    c.rl.strict_shapes = False
    # compiled ahead, before step 1: "none" | "learner" (its RL and SFT steps) | "all" (and the
    # sampler's bucket set: cua_jax.sampler.scheduler.BucketSet)
    c.rl.warmup = "learner"

    # ---- optim ---------------------------------------------------------------------------------
    c.optim = ConfigDict()
    c.optim.schedule = "constant"  # "constant" | "cosine"
    c.optim.warmup_steps = 0
    c.optim.weight_decay = 0.0
    c.optim.grad_clip = 1.0
    # an update larger than this x the parameters' norm (or not finite) is not applied and the
    # run stops naming the last good checkpoint (0: off)
    c.optim.max_update_ratio = 1.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999

    # ---- SFT warm-up ---------------------------------------------------------------------------
    c.sft = ConfigDict()
    c.sft.steps = 0  # 0 = no warm-up
    c.sft.learning_rate = 1e-5
    # "oracle": the tasks' scripted solutions (kept in WORKDIR/sft_demos), or a trajectory
    # directory (e.g. an earlier run's sft_demos) or a .jsonl of token-level episodes
    # (cua_jax.demos.pipeline); file batches hold rl.rows_per_step episodes.
    c.sft.source = "oracle"
    c.sft.episodes_per_task = 4
    # oracle demonstrations of the first this many training tasks only (0: all): RL may then
    # train on far more distinct tasks than the warm-up demonstrates
    c.sft.num_tasks = 0
    # Share of oracle demonstrations that start with a scripted miss (a click at a random point,
    # no loss on it) and then recover: the model sees second turns, not only perfect first ones.
    c.sft.recovery_share = 0.0
    # Share of oracle demonstrations also trained with SDPO's feedback message before the task
    # (rl.sdpo_feedback of a scripted failed attempt at the same page;
    # cua_jax.demos.sft_batches): the self-teacher then knows how to read feedback. For
    # rl.algorithm="sdpo"; oracle source only.
    c.sft.feedback_share = 0.0

    # ---- grounding mid-training (before the SFT warm-up, with the SFT learner and rate) -------
    # Synthetic screens streamed from shard directories (tools/make_grounding_data.py,
    # cua_jax.demos.shards): one-turn click demonstrations; the held-out grounding curve goes
    # to WORKDIR/mid_curve.jsonl. A shard directory also works as config.sft.source.
    c.mid = ConfigDict()
    c.mid.steps = 0  # 0 = none
    c.mid.batch_size = 16  # demonstrations a step
    c.mid.source = ""  # the training screens' shard directory
    c.mid.heldout = ""  # held-out screens ("--split=heldout"); "" = no grounding eval
    c.mid.eval_every = 0  # a held-out eval every this many steps (0: at the start and end only)
    c.mid.eval_samples = 128  # held-out screens per eval

    # ---- environment -------------------------------------------------------------------------
    c.env = ConfigDict()
    c.env.kind = "browser"  # "browser" | "vm"
    c.env.concurrency = 8
    c.env.max_turns = 5
    c.env.max_history_images = 2
    # A 1280x720-class screen the processor takes as it is (its smart_resize of 1280x720, with
    # max_pixels the viewport's area): the same patches as 1280x720 resized, without the
    # trainer's bicubic resize of every screen (9.4 ms a 1280x720 screen; BENCHMARKS "Desktops
    # in the sim").
    c.env.viewport_width = 1260 if family == "qwen2_5_vl" else 1280
    c.env.viewport_height = 700 if family == "qwen2_5_vl" else 704
    c.env.executable_path = _str()  # Chromium; autodetected when None
    c.env.step_timeout_s = 20.0
    c.env.action_format = "qwen3vl" if family == "qwen3_vl" else "qwen25vl"
    c.env.system_prompt = "tools"  # "tools" (the full tool schema) | "compact" (tiny models)
    # Sample every turn within the action format's grammar (qwen25vl / qwen3vl): each reply is
    # one well-formed tool call (turns of tasks with API actions stay free)
    c.env.constrain_actions = False
    c.env.vm_endpoints = ()  # for kind="vm" with remote VMs: base URLs
    c.env.vm_token = _str()
    # how a remote VM is reset before each episode (envs.vm.providers.revert_hook):
    # "" | "libvirt:DOMAIN@SNAPSHOT" | "qemu:MONITOR_SOCKET@SNAPSHOT" | "docker:CONTAINER" |
    # "cmd:COMMAND" ({index}, {url}, {host}, {port} filled in per endpoint)
    c.env.vm_revert = ""
    c.env.vm_docker_image = ""  # kind="vm": desktops in containers of this image instead
    # kind="vm": desktops as QEMU guests of this disk image instead (OSWorld's Ubuntu.qcow2:
    # its server on guest port 5000), each on a copy-on-write overlay, reverted to the booted
    # state before each episode (envs/vm/qemu.py); KVM when /dev/kvm is usable
    c.env.vm_qemu_image = ""
    c.env.vm_qemu_memory_mb = 4096
    c.env.vm_qemu_cpus = 2
    c.env.desktop_memory_mb = 0  # address-space cap of a local desktop's processes (0: none)
    # a local or Docker desktop's task budget (its cgroup's pids.max; a fork bomb stops there)
    # and CPU-core quota (0: none); envs/vm/limits.py
    c.env.desktop_max_processes = 4096
    c.env.desktop_cpus = 0.0
    # CPU seconds of each command a local desktop's server runs (RLIMIT_CPU: a busy loop ends
    # by SIGXCPU, a bounded fault of its episode); 0: no cap
    c.env.desktop_command_cpu_s = 0.0
    # kind="browser": remote browser hosts ('host:port' of `python -m envs.browser.server`);
    # episodes spread over them and the local pool (env.concurrency envs)
    c.env.browser_endpoints = ()
    c.env.browser_token = _str()  # their bearer token (default $CUA_BROWSER_TOKEN)
    # how they send screens: "frame" (raw pixels, zstd: 2-4x less decode CPU than a PNG on the
    # trainer, envs/screenshots.py) | "png" (the browser's own; smaller for photo-like pages)
    c.env.host_screens = "frame"
    c.env.page_memory_mb = 0  # per-page JavaScript heap cap of local browsers (0: V8's default)
    # kind="browser": "" (the local pool and env.browser_endpoints) | "ray": browser hosts as
    # Ray actors, found in the cluster with no endpoint list, placed by the `browser_host`
    # resource, restarted by Ray (envs/ray_fleet.py; pip install -e '.[ray]')
    c.env.fleet = ""
    # (env.concurrency envs: hosts of 16, one CPU each, started and kept by the trainer)
    c.env.ray_address = ""  # ray.init address: "auto", "ray://HEAD:10001" ("": a local Ray)

    # ---- tasks -----------------------------------------------------------------------------------
    c.tasks = ({"source_type": "builtin", "split": "train", "seed": 0},)
    c.eval_tasks = ({"source_type": "builtin", "split": "eval", "seed": 1000},)

    # ---- checkpoints -------------------------------------------------------------------------
    c.ckpt = ConfigDict()
    c.ckpt.save_every = 50
    c.ckpt.keep = 3
    c.ckpt.load_checkpoint_path = _str()  # resume another run (params, optimizer, step, ...)
    # start a new run from another run's weights only (e.g. full SFT, then RL with
    # model.freeze_vision=True or LoRA): WORKDIR/checkpoints of that run; step -1 = latest
    c.ckpt.init_params_from = _str()
    c.ckpt.init_params_step = -1
    c.ckpt.async_save = True

    # ---- logging / eval ------------------------------------------------------------------------
    c.log = ConfigDict()
    c.log.eval_every = 25
    # the eval at step 0, before any training; False skips it when an SFT warm-up follows (the
    # random-init policy scores 0; the post-SFT eval is the RL phase's baseline)
    c.log.eval_before_sft = True
    c.log.wandb_project = _str()
    c.log.wandb_name = _str()
    c.log.num_groups_to_log = 2
    c.log.tensorboard = True
    c.log.progress = True
    # the trajectory database (runs, steps, groups, rollouts, turns, evals; tools/monitor.py):
    # db_url "" -> $DATABASE_URL if set, else the SQLite file WORKDIR/trajectories.sqlite
    c.log.db = True
    c.log.db_url = _str()  # e.g. postgresql://user@host/cua

    # ---- live policy server (the trainer's own Engine; OpenAI /v1/chat/completions) --------
    # port 0: off. Replies name the weights version that wrote them. host: non-loopback needs a
    # token; token "" -> $CUA_SERVE_TOKEN, else made up (WORKDIR/serve.json, owner-only).
    c.serve = ConfigDict()
    c.serve.port = 0
    c.serve.host = "127.0.0.1"
    c.serve.token = _str()
    c.serve.max_tokens = 256  # the default max_tokens of a request that sets none
    return c


def lock(c: ConfigDict) -> ConfigDict:
    """Locks the config so unknown keys fail (typos in overrides are caught by name)."""
    c.lock()
    return c


def build(
    family: str,
    arg: str | None,
    presets: tuple[str, ...],
    topology: dict[str, str] | None = None,
) -> ConfigDict:
    """The config of `family` for the preset named by `arg`: `smoke` or a real checkpoint size;
    `topology` maps a real preset to the TPU slice it is sized for."""
    preset = parse_arg(arg, presets=presets, default="smoke")
    c = base_config(family)
    c.preset = preset
    c.topology = (topology or {}).get(preset)
    if preset == "smoke":
        apply_smoke(c)
    elif preset == "learn":
        apply_learn(c)
    else:
        apply_real(c, size=preset)
    return lock(c)


def load_run_config(workdir: str) -> ConfigDict:
    """The config a training run saved (`WORKDIR/config.json`), over this version's defaults:
    a field added since the run was made takes its default instead of failing the lookup."""
    import json
    import os

    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} does not exist: --workdir must be the directory of a cua_jax training run"
        )
    with open(path) as f:
        saved = json.load(f)
    c = base_config(saved.get("model", {}).get("family", "qwen3_vl"))

    def merge(dst: ConfigDict, src: dict) -> None:
        for k, v in src.items():
            old = dst.get(k)
            if isinstance(old, ConfigDict) and isinstance(v, dict):
                merge(old, v)
                continue
            if isinstance(old, tuple) and isinstance(v, list):  # JSON turned tuples into lists
                v = tuple(dict(x) if isinstance(x, dict) else x for x in v)
            elif isinstance(old, int | float) and isinstance(v, int | float):
                v = type(old)(v)  # JSON 1e-05 vs 1.0e-5, ints saved for floats
            if v == "<redacted>":  # cua_jax.redact.REDACTED: a secret the run did not save
                continue  # keeps this version's default (tokens then come from the environment)
            if k in dst:
                del dst[k]  # replace the field, typed None defaults (FieldReference) included
            setattr(dst, k, v)

    merge(c, saved)
    return c


__all__ = ["base_config", "build", "load_run_config", "lock", "ml_collections", "parse_arg"]


# Sizes of the real checkpoints: how the mesh and batch are laid out for each. The model itself
# (layers, widths) always comes from the checkpoint's config.json.
_REAL = {
    # size: (tensor parallel, lora rank (0 = full FT), groups_per_batch, sampler slots)
    "2b": (1, 0, 8, 64),
    "3b": (1, 0, 8, 64),
    "4b": (1, 0, 8, 64),
    "7b": (2, 0, 8, 64),
    "8b": (2, 0, 8, 64),
    "32b": (4, 64, 8, 64),
    # 72b on v5p-16 (2 hosts of 4 chips): tensor=4 in a host, fsdp=2 over the hosts (each
    # host's process packs its own rows, so the batch axes must split between them)
    "72b": (4, 64, 8, 32),
    "30b-a3b": (1, 32, 8, 64),  # Qwen3-VL-MoE: LoRA rank 32 as the cua_rl recipe
}


def apply_real(c: ConfigDict, size: str) -> None:
    """A real checkpoint: bf16, remat, the mesh and batch for its size."""
    tensor, lora_rank, groups, slots = _REAL[size]
    c.model.preset = size
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16" if lora_rank else "float32"
    c.model.remat = "full"
    c.model.lora_rank = lora_rank
    c.mesh.tensor = tensor
    if c.model.family == "qwen2_5_vl" and 3420 % tensor:
        # Every Qwen2.5-VL size shares one vision tower whose MLP width (3420) tensor=8 does not
        # divide: that MLP stays whole over `tensor` (its other dim is still FSDP-sharded).
        c.mesh.rules = (("vision_mlp", None),)
    c.sampler.max_slots = slots
    c.sampler.page_size = 64
    c.sampler.num_pages = 8192
    c.sampler.max_seq_len = 16384
    c.rl.group_size = 8
    c.rl.groups_per_batch = groups
    c.rl.learning_rate = 1e-6
    c.rl.max_tokens = 256
    c.rl.row_lengths = (4096, 8192, 16384)
    # The learner's batch by token budget: 16384 tokens a batch-parallel device a chunk, as many
    # chunks as a step's samples need (memory is one chunk's whatever the turns and screens);
    # splash attention (no [L, L] scores); the KV pool takes what the learner leaves of 85% of
    # a device's memory
    c.rl.tokens_per_chip = 16384
    c.rl.num_substeps = 1
    c.model.attn_impl = "splash"
    c.sampler.kv_memory_fraction = 0.85
    c.sampler.kv_min_fraction = 0.25
    c.rl.max_steps_off_policy = 2
    c.rl.mode = "sync"  # on-policy; --config.rl.mode=async overlaps rollouts with training
    c.env.concurrency = groups * 8
    c.env.max_turns = 15
    c.env.max_history_images = 3
    c.total_steps = 500
    c.ckpt.save_every = 50
    c.log.eval_every = 25


# The smoke preset's pages: one big button, and three forgiving variants of the one-click
# templates (click-color, click-label, nav-tabs; static/templates_retry.js).
SMOKE_RL_TEMPLATES = ("click-button", "retry-color", "retry-label", "retry-tabs")


def apply_smoke(c: ConfigDict) -> None:
    """Everything shrunk to run on a 2-core CPU in minutes: tiny model, small screens."""
    c.model.preset = "tiny"
    c.mesh.fsdp = 1
    c.total_steps = 16
    c.sampler.max_slots = 16
    c.sampler.page_size = 16
    c.sampler.num_pages = 1024
    c.sampler.max_seq_len = 1024
    c.sampler.decode_chunk = 8
    c.rl.group_size = 4
    c.rl.groups_per_batch = 4
    # 3e-5 moved the weights by 0.2% in 16 steps and held-out success not at all
    # (BENCHMARKS.md "make smoke's GRPO on 128 held-out pages"); 3e-4 drifted down after SFT
    # (smoke run, 2026-11-22)
    c.rl.learning_rate = 1e-4
    c.rl.max_tokens = 48
    # 0.7 and a 0.1 penalty a bad action: at 1.0 with none, a quarter to a third of the turns
    # were invalid and held-out success fell (-0.023, seed 0); with them +0.031 and +0.062
    # (seeds 0 and 1, BENCHMARKS.md "make smoke's GRPO on 128 held-out pages")
    c.rl.temperature = 0.7
    c.rl.invalid_action_penalty = 0.1
    c.rl.row_lengths = (512, 1024)
    c.rl.rows_per_step = 8
    c.rl.max_steps_off_policy = 1
    c.optim.grad_clip = 1.0
    c.sft.steps = 200  # 300 before: the time goes to GRPO and the 128-task evals
    c.sft.learning_rate = 1e-3
    c.sft.episodes_per_task = 4
    c.sft.num_tasks = 40  # 10 tasks a template, 4 demonstrations each
    # Half the demonstrations recover from a scripted miss: without them the model has never
    # seen a second turn and writes broken tool calls there (BENCHMARKS.md, recovery demos).
    c.sft.recovery_share = 0.5
    c.env.concurrency = 8
    c.env.max_turns = 3  # a first pick and two more after misses (the retry-* templates)
    c.env.max_history_images = 1
    c.env.system_prompt = "compact"
    # 384x288: every easy built-in page fits without scrolling; 108 merged image tokens.
    c.env.viewport_width = 384
    c.env.viewport_height = 288
    # The four easiest one-click pages, three of them forgiving (envs.browser.suite: a wrong
    # pick is crossed out and the episode goes on), so success can rise by what RL is for and
    # the oracle's one-click demonstrations do not teach: another candidate after a miss.
    # GRPO draws each group from 1000 distinct training pages (the first 40 are the SFT
    # tasks); the eval is 128 held-out pages (eval-split seeds, never trained on; SE ~0.044).
    smoke = SMOKE_RL_TEMPLATES
    train = {"source_type": "builtin", "split": "train", "templates": smoke, "seed": 0}
    c.tasks = ({**train, "per_template": 250},)
    c.eval_tasks = ({**train, "split": "eval", "seed": 5000, "limit": 128},)
    c.ckpt.save_every = 8
    c.ckpt.keep = 2
    c.log.eval_every = 8
    c.log.num_groups_to_log = 1


# The learn preset's tasks: the smoke's four one-click templates and two that take two actions
# (pick, then submit / toggle, then save), where a weak policy sometimes succeeds.
LEARN_TEMPLATES = (
    "click-button",
    "click-color",
    "click-label",
    "nav-tabs",
    "radio-pick",
    "toggle-switch",
)


def apply_learn(c: ConfigDict) -> None:
    """RL that learns on a 2-core CPU (BENCHMARKS.md, "RL that learns"): the smoke's tiny
    model with a short SFT warm-up that leaves headroom, then GRPO with the settings the
    sweeps measured best so far (three seeds; the issue's goal is not met). Checkpoints at
    step 0 (after SFT) and every 10 steps are all kept, so `tools/eval.py --step=0` and the
    final step score on the same held-out tasks."""
    apply_smoke(c)
    c.total_steps = 50  # held-out success peaked near step 50 and fell by step 200 (BENCHMARKS.md)
    c.env.max_turns = 3  # two-action tasks, and one turn to recover from a miss
    c.sft.steps = 150
    c.sft.episodes_per_task = 2
    c.sft.num_tasks = 120  # the SFT demonstrations: 20 tasks per template
    c.rl.group_size = 4
    # 64 episodes a step: above 16 at step 50 on all three seeds (+0.057 mean, BENCHMARKS.md,
    # "RL that learns"); about 20 s a step here
    c.rl.groups_per_batch = 16
    c.env.concurrency = 16
    # 4 micro-batches (the same gradient): XLA's temporaries of the step's largest shape, 192
    # rows x 1024 + 82944 patches, are 30.7 GiB in one batch (more than this 24 GiB VM: the
    # first 64-episode run was OOM-killed in it) and 9.2 GiB in four; 64 x 1024: 11.3 -> 4.1 GiB
    c.rl.num_substeps = 4
    c.rl.learning_rate = 1e-4  # 1e-3 collapsed the policy (invalid actions 0.05 -> 0.7)
    # 0.7: invalid actions per turn 0.46 -> 0.05, 27% fewer generated tokens than at 1.0
    c.rl.temperature = 0.7
    c.rl.dynamic_sampling = False  # at 1.0 its batches were OOM-killed on this VM
    # held the invalid-action rate down over 100 steps (0.07 -> 0.02) where it rose without
    c.rl.invalid_action_penalty = 0.1
    c.rl.max_sampling_rounds = 3
    # the random-init vision tower trains in SFT and RL, as in the three-seed sweeps in
    # BENCHMARKS (frozen, the step is 2-3x faster; held-out after SFT was no different)
    c.model.freeze_vision = False
    t = LEARN_TEMPLATES
    # RL on 12000 distinct tasks (each group a task not yet trained on): the best held-out
    # curve of the sweep; the first 120 are the SFT tasks (the list is round-robin, seeded)
    c.tasks = (dict(source_type="builtin", split="train", templates=t, seed=0, per_template=2000),)
    c.eval_tasks = (
        {"source_type": "builtin", "split": "eval", "templates": t, "seed": 1000, "limit": 64},
    )
    c.ckpt.save_every = 10
    c.ckpt.keep = 8
    c.log.eval_every = 10
