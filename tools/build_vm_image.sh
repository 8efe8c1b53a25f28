#!/usr/bin/env bash
# Builds a small Debian desktop guest for envs.vm.qemu.QemuDesktop: Xvfb :0 (1280x720x24),
# openbox, xterm, nano, and this repository's VM server (python3 -m envs.vm.server) on
# 0.0.0.0:5000 inside the guest, started by systemd at boot. As OSWorld's VMs: a user "user"
# whose home has Desktop/ Documents/ Downloads/ and whose sudo takes the client password
# ("password"); --apps office adds LibreOffice, GIMP, VLC, Thunderbird and Evince.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: tools/build_vm_image.sh OUT.qcow2 [options]      (run as root, from anywhere)

Builds a bootable Debian guest image (qcow2) for envs.vm.qemu.QemuDesktop:
  * a plain ext4 filesystem over the whole disk (no partition table) booted by extlinux
    from its first sector: the image alone boots (SeaBIOS -> extlinux -> Debian's kernel);
  * Debian packages only (debootstrap + apt): linux-image-amd64, systemd, Xvfb, openbox,
    xterm, nano, sudo, xdotool, wmctrl, imagemagick, python3 with aiohttp/numpy/PIL/xlib/tk,
    and pyautogui (pure Python, fetched from PyPI by the host's pip; --no-pyautogui skips it);
  * OSWorld's assumptions: user "user" (uid 1000, home /home/user with Desktop/, Documents/,
    Downloads/), in group sudo with the password of --password: its tasks' setup runs
    `echo {CLIENT_PASSWORD} | sudo -S ...` (QemuDesktop's client_password, default "password");
  * this checkout's envs/ (+ the few cua_jax modules envs.tasks imports) in /opt/cua;
  * cua-desktop.service: Xvfb :0 -screen 0 1280x720x24, openbox, then the VM server on
    0.0.0.0:5000 as user "user" (home /home/user), reached from the host only through
    QEMU's hostfwd; DHCP on the NIC via systemd-networkd;
  * --apps office: also $OFFICE_APT_PKGS (default: the Makefile's list, LibreOffice Calc/
    Writer/Impress, GIMP, VLC, Thunderbird, Evince; plus file and desktop-file-utils, which
    xdg-open needs to pick the app), with the per-user settings a LocalDesktop's home gets
    (envs.vm.providers._seed_app_profiles: LibreOffice's profile, VLC's vlcrc). ~2.5 GB;
  * the server's bearer token is baked in at build time (/etc/cua/token in the guest) and
    written next to the image as OUT.qcow2.token (mode 600): pass it as QemuDesktop(token=...).

Options:
  --size SIZE      disk size (default 4G; the qcow2 only holds what is used, ~1 GB)
  --suite NAME     Debian suite (default trixie: the server needs aiohttp >= 3.9, and
                   bookworm's python3-aiohttp is 3.8; the build checks the version)
  --mirror URL     Debian mirror (default http://deb.debian.org/debian)
  --apps SET       "base" (default) or "office" (the office and media apps, see above)
  --password PW    the password of user "user", which sudo takes (default "password",
                   OSWorld's {CLIENT_PASSWORD}; QemuDesktop(client_password=PW) must match)
  --token T        the server token (default: reuse OUT.qcow2.token if present, else random)
  --cache DIR      .deb cache reused by later builds (default: DIR_OF_OUT/.debcache)
  --no-pyautogui   do not install pyautogui (the server then runs shell/API actions only)
  --force          rebuild even when OUT.qcow2 exists
  -h, --help       this text

Needs: debootstrap qemu-utils e2fsprogs mount, a loop device (mount -o loop); no partition
support in the host kernel (the disk has no partition table).
Build: 1.5-3 minutes (most of it apt); the qcow2 is ~0.9 GB. Example:
  sudo tools/build_vm_image.sh ~/.cache/cua_jax/vm/debian.qcow2      # or: make vm-image
  sudo tools/build_vm_image.sh ~/.cache/cua_jax/vm/debian-office.qcow2 --apps office
                                                       # or: make vm-image APPS=office
  CUA_QEMU_IMAGE=~/.cache/cua_jax/vm/debian.qcow2 pytest tests/envs/vm/test_vm_qemu_real.py
  # in code: QemuDesktop(IMG, token=open(IMG + ".token").read().strip(), memory_mb=1024)
The guest boots in 1-4 minutes under TCG on a 2-core host (the busier, the longer) (KVM with VMX/SVM: faster,
not measured: the host this was built on had a PVM /dev/kvm, which QemuDesktop skips).
EOF
}

die() { echo "build_vm_image: $*" >&2; exit 1; }
log() { echo "build_vm_image: $(date +%T) $*" >&2; }

OUT="" SIZE="" SUITE=trixie MIRROR=http://deb.debian.org/debian TOKEN="" CACHE="" PYAUTOGUI=1 FORCE=0
APPS=base PASSWORD=password
# the Makefile's OFFICE_APT_PKGS (it passes its list in the environment; tests/test_hosts.py
# checks the two agree)
OFFICE_APT_PKGS="${OFFICE_APT_PKGS:-libreoffice-calc libreoffice-writer libreoffice-impress gimp vlc thunderbird evince}"
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --size) SIZE="${2:?--size needs a value}"; shift 2 ;;
    --suite) SUITE="${2:?--suite needs a value}"; shift 2 ;;
    --mirror) MIRROR="${2:?--mirror needs a value}"; shift 2 ;;
    --apps) APPS="${2:?--apps needs a value}"; shift 2 ;;
    --password) PASSWORD="${2:?--password needs a value}"; shift 2 ;;
    --token) TOKEN="${2:?--token needs a value}"; shift 2 ;;
    --cache) CACHE="${2:?--cache needs a value}"; shift 2 ;;
    --no-pyautogui) PYAUTOGUI=0; shift ;;
    --force) FORCE=1; shift ;;
    -*) usage >&2; die "unknown option $1" ;;
    *) [ -z "$OUT" ] || { usage >&2; die "one OUT.qcow2 only (got $OUT and $1)"; }; OUT="$1"; shift ;;
  esac
