"""The plan's interconnect bytes (`cua_jax.plan.collectives`) against hand counts: a psum inside
a scan runs once per step of the loop; a ragged all-to-all moves (g-1)/g of the rows it sends,
not of its worst-case receive buffer, on the way there and back; the per-device bytes reach the
program's plan and roofline."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cua_jax import plan
from cua_jax.plan.collectives import hlo_collectives, moved_bytes


def test_a_psum_in_a_scan_counts_once_per_step():
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])

    def f(x, w):
        def body(c, xi):  # xi is row-sharded: its matmul's sum is a psum over d
            return c + (xi @ w).sum(), None

        return jax.lax.scan(body, jnp.float32(0), x)[0]

    x = jax.ShapeDtypeStruct((3, 64, 128), jnp.float32, sharding=NamedSharding(mesh, P(None, "d")))
    w = jax.ShapeDtypeStruct((128, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
    text = jax.jit(f).lower(x, w).compile().as_text()
    (op,) = [c for c in hlo_collectives(text) if c["kind"] == "all-reduce"]
    assert (op["bytes"], op["group"], op["runs"]) == (4, 4, 3)
    assert op["moved"] == 2 * 3 / 4 * 4  # 2(g-1)/g of one f32
    assert moved_bytes(text) == {"all-reduce": 3 * 6.0}


def test_an_all_gather_moves_the_other_devices_shards():
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("d")))
    f = jax.jit(lambda x: x * 2, out_shardings=NamedSharding(mesh, P()))
    text = f.lower(x).compile().as_text()
    assert moved_bytes(text)["all-gather"] == 3 / 4 * 64 * 32 * 4


def test_ragged_all_to_all_moves_its_send_buffer_and_reaches_the_roofline():
    pytest.importorskip("libtpu", reason="libtpu (the TPU compiler) is not installed")
    topo = plan.get_topology("v5e-8")
    mesh = Mesh(np.array(plan.abstract_devices(topo)), ("e",))

    def f(x, out, io, ss, oo, rs):
        return jax.lax.ragged_all_to_all(x, out, io, ss, oo, rs, axis_name="e")

    g = jax.shard_map(f, mesh=mesh, in_specs=(P("e"),) * 6, out_specs=P("e"))

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("e")))

    counts = tuple(arg((64,), jnp.int32) for _ in range(4))
    rows, bound = arg((8 * 1024, 256), jnp.bfloat16), arg((8 * 8192, 256), jnp.bfloat16)
    # the return trip: from the worst-case receive buffer back into the 1,024 rows
    back = jax.jit(g).lower(bound, rows, *counts).compile().as_text()
    assert moved_bytes(back) == {"ragged-all-to-all": 7 / 8 * 1024 * 256 * 2}
    prog = plan.ProgramPlan("ragged", topo.chip, {}, {})
    plan.abstract._compile(jax.jit(g), (rows, bound, *counts), prog)
    # each device sends its 1,024 x 256 bf16 rows, 7/8 of them to other devices
    assert prog.collective_bytes == {"ragged-all-to-all": 7 / 8 * 1024 * 256 * 2}
    assert prog.ici_s == pytest.approx(7 / 8 * 1024 * 256 * 2 / topo.chip.ici_bandwidth)
    assert prog.roofline_s >= prog.ici_s > 0
