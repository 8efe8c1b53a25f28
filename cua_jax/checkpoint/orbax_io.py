"""Orbax checkpoints of the trainer: array state (params, optimizer, RNG) + JSON metadata.

One `Checkpointer` wraps `orbax.checkpoint.CheckpointManager` with async saves and keep-K. A step
directory holds two items:

- `state`: any pytree of arrays (params, optax state, RNG key data), saved with `StandardSave`
  and restored onto the shardings of an abstract target, so a restore lands directly on the mesh.
- `meta`: JSON (step, task-iterator state, trajectory-store counters, config snapshot): what a
  resumed run needs to continue as if it had never stopped.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath


class CheckpointError(RuntimeError):
    pass


def init_params(model: Any, params: dict[str, Any]) -> int:
    """Writes `params` (a nested dict as `Checkpointer.restore_params` returns) into `model`'s
    parameters of the same paths and shapes; returns how many arrays were set. Paths the model
    lacks or shapes that differ raise `CheckpointError`; parameters not in `params` (a tower
    the saved run kept frozen, new LoRA adapters) keep their current values."""
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    n = 0
    for path, value in _flat_items(params):
        var = flat.get(path)
        if var is None:
            raise CheckpointError(f"saved parameter {'/'.join(map(str, path))} is not in the model")
        cur = var[...]
        if tuple(cur.shape) != tuple(np.shape(value)):
            raise CheckpointError(
                f"saved parameter {'/'.join(map(str, path))} has shape {np.shape(value)}, the "
                f"model's has {tuple(cur.shape)}"
            )
        var[...] = jax.device_put(np.asarray(value, cur.dtype), cur.sharding)
        n += 1
    nnx.update(model, state)
    return n


def _flat_items(tree: Any, prefix: tuple = ()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            key = int(k) if isinstance(k, str) and k.isdigit() else k
            yield from _flat_items(v, (*prefix, key))
    else:
        yield prefix, tree


class Checkpointer:
    """Saves every `save_every` steps (or when forced), keeps the newest `keep`."""

    def __init__(
        self, directory: str, *, keep: int = 3, save_every: int = 1, async_save: bool = True
    ):
        self.directory = os.path.abspath(directory)
        self.save_every = max(1, int(save_every))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=1,  # the interval is decided in `should_save` (forced saves too)
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._mngr = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta")
        )

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def should_save(self, step: int) -> bool:
        return step % self.save_every == 0

    def save(self, step: int, state: Any, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Starts an (async) save of `state` and `meta` at `step`; returns whether it saved."""
        if not (force or self.should_save(step)):
            return False
        if step in self._mngr.all_steps():
            return False
        return self._mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta, step=step))
            ),
            force=True,
        )

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restores `step` (default: latest) onto the shapes/dtypes/shardings of `abstract_state`.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` (with `.sharding`) or of arrays;
        a mismatch in tree structure or shape raises `CheckpointError` naming the checkpoint.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        if step not in self._mngr.all_steps():
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory}; have {self.all_steps()}"
            )
        target = jax.tree.map(_as_abstract, abstract_state)
        try:
            out = self._mngr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
                ),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} does not match the model/optimizer being "
                f"restored (different config?): {e}"
            ) from e
        return out["state"], dict(out["meta"])

    def restore_params(self, step: int | None = None) -> dict[str, Any]:
        """The saved trainable parameters of `step` (default: latest) as a nested dict of host
        arrays, whatever the model, optimizer or trainable set they were saved with (a new run
        starts from them with `init_params`).

        Only the `params` subtree is read (an orbax partial restore): the optimizer state, twice
        the params' size in f32 for AdamW, stays on disk, which matters for a 32B/72B source run.
        """
        step = self.latest_step() if step is None else step
        if step is None or step not in self._mngr.all_steps():
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory}; have {self.all_steps()}"
            )
        self._mngr.wait_until_finished()
        path = os.path.join(self.directory, str(step), "state")
        with ocp.PyTreeCheckpointer() as ckptr:
            try:  # the handler's metadata: the item's tree, no step-level metadata file needed
                tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(path))
                tree = getattr(tree, "tree", tree)  # a TreeMetadata or a plain dict
            except (FileNotFoundError, ValueError) as e:
                raise CheckpointError(f"checkpoint {path} is unreadable: {e}") from e
            saved = tree.get("params") if isinstance(tree, dict) else None
            if not isinstance(saved, dict):
                raise CheckpointError(f"checkpoint {self.directory}/{step} holds no 'params'")
            target = {
                "params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), saved)
            }
            restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
            out = ckptr.restore(
                path,
                args=ocp.args.PyTreeRestore(
                    item=target, restore_args=restore_args, partial_restore=True
                ),
            )
        return jax.tree.map(np.asarray, out["params"])

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()


def _as_abstract(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x