done
[ -n "$OUT" ] || { usage >&2; exit 2; }
case "$APPS" in base) SIZE="${SIZE:-4G}" ;; office) SIZE="${SIZE:-8G}" ;;
  *) die "--apps: base or office, got $APPS" ;; esac
[ -n "$PASSWORD" ] && [ "${PASSWORD#*:}" = "$PASSWORD" ] && [ "$PASSWORD" = "$(printf %s "$PASSWORD" | tr -d '\n')" ] \
  || die "--password: not empty, no ':' or newline"
[ "$(id -u)" = 0 ] || die "run as root (debootstrap, loop devices, mount, chroot)"
for t in debootstrap qemu-img mkfs.ext4 mount umount mountpoint chroot blkid fstrim; do
  command -v "$t" >/dev/null || die "missing $t: apt-get install debootstrap qemu-utils e2fsprogs mount util-linux"
done

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -f "$REPO/envs/vm/server.py" ] || die "cannot find envs/vm/server.py under $REPO"
mkdir -p "$(dirname "$OUT")"
OUT="$(cd "$(dirname "$OUT")" && pwd)/$(basename "$OUT")"
if [ -e "$OUT" ] && [ "$FORCE" = 0 ]; then
  log "$OUT exists (--force rebuilds it); token in $OUT.token"
  exit 0
fi
if [ -z "$TOKEN" ]; then
  if [ -s "$OUT.token" ]; then TOKEN="$(cat "$OUT.token")"
  else TOKEN="$(head -c 24 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')"; fi
fi
case "$TOKEN" in *[!A-Za-z0-9._~-]*) die "--token: use letters, digits and . _ ~ - only" ;; esac
CACHE="${CACHE:-$(dirname "$OUT")/.debcache}"
mkdir -p "$CACHE/partial"
CACHE="$(cd "$CACHE" && pwd)"

