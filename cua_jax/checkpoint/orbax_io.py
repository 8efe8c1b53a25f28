"""Orbax checkpoints of the trainer: array state (params, optimizer, RNG) + JSON metadata.

One `Checkpointer` wraps `orbax.checkpoint.CheckpointManager` with async saves and keep-K. A step
directory holds two items:

- `state`: any pytree of arrays (params, optax state, RNG key data), saved with `StandardSave`
  and restored onto the shardings of an abstract target, so a restore lands directly on the mesh.
- `meta`: JSON (step, task-iterator state, trajectory-store counters, config snapshot): what a
  resumed run needs to continue as if it had never stopped.

Faults stop the run instead of losing it: an async save that failed (a full disk) raises
`CheckpointError` at the next `save()` call (every train step calls it), `wait()` or `close()`;
a latest checkpoint that cannot be read is reported as damaged, naming the newest intact step;
a checkpoint of another model or optimizer names the first key that differs. A `Checkpointer`
on one step's directory (`.../checkpoints/N`) sees that step only (resume or export from it).
Directories may be local or on object storage (`gs://bucket/run/checkpoints`: orbax and
tensorstore write there directly).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or restored; the message says why and what to do."""


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
    """Saves every `save_every` steps (or when forced), keeps the newest `keep`.

    `directory` is a checkpoints directory, or one step's directory in it (`.../N`, holding
    `state` and `meta`): then only step N is seen, and nothing can be saved.
    """

    def __init__(
        self, directory: str, *, keep: int = 3, save_every: int = 1, async_save: bool = True
    ):
        directory = checkpoint_dir(directory)
        self._only_step: int | None = None
        if _is_step_dir(directory):
            self._only_step = int(os.path.basename(directory))
            directory = os.path.dirname(directory)
        self.directory = directory
        self.save_every = max(1, int(save_every))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=1,  # the interval is decided in `should_save` (forced saves too)
            enable_async_checkpointing=async_save,
            create=self._only_step is None,
        )
        self._mngr = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta")
        )
        self._pending: int | None = None  # the step of a save that may still be in flight
        self._save_error: str | None = None  # a failed save, once raised

    def set_aside_after(self, step: int) -> list[str]:
        """Renames every step directory after `step` to `N.set_aside` (nothing is deleted), so
        the run resumes from `step` and saves its later steps afresh; returns the new names.
        Call it on one process (the workdir is shared), before anything is restored."""
        if self._only_step is not None:
            raise CheckpointError(f"{self.directory}/{self._only_step} is read-only here")
        moved = []
        for s in [s for s in self.all_steps() if s > step]:
            src = epath.Path(self.directory) / str(s)
            dst = epath.Path(self.directory) / f"{s}.set_aside"
            src.rename(dst)
            moved.append(str(dst))
        self._mngr.reload()
        return moved

    def reload(self) -> None:
        """Sees step directories another process added, renamed or removed."""
        self._mngr.reload()

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        steps = sorted(self._mngr.all_steps())
        return [s for s in steps if s == self._only_step] if self._only_step is not None else steps

    def should_save(self, step: int) -> bool:
        return step % self.save_every == 0

    def save(self, step: int, state: Any, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Starts an (async) save of `state` and `meta` at `step`; returns whether it saved.

        Call it every step: a save started earlier that has failed meanwhile raises
        `CheckpointError` here (not `save_every` steps later, after they are lost).
        """
        if self._only_step is not None:
            raise CheckpointError(
                f"{self.directory}/{self._only_step} is one checkpoint's directory: it is "
                "read-only here; save into a checkpoints directory"
            )
        if self._pending is not None and self._pending_done():
            self._finish_pending()
        if not (force or self.should_save(step)):
            return False
        if step in self._mngr.all_steps():
            return False
        self._finish_pending()  # the previous save must have landed before the next starts
        try:
            started = self._mngr.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    meta=ocp.args.JsonSave(dict(meta, step=step)),
                ),
                force=True,
            )
        except Exception as e:  # noqa: BLE001 -- orbax/tensorstore raise many kinds
            raise self._save_failed(step, e) from e
        self._pending = step if started else None
        return started

    def _pending_done(self) -> bool:
        """Whether the save in flight has ended (landed or failed), without waiting.

        orbax keeps its progress flag set after a failed save, so this looks at its finalize
        thread (private; when that is not there, at the flag)."""
        holder = getattr(self._mngr, "_finalize_thread", None)
        try:
            thread = holder.get()  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 -- another orbax version
            thread = None
        if thread is not None and hasattr(thread, "is_alive"):
            return not thread.is_alive()
        return not self._mngr.is_saving_in_progress()

    def _finish_pending(self) -> None:
        """Waits for the save in flight; raises `CheckpointError` if it failed."""
        step, self._pending = self._pending, None
        if step is None:
            return
        try:
            self._mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._save_failed(step, e) from e

    def _save_failed(self, step: int, e: BaseException) -> CheckpointError:
        latest = [s for s in self._mngr.all_steps() if s != step]
        last = f"{self.directory}/{max(latest)}" if latest else "none"
        self._save_error = (
            f"saving checkpoint step {step} into {self.directory} failed: {_first_line(e)}. The "
            f"run stops here rather than train on without checkpoints; the newest saved "
            f"checkpoint is {last}. Free space (or fix the directory) and rerun the same command "
            "to resume from it."
        )
        return CheckpointError(self._save_error)

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restores `step` (default: latest) onto the shapes/dtypes/shardings of `abstract_state`.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` (with `.sharding`) or of arrays.
        Raises `CheckpointError` naming the first differing key when the checkpoint holds another
        tree or shapes, or, when it cannot be read, saying it is damaged and naming the newest
        intact step.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        if step not in self.all_steps():
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory}; have {self.all_steps()}"
            )
        target = jax.tree.map(_as_abstract, abstract_state)
        try:
            return self._restore(step, target)
        except Exception as e:  # noqa: BLE001 -- orbax/tensorstore raise many kinds
            differs = self._differs(step, target)
            if differs is not None:
                raise CheckpointError(
                    f"checkpoint {self.directory}/{step} does not match the model/optimizer being "
                    f"restored: {differs}"
                ) from e
            raise self._damaged(step, e, lambda s: self._restore(s, target)) from e

    def _restore(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        out = self._mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
            ),
        )
        if not isinstance(out["meta"], dict):
            raise ValueError(f"meta holds {type(out['meta']).__name__}, not a JSON object")
        return out["state"], dict(out["meta"])

    def _differs(self, step: int, target: Any) -> str | None:
        """The first difference between the saved tree of `step` and `target` (a path and what
        differs), or None when they agree or the saved tree cannot be read (damage)."""
        try:
            saved = _read_tree(os.path.join(self.directory, str(step), "state"))
        except Exception:  # noqa: BLE001 -- unreadable metadata is damage, not another config
            return None
        want = _flat_shapes(target)
        have = _flat_shapes(saved)
        for path, shape in want.items():
            if path not in have:
                return f"the checkpoint has no `{path}` (the first key the restore needs)"
            if have[path] is not None and shape is not None and have[path] != shape:
                return f"`{path}` has shape {have[path]} in the checkpoint, {shape} here"
        extra = [p for p in have if p not in want]
        if extra:
            return f"the checkpoint has `{extra[0]}`, which the model/optimizer lacks"
        return None

    def _damaged(self, step: int, e: BaseException, probe: Any) -> CheckpointError:
        """The error for an unreadable `step`: names the newest older step `probe` reads."""
        intact = None
        for s in reversed([s for s in self._mngr.all_steps() if s < step]):
            try:
                probe(s)
            except Exception:  # noqa: BLE001
                continue
            intact = s
            break
        where = f"{self.directory}/{step}"
        if intact is None:
            hint = "no older checkpoint here is intact"
        else:
            good = f"{self.directory}/{intact}"
            hint = (
                f"the newest intact checkpoint is step {intact} ({good}): to resume from it, pass "
                f"--config.ckpt.load_checkpoint_path={good} or move the damaged one aside "
                f"(mv {where} {where}.damaged)"
            )
        return CheckpointError(
            f"checkpoint {where} is damaged (a file in it is truncated or unreadable: "
            f"{_first_line(e)}); {hint}"
        )

    def restore_params(self, step: int | None = None) -> dict[str, Any]:
        """The saved trainable parameters of `step` (default: latest) as a nested dict of host
        arrays, whatever the model, optimizer or trainable set they were saved with (a new run
        starts from them with `init_params`).

        Only the `params` subtree is read (an orbax partial restore): the optimizer state, twice
        the params' size in f32 for AdamW, stays on disk, which matters for a 32B/72B source run.
        """
        step = self.latest_step() if step is None else step
        if step is None or step not in self.all_steps():
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory}; have {self.all_steps()}"
            )
        self._mngr.wait_until_finished()
        try:
            return self._restore_params(step)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 -- orbax/tensorstore raise many kinds
            raise self._damaged(step, e, self._restore_params) from e

    def _restore_params(self, step: int) -> dict[str, Any]:
        path = os.path.join(self.directory, str(step), "state")
        with ocp.PyTreeCheckpointer() as ckptr:
            tree = _read_tree(path)  # unreadable: damage, reported by restore_params
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
        """Waits for the save in flight; raises `CheckpointError` if it failed."""
        self._finish_pending()
        self._mngr.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in flight (raising `CheckpointError` if it failed, unless that
        failure was raised already) and releases the manager."""
        try:
            self._finish_pending()
            try:
                self._mngr.wait_until_finished()
            except Exception as e:  # noqa: BLE001
                if self._save_error is None:
                    raise CheckpointError(f"a checkpoint save failed: {_first_line(e)}") from e
        finally:
            with contextlib.suppress(Exception):  # a failed save leaves its thread's error
                self._mngr.close()


def checkpoint_dir(directory: str) -> str:
    """A local directory as an absolute path; `gs://...` (any URI) as it is: orbax and
    tensorstore write there directly (never into a local `./gs:` folder)."""
    directory = os.fspath(directory)
    return directory if "://" in directory else os.path.abspath(directory)


def _is_step_dir(path: str) -> bool:
    """`.../N` holding a checkpoint's `state` and `meta` items."""
    return os.path.basename(path).isdigit() and all(
        (epath.Path(path) / item).is_dir() for item in ("state", "meta")
    )


def _read_tree(state_dir: str) -> Any:
    """The saved tree of a `state` item (leaves: orbax array metadata with `.shape`)."""
    tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(state_dir))
    return getattr(tree, "tree", tree)  # a TreeMetadata or a plain dict


def _flat_shapes(tree: Any) -> dict[str, tuple[int, ...] | None]:
    """`a/b/0` -> shape of each leaf (None for a leaf without one), in tree order."""
    out: dict[str, tuple[int, ...] | None] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = "/".join(str(_key_name(k)) for k in path)
        shape = getattr(leaf, "shape", None)
        out[key] = tuple(shape) if shape is not None else None
    return out


def _key_name(k: Any) -> Any:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey / FlattenedIndexKey, GetAttrKey
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    line = f"{type(e).__name__}: {line}" if line else type(e).__name__
    return line if len(line) <= 400 else line[:400] + "..."


def _as_abstract(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x
