# One-command set-up. `make test` and `make smoke` work on a fresh Debian machine.
PY ?= python3.12
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
APT_PKGS := chromium xvfb xdotool wmctrl x11-utils openbox scrot xterm imagemagick fonts-dejavu-core nano x11-xserver-utils postgresql

.PHONY: test smoke venv apt lint

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[test]'
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

test: venv apt
	$(BIN)/python -m pytest -n 2 --dist loadscope tests

smoke: venv apt
	$(BIN)/python launch/tpu.py --config=configs/qwen3vl_grpo.py:smoke --workdir=$${WORKDIR:-/tmp/cua_smoke}

lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
