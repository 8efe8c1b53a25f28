"""A run's checkpoints: where it resumes from, what a save holds, each process's share of it.

resume_from = resume_source(ckpt, load_path, keep=...)   # None: a new run
save_checkpoint(ckpt, step, learner, source.state_dict())
source.load_state_dict(process_meta(meta))
"""

from __future__ import annotations

import os
from typing import Any

import jax
from absl import logging

from cua_jax import multihost
from cua_jax.checkpoint.orbax_io import Checkpointer
from cua_jax.config.checks import ConfigError


def resume_source(ckpt: Checkpointer, load_path: str, *, keep: int) -> Checkpointer | None:
    """The checkpoints to resume from: this workdir's own (`ckpt`), else `load_path`'s
    (`config.ckpt.load_checkpoint_path`), else None (a new run). `load_path` naming one step of
    this workdir's own checkpoints (what a damaged checkpoint's error suggests) resumes from that
    step: the later step directories are renamed `N.set_aside`, nothing deleted."""
    path = load_path
    own = os.path.abspath(ckpt.directory)
    name = os.path.basename(path.rstrip("/")) if path else ""
    if name.isdigit() and os.path.dirname(os.path.abspath(path.rstrip("/"))) == own:
        step = int(name)
        if step not in ckpt.all_steps():
            raise ConfigError(
                f"config.ckpt.load_checkpoint_path={path!r}: no step {step} in {own}; "
                f"have {ckpt.all_steps()}"
            )
        if jax.process_index() == 0:
            moved = ckpt.set_aside_after(step)
            if moved:
                logging.warning("resuming from step %d; set aside: %s", step, ", ".join(moved))
        multihost.sync("set_aside")
        ckpt.reload()
        return ckpt
    if ckpt.latest_step() is not None:
        return ckpt
    if not path:
        return None
    other = Checkpointer(path, keep=keep)
    if other.latest_step() is None:
        raise ConfigError(
            f"config.ckpt.load_checkpoint_path={path!r} holds no checkpoint (expected step "
            "directories written by a cua_jax run)"
        )
    return other


def save_checkpoint(
    ckpt: Checkpointer, step: int, learner: Any, source_state: dict, *, force: bool = False
) -> None:
    """The learner's state at `step` with the rollout source's cursor, replay and store
    counters (`ckpt.save_every` decides unless `force`). Every process calls it: orbax saves
    each process's shards; multi-host, the metadata holds every process's source state
    (`processes`, in process order) so that it is the same on all of them."""
    meta = {**source_state, "sft_done": True}
    if jax.process_count() > 1:
        meta = {**meta, "processes": multihost.allgather_json(source_state)}
    ckpt.save(step, learner.state_dict(), meta, force=force)


def process_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """This process's rollout-source state in a checkpoint's metadata (`save_checkpoint`);
    raises `ConfigError` when the checkpoint was written by a job of another process count (its
    task shares would not be this job's)."""
    saved = meta.get("processes")
    n, i = jax.process_count(), jax.process_index()
    if saved is None and n == 1:
        return meta
    if saved is None or len(saved) != n:
        raise ConfigError(
            f"the checkpoint at step {meta.get('step')} was written by a job of "
            f"{1 if saved is None else len(saved)} processes, this one has {n}: each process "
            "resumes its own share of the tasks, so resume with the same number of processes"
        )
    return saved[i]


def last_checkpoint(ckpt: Checkpointer) -> str | None:
    """The directory of `ckpt`'s latest step, or None: what a non-finite loss's error names."""
    latest = ckpt.latest_step()
    return None if latest is None else os.path.join(ckpt.directory, str(latest))
