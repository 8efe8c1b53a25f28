"""Host-name rules shared by every server of the project: the policy server
(`cua_jax.evaluation.server`), the monitor (`tools/monitor_app`), the browser server and the VM
server (`envs.vm.server_http`, which also runs inside the guest).

Standard library only: the VM image copies this file beside `cua_jax/env_api.py`
(tools/build_vm_image.sh, envs/docker/Dockerfile).
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1, in any case and with or without IPv6 brackets
    (``[::1]``, as a URL or a Host header writes it)."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
