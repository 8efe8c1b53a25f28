"""Desktops on Ray (`envs.ray_fleet.RayDesktop`): each a LocalDesktop inside a Ray actor placed
by the `desktop` resource of a `ray.cluster_utils.Cluster` on this machine. A built-in task's
oracle scores 1 on each; the node of one desktop is killed, the episode on it is an
infrastructure fault, the pool's recovery waits for Ray to start the actor on another node, and
the next episode there scores 1 without the desktop being retired."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from cua_jax.env_api import EnvError  # noqa: E402
from envs.ray_fleet import RayDesktop  # noqa: E402
from envs.vm import osworld  # noqa: E402
from envs.vm.env import VMEnv, VMEnvPool, task_from_osworld  # noqa: E402

TOKEN = "ray-desktop-test-token-0123456789"
TASK = next(
    task_from_osworld(t, "desktop")
    for t in osworld.load_builtin()
    if t.id.endswith("terminal-create-file")
)


async def _oracle(env: VMEnv) -> float:
    await env.reset(TASK)
    for a in TASK.oracle:
        if (await env.step(a)).done:
            break
    return await env.evaluate()


@pytest.mark.skipif(
    os.environ.get("CUA_LONG_TESTS") != "1",
    reason="a four-node Ray cluster and two desktops, ~50-60 s on 2 cores: CUA_LONG_TESTS=1",
)
def test_a_desktop_whose_node_dies_comes_back_on_another_node(xserver, aio):
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {}})
    nodes = [c.add_node(num_cpus=1, resources={"desktop": 1}) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="cua_test_desktops", log_to_driver=False)
    try:
        desktops = [RayDesktop(i, token=TOKEN, screen=(640, 480)) for i in range(2)]
        pool = VMEnvPool(desktops)

        async def go():
            async with pool:
                dp = pool.desktops  # the DesktopPool every VMEnv of the run takes desktops from
                placed = {d.name: d.info["node_id"] for d in desktops}
                first = [await _oracle(VMEnv(d)) for d in desktops]
                async with dp.lease() as busy:  # one desktop busy: the episode below takes
                    victim = next(d for d in desktops if d is not busy)  # the other one's slot
                    old = dict(victim.info)
                    node = next(n for n in nodes if n.node_id == old["node_id"])
                    spare = c.add_node(num_cpus=1, resources={"desktop": 1})  # where it can go
                    c.remove_node(node, allow_graceful=False)
                    env = VMEnv(dp)
                    try:
                        await env.reset(TASK)
                    except EnvError as e:  # the killed node's desktop: a fault
                        fault = e
                    else:
                        fault = None
                    assert env.desktop is victim
                    await env.close()  # released as faulty: the pool recovers it (Ray's restart)
                    again = await _oracle(VMEnv(dp))  # the same slot, back on the spare node
                return placed, first, fault, old, dict(victim.info), spare, again, dp.report()

        placed, first, fault, old, new, spare, again, report = aio(go(), timeout=600)
    finally:
        ray.shutdown()
        c.shutdown()
    assert len(set(placed.values())) == 2  # one desktop a node (SPREAD)
    assert first == [1.0, 1.0]
    assert fault is not None, "the episode on the killed node did not fault"
    assert new["node_id"] == spare.node_id != old["node_id"]
    assert new["incarnation"] != old["incarnation"] and new["endpoint"] != old["endpoint"]
    assert again == 1.0
    assert report["retired"] == {}, report
