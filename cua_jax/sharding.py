"""Mesh, logical-axis rules and placement helpers.

Model code names logical axes only (every nnx.Param carries `out_sharding=(logical names)`);
a rules table maps logical names to mesh axes of the one mesh `("data", "fsdp", "expert",
"tensor")` (`expert`: expert parallelism for MoE models; size 1 for dense ones).
Rules are a tuple of `(logical_name, mesh_axis | tuple of mesh axes | None)` pairs so a config
can override them. Helpers never silently do nothing: an unknown logical name, an unknown mesh
axis, or a dimension the mesh cannot divide raises an error that names it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert", "tensor")


class MeshError(ValueError):
    """A mesh that does not fit the devices, or a parameter it cannot divide: a config problem
    (`launch/tpu.py` prints it as one line, exit 2)."""


Rules = tuple[tuple[str, Any], ...]

# FSDP shards the model dimension of every matrix; tensor parallelism shards heads / mlp /
# vocab; expert parallelism splits the MoE expert stacks over `expert`. Norm scales, head_dim,
# the MoE router and the small vision tables stay replicated.
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("head_dim", None),
    ("norm", None),
    ("vision_patch", None),
    ("vision_pos", None),
    ("vision_embed", "fsdp"),
    ("vision_heads", "tensor"),
    ("vision_mlp", "tensor"),
    ("vision_merge", "fsdp"),
)


def make_mesh(
    data: int = 1,
    fsdp: int = -1,
    tensor: int = 1,
    devices: Sequence[jax.Device] | None = None,
    *,
    expert: int = 1,
) -> Mesh:
    """Mesh with axes ("data", "fsdp", "expert", "tensor"); one size may be -1 (= the
    remaining devices). `expert` > 1 splits MoE experts over that many devices (expert
    parallelism); it combines with fsdp and tensor."""
    devs = list(jax.devices() if devices is None else devices)
    named = {"data": data, "fsdp": fsdp, "expert": expert, "tensor": tensor}
    sizes = [named[a] for a in MESH_AXES]
    desc = " ".join(f"{a}={n}" for a, n in named.items())
    if sizes.count(-1) > 1:
        raise MeshError(f"at most one mesh axis may be -1, got {desc}")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devs) % known:
            others = "*".join(a for a, n in named.items() if n != -1)
            raise MeshError(f"{len(devs)} devices are not divisible by {others}={known}")
        sizes[sizes.index(-1)] = len(devs) // known
    if int(np.prod(sizes)) != len(devs):
        shape = " x ".join(f"{a}={n}" for a, n in zip(MESH_AXES, sizes, strict=True))
        raise MeshError(
            f"mesh {shape} needs {int(np.prod(sizes))} devices, have {len(devs)} "
            "(set one --config.mesh.<axis>=-1 to take the remaining devices)"
        )
    return Mesh(np.asarray(devs).reshape(sizes), MESH_AXES)


def logical_to_spec(
    names: Sequence[str | None] | None, rules: Rules = DEFAULT_RULES
) -> PartitionSpec:
    """PartitionSpec for logical axis names under `rules` (None names stay replicated).

    A mesh axis used by two dimensions of the same array is only kept on the first (XLA
    forbids repeating a mesh axis in one spec).
    """
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in names or ():
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(
                f"logical axis {name!r} has no sharding rule; add ({name!r}, <mesh axis or None>) "
                f"to the rules (known: {sorted(table)})"
            )
        target = table[name]
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        for a in axes:
            if a not in MESH_AXES:
                raise ValueError(f"rule {name!r} -> {target!r} names unknown mesh axis {a!r}")
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def _check_divisible(path: str, shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> None:
    for dim, axes in zip(shape, spec, strict=False):
        if axes is None:
            continue
        n = int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))
        if dim % n:
            raise MeshError(
                f"parameter {path} dim {dim} is not divisible by mesh axes {axes} (size {n}); "
                "change the mesh or the sharding rules"
            )


def named_sharding(
    names: Sequence[str | None] | None,
    shape: tuple[int, ...],
    mesh: Mesh,
    rules: Rules = DEFAULT_RULES,
    path: str = "<array>",
) -> NamedSharding:
    """NamedSharding for an array with logical axes `names`; raises if the mesh cannot divide it."""
    spec = logical_to_spec(names, rules)
    _check_divisible(path, shape, spec, mesh)
    return NamedSharding(mesh, spec)


def _flat_params(state: nnx.State):
    for path, var in nnx.to_flat_state(state):
        yield ".".join(map(str, path)), var


def logical_axes(var: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axis names a Variable was created with (raises if it has none)."""
    names = var.get_metadata().get("out_sharding")
    if names is None:
        raise ValueError(f"variable {var!r} carries no logical axis names (out_sharding)")
    return tuple(names)


def param_specs(model_state: nnx.State, rules: Rules = DEFAULT_RULES) -> dict[str, PartitionSpec]:
    """{dotted param path: PartitionSpec} (for golden tests and logging)."""
    return {p: logical_to_spec(logical_axes(v), rules) for p, v in _flat_params(model_state)}


