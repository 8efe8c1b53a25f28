"""The smoke main job (`launch/tpu.py`, cut to a few GRPO steps, no SFT) on a Ray fleet of
browser hosts on a three-node ``ray.cluster_utils.Cluster``; a worker node with episodes in flight
is killed while the job's episodes are in flight. The run finishes all its steps, the killed
host's episodes are played again on other hosts and counted (`rollout/env_faults`,
`rollout/env_retries`), none is lost or counted twice (every step trains `groups_per_batch`
groups of `group_size`; the trajectory database agrees with metrics.jsonl), and Ray brings the
killed hosts back on a live node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from envs.ray_fleet import NAMESPACE, PREFIX, host_actor_options, start_hosts  # noqa: E402
from tests.db.train_checks import check_train_database  # noqa: E402
from tests.main_job import LAUNCH, ROOT, SESSION_CACHE, job_env, metrics_rows  # noqa: E402

pytestmark = pytest.mark.skipif(
    not os.environ.get("CUA_LONG_TESTS"),
    reason="the smoke job on three Chromium hosts as Ray actors, ~5-10 min on 2 cores: "
    "CUA_LONG_TESTS=1",
)

TOKEN = "ray-fleet-train-test-token-0123456789"
STEPS, GROUP, GROUPS = 4, 2, 2
ARGS = [
    "--config=configs/qwen3vl_grpo.py:smoke",
    f"--config.total_steps={STEPS}",
    "--config.sft.steps=2",  # a token SFT: a run whose groups all tie is then a warning
    "--config.sft.episodes_per_task=1",
    "--config.sft.num_tasks=2",
    f"--config.rl.group_size={GROUP}",
    f"--config.rl.groups_per_batch={GROUPS}",
    "--config.rl.max_tokens=40",
    f"--config.env.concurrency={GROUP * GROUPS}",
    "--config.env.max_turns=2",
    "--config.env.fleet=ray",
    f"--config.log.eval_every={STEPS}",
    "--config.log.progress=False",
    f"--config.compile_cache_dir={SESSION_CACHE}",
    "--config.tasks=({'source_type': 'builtin', 'split': 'train', 'difficulty': 'easy', "
    "'category': 'click', 'seed': 0, 'limit': 4},)",
    "--config.eval_tasks=({'source_type': 'builtin', 'split': 'eval', 'difficulty': 'easy', "
    "'seed': 1000, 'limit': 2},)",
]


def _load(endpoint: str) -> tuple[int, int]:
    """The host's (episodes in flight, leases) from its /health, or (-1, -1) when it does not
    answer. An episode is a leased env between a reset and its evaluate; a client keeps its
    lease between episodes, so a lease may be idle, and an idle one may start an episode
    between this probe and the kill: the leases bound the faults, the episodes find a host
    that has something to retry."""
    req = urllib.request.Request(
        f"http://{endpoint}/health", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            health = json.load(r)
            return int(health["episodes"]), int(health["leases"])
    except Exception:  # noqa: BLE001 -- starting, or on the killed node
        return -1, -1


def _host_infos() -> dict[str, dict]:
    """Every host actor of the fleet's namespace that answers: name -> info()."""
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a.get("namespace") == NAMESPACE and a["name"].startswith(PREFIX):
            try:
                h = ray.get_actor(a["name"], namespace=NAMESPACE)
                out[a["name"]] = ray.get(h.info.remote(), timeout=5)
            except Exception:  # noqa: BLE001 -- restarting
                pass
    return out


def _until(cond, timeout_s: float, what: str, proc=None, every_s: float = 0.2):
    t0 = time.monotonic()
    while True:
        got = cond()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the job exited {proc.returncode} first")
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what}: not after {timeout_s:g} s")
        time.sleep(every_s)