WORK="$OUT.build"            # raw disk and mount point, removed at the end
RAW="$WORK/disk.raw"         # the whole disk is one ext4 filesystem
ROOT="$WORK/root"

unmount_all() {   # the chroot's mounts (/dev, the .deb cache: host paths), then the disk
  local m
  for m in var/cache/apt/archives dev/pts dev proc sys; do
    mountpoint -q "$ROOT/$m" 2>/dev/null && umount -l "$ROOT/$m"
  done
  mountpoint -q "$ROOT" 2>/dev/null && umount "$ROOT"   # mount -o loop: detaches the loop too
  return 0
}
remove_work() {   # never rm -rf through a mount that is still there (host /dev, the cache)
  if awk -v w="$WORK/" 'index($2 "/", w) == 1 { found = 1 } END { exit !found }' /proc/mounts; then
    log "not removing $WORK: something is still mounted under it"
    return 1
  fi
  rm -rf "$WORK"
}
cleanup() {
  local rc=$?
  set +e
  unmount_all
  if [ $rc -ne 0 ]; then log "FAILED (exit $rc); partial build left in $WORK"; else remove_work; fi
}
trap cleanup EXIT

# Leftovers of an interrupted build: unmount them, then start over.
if [ -d "$WORK" ]; then
  unmount_all
  remove_work || die "unmount what is mounted under $WORK (see /proc/mounts), then rerun"
fi
mkdir -p "$ROOT"
T0=$(date +%s)

log "disk: $SIZE, one ext4 filesystem over the whole disk"
truncate -s "$SIZE" "$RAW"
# ^64bit: extlinux reads 32-bit ext4 everywhere; 4-16 GB disks never need 64-bit block numbers
mkfs.ext4 -q -F -L cua-root -O ^64bit "$RAW"
UUID="$(blkid -s UUID -o value "$RAW")"
mount -o loop "$RAW" "$ROOT"

log "debootstrap $SUITE (minbase) from $MIRROR"
debootstrap --variant=minbase --cache-dir="$CACHE" "$SUITE" "$ROOT" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
  || { tail -30 "$WORK/debootstrap.log" >&2; die "debootstrap failed (log: $WORK/debootstrap.log)"; }

mount -t proc proc "$ROOT/proc"
mount -t sysfs sys "$ROOT/sys"
mount --bind /dev "$ROOT/dev"
mount --bind /dev/pts "$ROOT/dev/pts"
mount --bind "$CACHE" "$ROOT/var/cache/apt/archives"
in_root() { chroot "$ROOT" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
  DEBIAN_FRONTEND=noninteractive "$@"; }

SEC="http://deb.debian.org/debian-security"
{
  echo "deb $MIRROR $SUITE main"
  case "$SUITE" in sid|unstable) ;; *)
    echo "deb $MIRROR $SUITE-updates main"
    echo "deb $SEC $SUITE-security main" ;;
  esac
} >"$ROOT/etc/apt/sources.list"
printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"   # no services start in the chroot
chmod +x "$ROOT/usr/sbin/policy-rc.d"
printf 'do_symlinks = yes\n' >"$ROOT/etc/kernel-img.conf"
# no documentation, manual pages or translations in the guest: a smaller image
cat >"$ROOT/etc/dpkg/dpkg.cfg.d/01-cua-nodoc" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
[ -d "$ROOT/usr/share/doc" ] && [ "$ROOT" != / ] \
  && find "$ROOT/usr/share/doc" -type f ! -name copyright -delete
echo cua-vm >"$ROOT/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 cua-vm\n' >"$ROOT/etc/hosts"
# pass 0: no fsck at boot (every guest starts from a fresh overlay of a clean filesystem)
printf 'UUID=%s / ext4 errors=remount-ro,noatime 0 0\n' "$UUID" >"$ROOT/etc/fstab"

