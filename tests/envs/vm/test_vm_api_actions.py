"""Desktop API actions (run_shell, open_app, write_file, set_cell) on real Xvfb desktops through
VMEnv, and the built-in desktop suite's API oracle: it solves every task it covers in fewer
steps than the GUI-only oracle."""

from __future__ import annotations

import asyncio
import csv
import io

import pytest

from cua_jax import actions as A
from cua_jax.env_api import INFO_API_RESULT, INFO_INVALID_ACTION
from envs.tasks import TaskSourceError, load_tasks
from envs.vm import osworld
from envs.vm.env import VMEnv, set_cell_text, task_from_osworld
from envs.vm.providers import DesktopPool, LocalDesktop

BUILTIN = {t.id: t for t in osworld.load_builtin()}


@pytest.fixture(scope="module")
def pool(xserver, aio):
    p = DesktopPool([LocalDesktop(800, 600), LocalDesktop(800, 600)])
    aio(p.start())
    yield p
    aio(p.stop())


def _task(api=A.VM_API, name="terminal-mkdir"):
    return task_from_osworld(BUILTIN[name], "desktop", api)


async def _steps(env, actions):
    out = []
    for a in actions:
        out.append(await env.step(a))
    return out


def test_run_shell_and_write_file(pool, aio):
    async def go():
        async with VMEnv(pool) as env:
            await env.reset(_task())
            return await _steps(
                env,
                [
                    A.RunShell("echo out; echo err >&2; exit 3"),
                    A.WriteFile("~/apitest/sub/a.txt", "x 'q'\ny\n"),
                    A.RunShell("cat ~/apitest/sub/a.txt"),
                    A.RunShell("echo $HOME; ls ~/apitest/sub"),
                    A.RunShell("  "),  # the server would answer 400: the model's fault
                ],
            )

    r = aio(go())
    *r, empty = r
    assert empty.info[INFO_INVALID_ACTION] == "run_shell: the command is empty" and not empty.done
    assert all(INFO_INVALID_ACTION not in x.info and not x.done for x in r), [x.info for x in r]
    first = r[0].info[INFO_API_RESULT]
    assert first.startswith("exit code 3") and "out" in first and "err" in first
    assert "wrote 8 bytes" in r[1].info[INFO_API_RESULT]
    assert r[2].info[INFO_API_RESULT] == "exit code 0\nx 'q'\ny\n"
    assert r[3].info[INFO_API_RESULT].rstrip().endswith("a.txt")


def test_set_cell_edits_a_csv_in_the_vm(pool, aio):
    async def go():
        async with VMEnv(pool) as env:
            await env.reset(_task())
            return await _steps(
                env,
                [
                    A.WriteFile("~/s.csv", 'a,b\n1,"x, y"\n'),
                    A.SetCell("~/s.csv", "B2", "9"),
                    A.SetCell("~/s.csv", "d4", "z,1"),
                    A.RunShell("cat ~/s.csv"),
                    A.WriteFile("~/t.tsv", "p\tq\n"),
                    A.SetCell("~/t.tsv", "A1", "r"),
                    A.RunShell("cat ~/t.tsv"),
                    A.SetCell("~/missing.csv", "A1", "1"),
                    A.SetCell("~/s.xlsx", "A1", "1"),
                    A.SetCell("~/s.csv", "1A", "1"),
                ],
            )

    r = aio(go())
    assert all(INFO_INVALID_ACTION not in x.info for x in r[:7]), [x.info for x in r]
    assert r[3].info[INFO_API_RESULT] == 'exit code 0\na,b\n1,9\n\n,,,"z,1"\n'
    assert r[6].info[INFO_API_RESULT] == "exit code 0\nr\tq\n"
    assert "no file '~/missing.csv'" in r[7].info[INFO_INVALID_ACTION]
    assert "not a .csv or .tsv" in r[8].info[INFO_INVALID_ACTION]
    assert "A1 notation" in r[9].info[INFO_INVALID_ACTION]


def test_set_cell_text_matches_the_csv_module():
    """Against a sheet built cell by cell with the csv module (an independent reference)."""
    text = "h1,h2,h3\n1,2,3\n4,5\n"
    got = set_cell_text(text, "C3", "six", ",")
    rows = list(csv.reader(io.StringIO(text)))
    rows[2].append("six")
    ref = io.StringIO()
    csv.writer(ref, lineterminator="\n").writerows(rows)
    assert got == ref.getvalue() == "h1,h2,h3\n1,2,3\n4,5,six\n"
    assert set_cell_text("", "AA1", "x", ",") == "," * 26 + "x\n"  # column AA is the 27th


def test_open_app_starts_a_window(pool, aio):
    async def go():
        async with VMEnv(pool) as env:
            await env.reset(_task())
            before = (await env.client.execute(["wmctrl", "-l"]))["output"].splitlines()
            r = await _steps(
                env, [A.OpenApp("Terminal"), A.OpenApp("no-such-app-xyz"), A.OpenApp("rm -rf /")]
            )
            after = (await env.client.execute(["wmctrl", "-l"]))["output"].splitlines()
            return before, r, after

    before, r, after = aio(go())
    assert r[0].info[INFO_API_RESULT] == "started xterm" and len(after) == len(before) + 1
    assert "no application 'no-such-app-xyz'" in r[1].info[INFO_INVALID_ACTION]
    assert "unknown application" in r[2].info[INFO_INVALID_ACTION]


