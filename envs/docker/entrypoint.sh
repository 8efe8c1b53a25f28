#!/bin/sh
# The container's desktop: an X server, a window manager, then the VM server on 0.0.0.0:5000
# (the published port), which needs the token from $CUA_VM_TOKEN.
set -e
Xvfb "$DISPLAY" -screen 0 "$SCREEN" -nolisten tcp &
for i in $(seq 50); do xdpyinfo >/dev/null 2>&1 && break; sleep 0.1; done
openbox &
exec python3 -m envs.vm.server --host 0.0.0.0 --port 5000