def param_shardings(model_state: nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """A State with the structure of `model_state` whose leaves are NamedShardings.

    It is a pytree prefix of `model_state`, so it can be given to `jax.jit(in_shardings=...,
    out_shardings=...)` or `jax.device_put` next to the state.
    """

    def one(path, var):
        names = logical_axes(var)
        shape = tuple(var.get_value().shape)
        return named_sharding(names, shape, mesh, rules, ".".join(map(str, path)))

    return nnx.map_state(one, model_state)


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.Module:
    """Place every parameter of `model` with its NamedSharding (in place; returns the model).

    Works on a 1-device mesh too (then everything is simply on that device).
    """
    state = nnx.state(model, nnx.Param)
    for path, var in nnx.to_flat_state(state):
        sharding = named_sharding(
            logical_axes(var), tuple(var.get_value().shape), mesh, rules, ".".join(map(str, path))
        )
        var.set_value(jax.device_put(var.get_value(), sharding))
    nnx.update(model, state)
    # Modules that run their own shard_map (the MoE expert dispatch) learn the mesh here.
    for _, m in nnx.iter_modules(model):
        if callable(getattr(m, "use_mesh", None)):
            m.use_mesh(mesh, rules)
    return model


# ------------------------------------------------------------------ the training layout
# (mesh, rules) of the `training_layout` being traced; None outside one.
_TRAINING: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "cua_jax_training_layout", default=None
)


@contextlib.contextmanager
def training_layout(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Iterator[None]:
    """While tracing inside it, the model lays out a learner's forward and backward as FSDP
    does: `constrain` pins activations to their logical axes (rows over the "batch" mesh axes)
    and `gathered` all-gathers each weight over those axes, in the compute dtype, just before
    its matmul. Without it GSPMD is free to keep the FSDP-sharded weights in place and shard
    the activations' model dimension instead: every chip then holds the whole batch's
    activations and all-reduces partial sums, and the TPU compiler's collective matmuls park
    an output buffer a layer for the whole backward (BENCHMARKS.md "What was in 2b's
    temporaries on v5e-8"). The sampler traces outside it: a decode step's activations are tiny,
    so there partial sums beat gathering every weight. A one-device mesh changes nothing."""
    token = _TRAINING.set((mesh, tuple(rules)) if mesh.size > 1 else None)
    try:
        yield
    finally:
        _TRAINING.reset(token)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """`x` pinned to the sharding of its logical axes `names` inside a `training_layout`
    (raises MeshError if the mesh cannot divide a dimension); `x` itself outside one."""
    active = _TRAINING.get()
    if active is None:
        return x
    mesh, rules = active
    sh = named_sharding(names, tuple(x.shape), mesh, rules, "activation")
    return jax.lax.with_sharding_constraint(x, sh)


def gathered(w: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Weight `w` with logical axes `names` as a matmul inside a `training_layout` uses it:
    whole over the mesh axes that shard the rows ("batch": FSDP's all-gather), still split
    over the others (tensor, expert); `w` itself outside one. Cast `w` to the compute dtype
    first, so the all-gather moves the narrow copy."""
    active = _TRAINING.get()
    if active is None:
        return w
    mesh, rules = active
    (rows,) = logical_to_spec(("batch",), rules)
    batch_axes = set(_as_tuple(rows))

    def keep(axes):
        kept = tuple(a for a in _as_tuple(axes) if a not in batch_axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    spec = PartitionSpec(*(keep(a) for a in logical_to_spec(names, rules)))
    return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, spec))


def vocab_parallel(
    w: jax.Array, names: Sequence[str | None], vocab_dim: int
) -> tuple[jax.Array, PartitionSpec] | None:
    """The LM head `w` (logical axes `names`, its vocabulary on dim `vocab_dim`) laid out for a
    vocabulary-parallel head inside a `training_layout`: the vocabulary split over the batch
    axes as well as its own (tensor), the other dims whole; with the spec the logits' last dim
    takes. The head then multiplies every row of a chunk (the rows gathered, a small
    [rows, c, D] buffer) by its vocabulary slice: no chip holds the whole head, its f32
    gradient or an all-reduce of it (BENCHMARKS.md "the vocabulary-parallel head"). None
    outside a training layout, with no batch axis over 1, or a vocabulary the axes do not
    divide (then the head is `gathered` as the other weights are)."""
    active = _TRAINING.get()
    if active is None:
        return None
    mesh, rules = active
    rows = tuple(a for a in batch_axes(rules) if mesh.shape[a] > 1)
    if not rows:
        return None
    spec = logical_to_spec(names, rules)
    own = tuple(a for a in _as_tuple(spec[vocab_dim]) if a not in rows)
    split = tuple(a for a in MESH_AXES if a in rows + own)  # mesh order
    if w.shape[vocab_dim] % int(np.prod([mesh.shape[a] for a in split])):
        return None
    entries = [None] * len(names)
    entries[vocab_dim] = split
    w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, PartitionSpec(*entries)))
    return w, PartitionSpec(None, None, split)


def constrain_spec(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """`x` pinned to `spec` on the training layout's mesh (`x` itself outside one)."""
    active = _TRAINING.get()
    if active is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(active[0], spec))


def batch_axes(rules: Rules = DEFAULT_RULES) -> tuple[str, ...]:
    """The mesh axes the learner's rows shard over: the rules' logical "batch" entry (data x
    fsdp by default; a MoE preset may add expert, so its expert devices split the rows too)."""
    (rows,) = logical_to_spec(("batch",), rules)
    return _as_tuple(rows)


def _as_tuple(axes: Any) -> tuple[str, ...]:
    """A PartitionSpec entry (None, a mesh axis, or a tuple of them) as a tuple."""
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