def test_smoke_job_on_a_ray_fleet_survives_a_killed_node(tmp_path):
    t0 = time.monotonic()
    # Head + two workers; every node grants two browser hosts. The job's fleet starts one host
    # (env.concurrency 4, 16 envs a host); this test starts two more as an operator would
    # (`python -m envs.ray_fleet`), which the job's fleet finds in the namespace.
    c = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"browser_host": 2}}
    )
    workers = [c.add_node(num_cpus=1, resources={"browser_host": 2}) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
    wd = str(tmp_path / "run")
    log = open(tmp_path / "job.log", "w")
    proc = None
    try:
        ours = start_hosts(
            2,
            "browser",
            16,  # as the job's own host: the fleet leases from the host with most free envs
            token=TOKEN,
            first=1000,
            actor_options=host_actor_options("browser", num_cpus=0),
            host_options={"step_timeout_s": 60.0},
        )
        env = job_env()
        env["CUA_BROWSER_TOKEN"] = TOKEN
        proc = subprocess.Popen(
            [
                sys.executable,
                LAUNCH,
                *ARGS,
                f"--config.env.ray_address={c.address}",
                f"--workdir={wd}",
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        # The step-0 eval and the SFT are done (two step-0 rows): episodes in flight are GRPO's.
        metrics = os.path.join(wd, "metrics.jsonl")
        _until(lambda: os.path.exists(metrics) and len(metrics_rows(wd)) >= 2, 900, "SFT", proc)

        def three_hosts():
            h = _host_infos()
            return h if len(h) == 3 else None

        hosts = _until(three_hosts, 120, "three hosts up")
        worker_ids = {w.node_id for w in workers}

        on_workers = {n: i for n, i in hosts.items() if i["node_id"] in worker_ids}

        def busy_worker():
            for name, info in on_workers.items():
                episodes, leases = _load(info["endpoint"])
                if episodes > 0:
                    return name, info, leases
            return None

        victim, old, leased = _until(
            busy_worker, 600, "a worker's host with episodes in flight", proc, 0.02
        )
        victim_node = next(w for w in workers if w.node_id == old["node_id"])
        killed = {n: i for n, i in hosts.items() if i["node_id"] == old["node_id"]}
        c.remove_node(victim_node, allow_graceful=False)
        t_kill = time.monotonic() - t0

        rc = proc.wait(timeout=1200)
        log.flush()
        assert rc == 0, open(tmp_path / "job.log").read()[-4000:]
        rows = metrics_rows(wd)
        steps = [r for r in rows if r["step"] > 0 and "rollout/groups_sampled" in r]
        # Every step ran, each trained groups_per_batch full groups: nothing lost.
        assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
        assert all(r["rollout/groups_sampled"] == GROUPS for r in steps), steps
        # The killed host's episodes: faults, retried elsewhere, none a policy failure.
        last = steps[-1]
        faults, retries = last["rollout/env_faults"], last["rollout/env_retries"]
        assert 1 <= faults <= leased and retries == faults, (faults, retries, leased)
        assert all(r["rollout/env_failures"] == 0 for r in steps), steps
        assert sum(r["rollout/faults_env_error"] for r in steps) == 0, steps
        # Nothing counted twice: the database holds each step's group_size x groups episodes.
        check_train_database(wd, group_size=GROUP, groups_per_step=GROUPS, logged_groups=1)
        # The fleet's hosts came back: 3 answering at the end, the killed ones on live nodes.
        assert last["rollout/env_hosts"] == 3.0, last
        mine = {n: i for n, i in _host_infos().items() if n in killed and n != f"{PREFIX}0"}
        for name in killed:
            if name == f"{PREFIX}0":  # the job's own host: ended with the job
                continue
            assert mine[name]["node_id"] != old["node_id"], (name, mine)
            assert mine[name]["incarnation"] != killed[name]["incarnation"], (name, mine)
        print(
            "RAY_FLEET_TRAIN",
            json.dumps(
                {
                    "victim": victim,
                    "killed": sorted(killed),
                    "leased": leased,
                    "t_kill_s": round(t_kill, 1),
                    "wall_s": round(time.monotonic() - t0, 1),
                    "faults": last["rollout/env_faults"],
                    "retries": last["rollout/env_retries"],
                    "hosts": [r["rollout/env_hosts"] for r in steps],
                    "hosts_down": [r["rollout/env_hosts_down"] for r in steps],
                }
            ),
        )
        del ours
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        log.close()
        ray.shutdown()
        c.shutdown()
