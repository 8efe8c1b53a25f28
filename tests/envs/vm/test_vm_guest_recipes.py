"""The guest recipes (tools/build_vm_image.sh, envs/docker/Dockerfile) meet OSWorld's assumptions
as LocalDesktop does, read statically (building them takes minutes and root, or a Docker daemon:
tests/envs/vm/test_vm_qemu_real.py boots the real image, opt-in):

* a user "user" whose home has Desktop/, Documents/ and Downloads/, in group sudo with OSWorld's
  client password (the one ``{CLIENT_PASSWORD}`` is filled with), and xterm;
* the office variant installs the Makefile's OFFICE_APT_PKGS, the same list in all three places.
"""

import os
import re
import shlex
import shutil
import subprocess

import pytest

from envs.vm.osworld_setup import DEFAULT_CLIENT_PASSWORD
from envs.vm.providers import LocalDesktop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "build_vm_image.sh")
DOCKERFILE = os.path.join(ROOT, "envs", "docker", "Dockerfile")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _makefile_office_pkgs() -> list[str]:
    text = _read(os.path.join(ROOT, "Makefile")).replace("\\\n", " ")
    (line,) = re.findall(r"^OFFICE_APT_PKGS := (.*)$", text, re.M)
    return line.split()


def test_the_office_apps_are_the_makefiles_list_in_both_recipes():
    want = _makefile_office_pkgs()
    assert "libreoffice-calc" in want and "vlc" in want
    (script,) = re.findall(r'OFFICE_APT_PKGS="\$\{OFFICE_APT_PKGS:-([^}]*)\}"', _read(SCRIPT))
    (docker,) = re.findall(r'^ARG OFFICE_APT_PKGS="([^"]*)"', _read(DOCKERFILE), re.M)
    assert script.split() == docker.split() == want


def test_both_recipes_give_osworlds_user_home_sudo_and_terminal():
    script, docker = _read(SCRIPT), _read(DOCKERFILE)
    # the password sudo takes is the one VMEnv fills {CLIENT_PASSWORD} with by default
    assert DEFAULT_CLIENT_PASSWORD == LocalDesktop().client_password == "password"
    assert re.search(r"\bPASSWORD=password\b", script)
    assert f"ARG CLIENT_PASSWORD={DEFAULT_CLIENT_PASSWORD}\n" in docker
    for text in (script, docker):
        assert re.search(r"useradd -m -u 1000 -s /bin/bash -G sudo user", text)
        assert "chpasswd" in text
        assert re.search(r"\bsudo\b", text.split("useradd")[0])  # the package, installed first
        assert re.search(r"\bxterm\b", text)
    assert 'mkdir "$ROOT"/home/user/{Desktop,Documents,Downloads}' in script
    assert "mkdir /home/user/Desktop /home/user/Documents /home/user/Downloads" in docker
    # the home and its app profiles belong to the user the desktop runs as
    assert "chown -R user:user /home/user" in script and "chown -R user:user /home/user" in docker


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_build_script_parses_and_refuses_unknown_app_sets():
    assert subprocess.run(["bash", "-n", SCRIPT], check=False).returncode == 0
    out = subprocess.run(
        ["bash", SCRIPT, "/nonexistent/x.qcow2", "--apps", "games"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode != 0
    assert "--apps: base or office" in out.stderr or "run as root" in out.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_vm_image_apps_office_builds_the_office_image():
    def dry(*args: str) -> str:
        return subprocess.run(
            ["make", "-n", "-C", ROOT, "vm-image", *args],
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    base, office = dry(), dry("APPS=office")
    assert '--apps "base"' in base and "debian.qcow2" in base
    assert '--apps "office"' in office and "debian-office.qcow2" in office
    (pkgs,) = re.findall(r'OFFICE_APT_PKGS="([^"]*)"', office)
    assert shlex.split(pkgs) == _makefile_office_pkgs()