def test_api_actions_refused_unless_the_task_allows_them(pool, aio):
    async def go():
        async with VMEnv(pool) as env:
            await env.reset(_task(api=()))
            r1 = await env.step(A.RunShell("touch ~/should-not-exist"))
            await env.reset(_task(api=("write_file",)))
            r2 = await env.step(A.RunShell("touch ~/should-not-exist"))
            r3 = await env.step(A.Fill("Name", "x"))
            exists = await env.client.execute(["ls", "~/should-not-exist"])
            return r1, r2, r3, exists

    r1, r2, r3, exists = aio(go())
    assert "does not allow the API action run_shell; use GUI" in r1.info[INFO_INVALID_ACTION]
    assert "allowed: write_file" in r2.info[INFO_INVALID_ACTION]
    assert "not a desktop API action" in r3.info[INFO_INVALID_ACTION]
    assert exists["returncode"] != 0 and not any(r.done for r in (r1, r2, r3))


def test_task_oracle_follows_the_allowed_api():
    t = BUILTIN["sheet-fix-price"]
    gui = task_from_osworld(t, "desktop")
    assert gui.api_actions == () and not any(A.api_name(a) for a in gui.oracle)
    api = task_from_osworld(t, "desktop", True)
    assert api.api_actions == ("run_shell", "set_cell")
    assert api.oracle == [A.SetCell("~/prices.csv", "B3", "4.50"), A.Done()]
    # allowed, but not the API the api_oracle uses: the GUI oracle
    other = task_from_osworld(t, "desktop", ["run_shell"])
    assert other.oracle == gui.oracle and other.api_actions == ("run_shell",)
    assert "api_oracle" not in api.spec
    with pytest.raises(osworld.TaskFormatError, match="only desktop API"):
        task_from_osworld(t, "desktop", ["fill"])
    with pytest.raises(osworld.TaskFormatError, match="api_actions"):
        osworld.parse_task({**t.raw, "api_actions": ["fill"]})


def test_desktop_source_key():
    ts = load_tasks({"source_type": "desktop", "api_actions": "all"})
    assert all(t.api_actions for t in ts)
    ts = load_tasks({"source_type": "desktop", "names": ["terminal-mkdir"], "api_actions": []})
    assert ts[0].api_actions == ()
    with pytest.raises(TaskSourceError, match="unknown API action"):
        load_tasks({"source_type": "desktop", "api_actions": ["shell"]})


def test_api_oracle_solves_every_task_in_fewer_steps(pool, aio):
    gui = {t.id: t for t in load_tasks({"source_type": "desktop"})}
    api = {t.id: t for t in load_tasks({"source_type": "desktop", "api_actions": "all"})}
    covered = [k for k in api if api[k].oracle != gui[k].oracle]
    assert len(covered) >= len(api) - 1  # all but the infeasible task (one FAIL either way)

    async def run_all():
        queue: asyncio.Queue = asyncio.Queue()
        for k in covered:
            queue.put_nowait(k)
        res = {}

        async def worker():
            async with VMEnv(pool) as env:
                while not queue.empty():
                    k = queue.get_nowait()
                    task = api[k]
                    await env.reset(task)
                    steps, bad = 0, []
                    for a in task.oracle:
                        r = await env.step(a)
                        steps += 1
                        if INFO_INVALID_ACTION in r.info or "error" in r.info:
                            bad.append(r.info)
                        if r.done:
                            break
                    res[k] = (await env.evaluate(), steps, bad, env.last_eval.details)

        await asyncio.gather(worker(), worker())
        return res

    res = aio(run_all(), timeout=300)
    table = {k: (len(gui[k].oracle), res[k][1]) for k in covered}
    print("\ntask | GUI oracle steps | API oracle steps")
    for k, (g, a) in sorted(table.items()):
        print(f"{k} | {g} | {a}")
    failed = {k: v for k, v in res.items() if v[0] != 1.0 or v[2]}
    assert not failed, failed
    assert all(a < g for g, a in table.values()), table
    assert all(any(A.api_name(x) for x in api[k].oracle) for k in covered)


def test_memory_cap_fails_a_runaway_command_not_the_desktop(xserver, aio):
    """LocalDesktop(memory_mb=...): a command that allocates past the cap fails alone; the
    desktop's server and later commands go on."""
    hog = "python3 -c 'b = bytearray(3 << 30); print(len(b))'"

    async def go():
        d = LocalDesktop(320, 240, memory_mb=1024)
        pool = DesktopPool([d])
        await pool.start()
        try:
            async with VMEnv(pool) as env:
                await env.reset(_task())
                r = await _steps(env, [A.RunShell(hog), A.RunShell("echo alive")])
                return r, await env.client.ping()
        finally:
            await pool.stop()

    (hogged, alive), ping = aio(go())
    assert "MemoryError" in hogged.info[INFO_API_RESULT], hogged.info
    assert not hogged.info[INFO_API_RESULT].startswith("exit code 0")
    assert alive.info[INFO_API_RESULT] == "exit code 0\nalive\n" and ping