PKGS=(
  linux-image-amd64 systemd-sysv udev dbus kmod extlinux
  xvfb openbox xdotool wmctrl x11-utils x11-xserver-utils scrot xterm imagemagick
  fonts-dejavu-core nano xdg-utils procps iproute2
  python3 python-is-python3 python3-aiohttp python3-numpy python3-pil python3-xlib python3-tk
  sudo
)
# xdg-open (the server's /setup/open_file) outside a desktop session picks the app by
# `file --mime-type` and the desktop files' MIME cache (update-desktop-database)
if [ "$APPS" = office ]; then
  read -r -a EXTRA <<<"$OFFICE_APT_PKGS"
  # python3-absl: envs.vm.providers (the profiles' code, run at build time) imports it
  PKGS+=("${EXTRA[@]}" file desktop-file-utils shared-mime-info python3-absl)
fi
log "apt-get install ${#PKGS[@]} packages (and their dependencies, no recommends)"
in_root apt-get update -qq >"$WORK/apt.log" 2>&1 || { tail -30 "$WORK/apt.log" >&2; die "apt-get update failed"; }
in_root apt-get install -y -q --no-install-recommends "${PKGS[@]}" >>"$WORK/apt.log" 2>&1 \
  || { tail -30 "$WORK/apt.log" >&2; die "apt-get install failed (log: $WORK/apt.log)"; }

