"""One loopback rule for every server, and the VM guest's copy of the package is enough to start
its server (the guest gets only the cua_jax files tools/build_vm_image.sh and the Dockerfile
list)."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from cua_jax.evaluation import server as eval_server
from cua_jax.hosts import is_loopback
from envs.vm import server_http
from tools.monitor_app import security

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "host",
    ["localhost", "LocalHost", "127.0.0.1", "127.3.2.1", "::1", "[::1]", "[0:0:0:0:0:0:0:1]"],
)
def test_loopback_names_bare_and_bracketed(host):
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host", ["0.0.0.0", "::", "[::]", "10.0.0.1", "example.com", "[example.com]", "", "::2"]
)
def test_other_names_are_not_loopback(host):
    assert not is_loopback(host)


def test_every_server_uses_the_one_rule():
    assert eval_server.is_loopback is server_http.is_loopback is security.is_loopback is is_loopback


def _guest_cua_files() -> tuple[list[str], list[str]]:
    """What each recipe copies of cua_jax/: file names, and folders as "name/"."""
    with open(os.path.join(ROOT, "tools", "build_vm_image.sh")) as f:
        script = f.read()
    (brace,) = re.findall(r'cp "\$REPO"/cua_jax/\{([^}]*)\}', script)
    folders = re.findall(r'cp -r "\$REPO/cua_jax/(\w+)"', script)
    image = sorted([*brace.split(","), *(f"{d}/" for d in folders)])
    with open(os.path.join(ROOT, "envs", "docker", "Dockerfile")) as f:
        copies = [line.split()[1:-1] for line in f if line.startswith("COPY cua_jax/")]
    docker = sorted(p.removeprefix("cua_jax/") for c in copies for p in c)
    return image, docker


def test_the_vm_guests_cua_jax_files_start_its_server(tmp_path):
    image_files, docker_files = _guest_cua_files()
    assert image_files == docker_files  # the two guest recipes copy the same files
    assert "actions/" in image_files and "hosts.py" in image_files
    (tmp_path / "cua_jax").mkdir()
    for name in image_files:
        if name.endswith("/"):
            shutil.copytree(os.path.join(ROOT, "cua_jax", name), tmp_path / "cua_jax" / name)
        else:
            shutil.copy(os.path.join(ROOT, "cua_jax", name), tmp_path / "cua_jax" / name)
    shutil.copytree(os.path.join(ROOT, "envs", "vm"), tmp_path / "envs" / "vm")
    for name in ("__init__.py", "tasks.py"):
        shutil.copy(os.path.join(ROOT, "envs", name), tmp_path / "envs" / name)
    # Only the guest's tree: drop the editable install's finder, so a file the recipes leave
    # out is a ModuleNotFoundError here as it would be in the guest.
    code = (
        "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'Editable' not in repr(f)];"
        "import envs.vm.server, cua_jax.hosts, cua_jax.actions;"
        f"assert cua_jax.hosts.__file__.startswith({str(tmp_path)!r}), cua_jax.hosts.__file__"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
