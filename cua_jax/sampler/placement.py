"""Where the sampler's arrays live: parameters, K/V pages and small inputs, with or without a mesh.

* Colocated with the learner (`Engine(model, mesh=learner_mesh)`): parameters already on the
  mesh are used in place (their own shardings become the jit in_shardings: no gather, no copy);
  K/V pages are split by kv head over `tensor` and replicated over `data` / `fsdp` (see
  `steps._on_kv_heads` for why).
* Disaggregated (`Engine(model, mesh=sampler_mesh)` on other devices than the learner's):
  parameters are `jax.device_put` to `cua_jax.sharding` shardings on the sampler mesh, at
  construction and again in every `update_params`.
* No mesh: everything on the parameters' device (or, for parameters already sharded over a
  mesh, that mesh is used as above).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from cua_jax import sharding as shd
from cua_jax.sampler.steps import KV_AXIS


def params_mesh(params: nnx.State) -> Mesh | None:
    """The mesh of parameters sharded (or replicated) over more than one device, else None."""
    for x in jax.tree.leaves(params):
        sh = getattr(x, "sharding", None)
        if isinstance(sh, NamedSharding) and sh.mesh.size > 1:
            return sh.mesh
    return None


def target_shardings(params: nnx.State, mesh: Mesh, rules: shd.Rules) -> nnx.State:
    """NamedShardings of `params` on `mesh` by their logical axes under `rules` (a pytree prefix
    of `params`); a parameter without logical axis names is replicated, and rule targets that
    are not axes of `mesh` (e.g. `fsdp` on a `tensor`-only sampler mesh) are dropped."""

    def keep(target):
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a in mesh.axis_names)
        return axes or None

    rules = tuple((name, keep(target)) for name, target in rules)

    def one(path, var):
        try:
            names = shd.logical_axes(var)
        except ValueError:
            return NamedSharding(mesh, PartitionSpec())
        shape = tuple(var.get_value().shape)
        return shd.named_sharding(names, shape, mesh, rules, ".".join(map(str, path)))

    return nnx.map_state(one, params)


def _on(sharding: jax.sharding.Sharding, mesh: Mesh) -> bool:
    if isinstance(sharding, NamedSharding):
        return sharding.mesh == mesh
    return mesh.size == 1 and sharding.device_set == set(mesh.devices.flat)


def place_params(params: nnx.State, mesh: Mesh, rules: shd.Rules) -> tuple[nnx.State, Any]:
    """(params on `mesh`, their shardings). Arrays already on the mesh are kept as they are."""
    leaves = jax.tree.leaves(params)
    if all(isinstance(x, jax.Array) and _on(x.sharding, mesh) for x in leaves):
        placed = params  # in place: no copy, the arrays' own shardings
    else:
        target = target_shardings(params, mesh, rules)

        def place(sh, x):
            if isinstance(x, jax.Array) and _on(x.sharding, mesh):
                return x
            return jax.device_put(x, sh)

        placed = jax.tree.map(place, target, params)
    return placed, jax.tree.map(lambda x: x.sharding, placed)


def check_mesh(mesh: Mesh, num_kv_heads: int, num_heads: int) -> None:
    """Raises if the kv heads (or q heads) cannot be split evenly over the `tensor` axis."""
    t = mesh.shape.get(KV_AXIS, 1)
    if num_kv_heads % t or num_heads % t:
        raise ValueError(
            f"Engine(mesh=...): the mesh's {KV_AXIS!r} axis has {t} devices, but the model has "
            f"{num_kv_heads} kv heads and {num_heads} q heads; the sampler splits K/V pages by "
            f"kv head, so {KV_AXIS} must divide both: use a mesh whose {KV_AXIS} size divides "
            f"{num_kv_heads} (e.g. a sampler sub-mesh)"
        )


def kv_sharding(mesh: Mesh) -> NamedSharding:
    """Page pools f[K, Ptot, L, H]: kv heads over `tensor`, replicated over the other axes."""
    axis = KV_AXIS if mesh.shape.get(KV_AXIS, 1) > 1 else None
    return NamedSharding(mesh, PartitionSpec(axis))


def replicated(mesh_or_device: Mesh | jax.Device) -> jax.sharding.Sharding:
    if isinstance(mesh_or_device, Mesh):
        return NamedSharding(mesh_or_device, PartitionSpec())
    return SingleDeviceSharding(mesh_or_device)