KVER="$(basename "$(ls -d "$ROOT"/lib/modules/* | sort -V | tail -1)")"
[ -f "$ROOT/boot/vmlinuz-$KVER" ] && [ -f "$ROOT/boot/initrd.img-$KVER" ] \
  || die "no kernel/initrd for $KVER in /boot"

log "extlinux (kernel $KVER)"
mkdir -p "$ROOT/boot/extlinux"
cat >"$ROOT/boot/extlinux/extlinux.conf" <<EOF
DEFAULT cua
PROMPT 0
TIMEOUT 1
LABEL cua
  LINUX /boot/vmlinuz-$KVER
  INITRD /boot/initrd.img-$KVER
  APPEND root=UUID=$UUID ro fsck.mode=skip console=tty0 console=ttyS0,115200n8 quiet loglevel=3 systemd.show_status=auto
EOF
# the boot sector goes to the filesystem's first sector (ext4 leaves 1 KiB free there), which
# is the disk's first sector: SeaBIOS runs it directly (no MBR, no partition offset)
in_root extlinux --install /boot/extlinux >>"$WORK/apt.log" 2>&1 || die "extlinux --install failed"

log "guest config: user, network, cua-desktop.service"
in_root useradd -m -u 1000 -s /bin/bash -G sudo user
printf 'user:%s\n' "$PASSWORD" | in_root chpasswd
# a home as LocalDesktop's: no dot files (/etc/skel's .bashrc retitles every xterm
# "user@cua-vm: ~", and tasks find their windows by the title they launched them with, xterm -T
# task-term), and the folders OSWorld's tasks assume
find "$ROOT/home/user" -mindepth 1 -delete
mkdir "$ROOT"/home/user/{Desktop,Documents,Downloads}
# sudo asks for the password on every call (as OSWorld's tasks expect: each one pipes it in),
# without the first-use lecture
printf 'Defaults timestamp_timeout=0\nDefaults lecture=never\n' >"$ROOT/etc/sudoers.d/cua"
chmod 440 "$ROOT/etc/sudoers.d/cua"
in_root visudo -cq || die "sudoers does not parse"
in_root passwd -l root >/dev/null
mkdir -p "$ROOT/etc/cua"
printf '%s\n' "$TOKEN" >"$ROOT/etc/cua/token"
in_root chown root:user /etc/cua/token
chmod 640 "$ROOT/etc/cua/token"

cat >"$ROOT/etc/systemd/network/80-dhcp.network" <<'EOF'
[Match]
Name=en* eth*

[Network]
DHCP=ipv4
EOF
echo 'nameserver 10.0.2.3' >"$ROOT/etc/resolv.conf"   # QEMU user networking's DNS
mkdir -p "$ROOT/etc/systemd/journald.conf.d"
printf '[Journal]\nStorage=volatile\n' >"$ROOT/etc/systemd/journald.conf.d/cua.conf"

cat >"$ROOT/usr/local/bin/cua-desktop" <<'EOF'
#!/bin/sh
# The guest's desktop (cua-desktop.service): Xvfb, openbox, then the VM server on 0.0.0.0:5000
# with the token baked at build time (/etc/cua/token). Reached only through QEMU's hostfwd.
set -e
Xvfb "$DISPLAY" -screen 0 "$SCREEN" -nolisten tcp -noreset &
for i in $(seq 100); do xdpyinfo >/dev/null 2>&1 && break; sleep 0.05; done
# as LocalDesktop: keycode 94 types '<' in both levels (pyautogui.typewrite('<'))
xmodmap -e 'keycode 94 = less less' || true
openbox &
for i in $(seq 100); do wmctrl -m >/dev/null 2>&1 && break; sleep 0.05; done
CUA_VM_TOKEN="$(cat /etc/cua/token)"
export CUA_VM_TOKEN
# a TCG guest is slow: LibreOffice's cold start alone takes ~60 s, so an open step waits 240 s
exec python3 -m envs.vm.server --host 0.0.0.0 --port 5000 --exec-limit 240 --open-wait 240
EOF
chmod 755 "$ROOT/usr/local/bin/cua-desktop"
cat >"$ROOT/etc/systemd/system/cua-desktop.service" <<'EOF'
[Unit]
Description=cua_jax desktop: Xvfb :0, openbox and the VM server on port 5000

[Service]
User=user
WorkingDirectory=/home/user
Environment=HOME=/home/user DISPLAY=:0 SCREEN=1280x720x24 PYTHONPATH=/opt/cua LANG=C.UTF-8
ExecStart=/usr/local/bin/cua-desktop
StandardError=journal+console
Restart=always
RestartSec=1

[Install]
WantedBy=multi-user.target
EOF
in_root systemctl enable -q systemd-networkd cua-desktop.service
in_root systemctl set-default -q multi-user.target
# nothing that runs later by itself (a snapshot must stay as booted) or asks on the console
in_root systemctl mask -q apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer \
  fstrim.timer systemd-firstboot.service 2>/dev/null || true
in_root systemd-machine-id-setup >/dev/null 2>&1 || true

log "this checkout's envs/ -> /opt/cua"
mkdir -p "$ROOT/opt/cua/cua_jax" "$ROOT/opt/cua/envs"
cp "$REPO"/cua_jax/{__init__.py,env_api.py,hosts.py} "$ROOT/opt/cua/cua_jax/"
cp -r "$REPO/cua_jax/actions" "$ROOT/opt/cua/cua_jax/actions"
cp "$REPO"/envs/{__init__.py,tasks.py} "$ROOT/opt/cua/envs/"
cp -r "$REPO/envs/vm" "$ROOT/opt/cua/envs/vm"
find "$ROOT/opt/cua" -name __pycache__ -prune -exec rm -rf {} +
in_root python3 -m compileall -q /opt/cua >/dev/null || true

if [ "$PYAUTOGUI" = 1 ]; then
  PYV="$(in_root python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  PIP=""
  for p in "${PIP_CMD:-}" "python3 -m pip" pip3; do
    [ -n "$p" ] && $p --version >/dev/null 2>&1 && { PIP="$p"; break; }
  done
  # pure-Python packages (Debian has no pyautogui); the versions this repo's tests use
  if [ -n "$PIP" ] && $PIP install -q --no-deps --no-compile --disable-pip-version-check \
      --target "$ROOT/usr/local/lib/python$PYV/dist-packages" \
      pyautogui==0.9.54 pymsgbox==2.0.1 pytweening==1.2.0 pyscreeze==1.0.1 \
      pygetwindow==0.0.9 mouseinfo==0.1.3 pyrect==0.2.0 pyperclip==1.11.0 >>"$WORK/apt.log" 2>&1; then
    log "pyautogui installed (python$PYV)"
  else
    log "WARNING: no pyautogui (pip missing or PyPI unreachable): pyautogui actions will fail in the guest"
  fi
fi
in_root env PYTHONPATH=/opt/cua python3 -c 'import aiohttp, numpy, PIL, Xlib, envs.vm.server' \
  || die "the VM server does not import in the guest"
if [ "$APPS" = office ]; then
  log "office apps: the per-user settings a LocalDesktop's home gets, MIME cache"
  # the same code a LocalDesktop runs on its fresh home (the apps' versions from the guest)
  in_root env PYTHONPATH=/opt/cua python3 -c \
    'from pathlib import Path; from envs.vm.providers import _seed_app_profiles as s; s(Path("/home/user"))' \
    || die "seeding the apps' profiles failed"
  XCU="$ROOT/home/user/.config/libreoffice/4/user/registrymodifications.xcu"
  [ -f "$XCU" ] || die "no LibreOffice profile in /home/user (is soffice in the guest?)"
  # LibreOffice's first start fills in the rest of its profile (tens of seconds under TCG);
  # done here once, as user, so a task's first `open` in the guest starts a used profile
  in_root chown -R user:user /home/user
  timeout 600 chroot --userspec=1000:1000 "$ROOT" env -i PATH=/usr/bin:/bin HOME=/home/user \
    LANG=C.UTF-8 soffice --headless --norestore --terminate_after_init >>"$WORK/apt.log" 2>&1 \
    || log "WARNING: LibreOffice's first start failed: its profile is made in the guest instead"
  grep -q '"WarnAlienFormat"' "$XCU" || die "LibreOffice's first start dropped the seeded settings"
  rm -rf "$ROOT/home/user/.cache"
  in_root update-desktop-database -q /usr/share/applications || true
  for m in application/vnd.openxmlformats-officedocument.spreadsheetml.sheet \
      application/vnd.oasis.opendocument.text; do
    app="$(in_root env HOME=/home/user xdg-mime query default "$m" 2>/dev/null || true)"
    [ -n "$app" ] || die "xdg-open has no app for $m in the guest"
  done
fi
in_root chown -R user:user /home/user
# the server's request guard uses aiohttp >= 3.9 APIs (pyproject.toml pins aiohttp>=3.9)
in_root python3 -c 'import aiohttp, sys; v = tuple(int(x) for x in aiohttp.__version__.split(".")[:2]); sys.exit(v < (3, 9))' \
  || die "$SUITE's python3-aiohttp is older than 3.9: the server needs 3.9 (use --suite trixie or newer)"

log "clean up and shrink; MiB used by:"
du -xsm "$ROOT"/usr/lib/modules "$ROOT"/usr/lib/firmware "$ROOT"/usr/lib/x86_64-linux-gnu \
  "$ROOT"/usr/lib/python3* "$ROOT"/usr/share "$ROOT"/boot "$ROOT"/usr/local 2>/dev/null \
  | sed "s|$ROOT||" >&2 || true
rm -f "$ROOT/usr/sbin/policy-rc.d"
umount "$ROOT/var/cache/apt/archives"
in_root apt-get clean
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/tmp/* "$ROOT"/var/log/*.log "$ROOT/var/cache/debconf/"*-old
for m in dev/pts dev proc sys; do umount "$ROOT/$m"; done
sync   # ext4 only trims blocks whose freeing has been committed
fstrim "$ROOT" || log "fstrim failed: the qcow2 keeps deleted files' blocks (larger, still works)"
umount "$ROOT"

log "qemu-img convert -O qcow2"
qemu-img convert -O qcow2 "$RAW" "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
( umask 077; printf '%s\n' "$TOKEN" >"$OUT.token" )
log "done in $(( $(date +%s) - T0 )) s: $OUT ($(du -h "$OUT" | cut -f1)), token in $OUT.token"
