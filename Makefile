# One-command set-up. `make test` and `make smoke` work on a fresh Debian machine.
PY ?= python3.12
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
APT_PKGS := chromium xvfb xdotool wmctrl x11-utils openbox scrot xterm imagemagick fonts-dejavu-core nano x11-xserver-utils postgresql
VM_APT_PKGS := qemu-system-x86 qemu-utils debootstrap
# APPS=office: the guest also gets OFFICE_APT_PKGS (below), in its own image by default
APPS ?= base
VM_IMAGE ?= $(HOME)/.cache/cua_jax/vm/debian$(if $(filter office,$(APPS)),-office).qcow2
VM_IMAGE_ARGS ?=

.PHONY: test smoke venv apt apt-office lint vm-image

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The test venv has OSWorld's evaluators too (the osworld extra, then desktop-env itself without
# its pins, which conflict with ours), so their tests run: about a minute and 1 GB more.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[test,osworld]'
	$(BIN)/pip install -q --no-deps desktop-env==1.0.2
	touch $(STAMP)

venv: $(STAMP)

# Debian packages the browser and desktop environments need (skipped when already present).
apt:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# Opt-in: OSWorld's office and media apps on this machine, so a LocalDesktop runs the task domains
# Debian packages (LibreOffice Calc/Writer/Impress; GIMP, VLC, Thunderbird, Evince). `make apt`
# and `make test` never pull them (about 250 packages, 1 GB installed); without them the office
# tests skip (tests/envs/vm/test_vm_osworld_office.py). Not here: gnome-terminal and nautilus
# (they need a D-Bus session, which a LocalDesktop does not start), VS Code (not in Debian).
OFFICE_APT_PKGS := libreoffice-calc libreoffice-writer libreoffice-impress gimp vlc thunderbird \
	evince

apt-office:
	@$(MAKE) --no-print-directory apt APT_PKGS="$(OFFICE_APT_PKGS)"

# A Debian guest image for QemuDesktop (envs/vm/qemu.py): tools/build_vm_image.sh, as root
# (debootstrap, a loop mount), into $(VM_IMAGE), its token in $(VM_IMAGE).token; a few minutes.
# Kept when it exists (VM_IMAGE_ARGS=--force rebuilds; see --help). The real-guest test: CUA_QEMU_IMAGE=$(VM_IMAGE) pytest
# tests/envs/vm/test_vm_qemu_real.py. `make vm-image APPS=office`: the office image
# ($(HOME)/.cache/cua_jax/vm/debian-office.qcow2, ~2.5 GB) with OFFICE_APT_PKGS and the apps'
# per-user settings; CUA_QEMU_OFFICE_IMAGE=... runs tests/envs/vm/test_vm_osworld_office.py's Calc
# task in it.
vm-image:
	@SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	missing=""; for p in $(VM_APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	fi; \
	mkdir -p "$$(dirname "$(VM_IMAGE)")" && $$SUDO env OFFICE_APT_PKGS="$(OFFICE_APT_PKGS)" \
	  tools/build_vm_image.sh "$(VM_IMAGE)" --apps "$(APPS)" $(VM_IMAGE_ARGS) && \
	if [ -n "$$SUDO" ]; then $$SUDO chown "$$(id -u):$$(id -g)" "$(VM_IMAGE)" "$(VM_IMAGE).token"; fi

test: venv apt
	$(BIN)/python -m pytest -n 2 --dist loadscope --no-loadscope-reorder --durations=25 tests

# The random-init policy is not scored (it is 0; the post-SFT eval is the RL phase's baseline).
smoke: venv apt
	$(BIN)/python launch/tpu.py --config=configs/qwen3vl_grpo.py:smoke --workdir=$${WORKDIR:-/tmp/cua_smoke} \
	  --config.log.eval_before_sft=False

lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
