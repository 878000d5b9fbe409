# Elastic Rollout: the two commands a newcomer needs.
#   make run   - build, then start the manager with 2 simulated engines on this machine
#   make test  - set up everything (Python venv, cargo build) and run every test
# Everything is installed locally: Rust crates by cargo, Python packages into ./.venv.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CARGO ?= cargo
STATE_DIR ?= .rollout-state
PORT ?= 8000
ROUTER_PORT ?= 30000

.PHONY: run test example setup venv sglang-venv build build-release wheel lint lint-rust lint-python clean prometheus-tools openapi

# A venv needs ensurepip; Debian's system Python ships it separately (python3-venv).
# python/ is built by maturin (the native module elastic_rollout._native from rust/rollout-py);
# ray_integration/ is the Ray shim (Ray 2.60 with Serve).
$(VENV)/.ok: python/pyproject.toml ray_integration/pyproject.toml
	@if ! $(PYTHON) -m venv --clear $(VENV) >/dev/null 2>&1; then \
	  echo "python3 -m venv failed; installing Debian's python3-venv"; \
	  if command -v apt-get >/dev/null; then \
	    SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	    $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq python3-venv; \
	  fi; \
	  $(PYTHON) -m venv --clear $(VENV); \
	fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q 'maturin>=1.9,<2' 'ray[serve]==2.60.*' 'httpx>=0.27'
	# Wheels for older glibc and other architectures without Docker (make wheel), and their check.
	$(PY) -m pip install -q 'ziglang==0.17.1' 'cargo-zigbuild==0.24.1' 'auditwheel==6.8.2'
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pip install -q --no-build-isolation -e 'python[test]'
	$(PY) -m pip install -q -e ray_integration
	@touch $@ $(VENV)/.native

# Rebuild the native module when its Rust sources change (the venv itself is kept).
NATIVE_SRC := $(wildcard rust/rollout-py/Cargo.toml rust/rollout-py/src/*.rs rust/rollout-core/src/*.rs rust/rollout-core/src/*/*.rs)
$(VENV)/.native: $(VENV)/.ok $(NATIVE_SRC)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pip install -q --no-build-isolation --no-deps -e python
	@touch $@

venv: $(VENV)/.ok $(VENV)/.native

build:
	$(CARGO) build --workspace --bins

build-release:
	$(CARGO) build --release --workspace --bins

# Wheels into dist/: elastic-rollout (native module, the binaries in elastic_rollout/_bin/ and
# console scripts for them) for each architecture of WHEEL_ARCHES, linked against glibc
# WHEEL_GLIBC with zig (no Docker; cargo-zigbuild and ziglang come into .venv from PyPI), so it
# installs on RHEL/Rocky 8, Ubuntu 20.04, Debian 11 and newer; and elastic-rollout-ray (pure
# Python). deploy/build-wheels.sh says how. PROFILE=debug packages a debug build (CI, tests).
PROFILE ?= release
WHEEL_GLIBC ?= 2.28
WHEEL_ARCHES ?= $(shell uname -m)
wheel: venv
	@for arch in $(WHEEL_ARCHES); do \
	  rustup target list --installed | grep -qx "$$arch-unknown-linux-gnu" || rustup target add "$$arch-unknown-linux-gnu" || exit 1; \
	  TARGET=$$arch-unknown-linux-gnu.$(WHEEL_GLIBC) PROFILE=$(PROFILE) PYTHON=$(CURDIR)/$(PY) \
	    deploy/build-wheels.sh $(CURDIR)/dist || exit 1; \
	done

setup: venv build

run: build-release
	@echo "Starting rollout-manager with 2 simulated engines (Ctrl-C stops it and every engine)."
	@echo "  curl -s http://127.0.0.1:$(PORT)/rollout/engines | jq"
	@echo "  curl -s http://127.0.0.1:$(ROUTER_PORT)/generate -H 'Content-Type: application/json' \\"
	@echo "       -d '{\"text\": \"The capital of France is\", \"sampling_params\": {\"max_new_tokens\": 16}}'"
	@echo "  curl -s -X POST http://127.0.0.1:$(PORT)/rollout/scale_out -H 'Content-Type: application/json' -d '{\"num_replicas\": 4}'"
	@echo "  curl -s -X POST http://127.0.0.1:$(PORT)/rollout/scale_in  -H 'Content-Type: application/json' -d '{\"num_replicas\": 2}'"
	exec target/release/rollout-manager serve --engine sim --gpus 4 \
	  --rollout-num-gpus 2 --rollout-num-gpus-per-engine 1 \
	  --port $(PORT) --router-port $(ROUTER_PORT) --state-dir $(STATE_DIR) \
	  --engine-arg=--time-scale=0.1

# The fully-async example: a CPU trainer stand-in against a simulated fleet that the autoscaler
# grows; writes examples/fully_async/out/timeline.png (see examples/fully_async/README.md).
example: build-release venv
	$(PY) examples/fully_async/loop.py

# docs/openapi.json is generated from the handlers (rollout-manager openapi); `cargo test`
# fails while the committed file differs.
openapi: build
	target/debug/rollout-manager openapi > docs/openapi.json

lint: lint-rust lint-python

lint-rust:
	@$(CARGO) fmt --version >/dev/null 2>&1 && $(CARGO) clippy --version >/dev/null 2>&1 || rustup component add rustfmt clippy
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --quiet

# ruff and mypy come pinned with python[test]; their one config is python/pyproject.toml.
PY_CONFIG := python/pyproject.toml
PY_LINTED := python ray_integration tests benches examples
lint-python: venv
	$(VENV)/bin/ruff check --config $(PY_CONFIG) $(PY_LINTED)
	$(VENV)/bin/ruff format --config $(PY_CONFIG) --check $(PY_LINTED)
	$(VENV)/bin/mypy --config-file $(PY_CONFIG) python/elastic_rollout ray_integration/elastic_rollout_ray
	$(VENV)/bin/mypy --config-file $(PY_CONFIG) examples/fully_async/loop.py examples/slime/elastic_rollout_hooks.py \
	  examples/verl/elastic_rollout_verl.py examples/areal/elastic_rollout_areal.py

# promtool and prometheus for tests/test_observability.py: Debian's prometheus package unpacked
# into the venv (nothing installed system-wide, no daemon started).
PROM_TOOLS := $(VENV)/tools/prometheus
$(PROM_TOOLS)/.ok: $(VENV)/.ok
	@rm -rf $(PROM_TOOLS) && mkdir -p $(PROM_TOOLS)
	@cd $(PROM_TOOLS) && { apt-get download -qq prometheus 2>/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); $$SUDO apt-get update -qq && apt-get download -qq prometheus; }; } \
	  && dpkg-deb -x prometheus_*.deb . && rm -f prometheus_*.deb
	@$(PROM_TOOLS)/usr/bin/promtool --version | head -1
	@touch $@

prometheus-tools: $(PROM_TOOLS)/.ok

# The real-engine tier (tests/sglang/): SGLang 0.5.23 itself, on CPU, in a venv of its own outside
# the clone (about 10 GB), so that a new clone or `make clean` does not install it again. Exactly
# the pinned set in tests/sglang_cpu/requirements.txt, with --no-deps (no resolver: what CI
# installs is what was tried), by uv: about 2 minutes on 2 cores with the download, where pip took
# 5.6-9.5. The stamp names the requirements' hash, so a change to them installs afresh. Then the
# suite's CPU platform plugin (tests/sglang_cpu), reinstalled whenever it changes.
SGLANG_VENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/elastic-rollout/sglang-0.5.23
SGLANG_REQS := tests/sglang_cpu/requirements.txt
SGLANG_BASE = $(SGLANG_VENV)/.ok-$(shell sha256sum $(SGLANG_REQS) | cut -c1-16)
UV := $(VENV)/bin/uv
$(UV): $(VENV)/.ok
	$(PY) -m pip install -q 'uv==0.9.30'

$(SGLANG_BASE): | $(UV)
	@echo "Installing SGLang 0.5.23 for the real-engine tests into $(SGLANG_VENV) (once; about 10 GB)"
	@rm -rf $(SGLANG_VENV) && mkdir -p $(dir $(SGLANG_VENV))
	$(PYTHON) -m venv --without-pip $(SGLANG_VENV)
	$(UV) pip install -q --python $(SGLANG_VENV)/bin/python --no-deps --compile-bytecode -r $(SGLANG_REQS)
	@touch $@

SGLANG_PLUGIN := $(wildcard tests/sglang_cpu/pyproject.toml tests/sglang_cpu/er_sglang_cpu/*.py)
$(SGLANG_VENV)/.plugin: $(SGLANG_BASE) $(SGLANG_PLUGIN) | $(UV)
	$(UV) pip install -q --python $(SGLANG_VENV)/bin/python --no-deps --no-build-isolation --reinstall ./tests/sglang_cpu
	$(SGLANG_VENV)/bin/python -c "import sglang, er_sglang_cpu; print('sglang', sglang.__version__, 'with the CPU platform plugin')"
	@touch $@

sglang-venv: $(SGLANG_VENV)/.plugin

test: venv build lint prometheus-tools sglang-venv
	$(CARGO) test --workspace
	@# The monitor's test drives it in tmux, as a person would.
	@command -v tmux >/dev/null || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); $$SUDO apt-get install -y -qq tmux || { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq tmux; }; }
	@# The slowest tests are listed at the end, to keep CI within its time.
	ER_SGLANG_PYTHON=$(SGLANG_VENV)/bin/python $(PY) -m pytest tests -q --durations=20

clean:
	rm -rf $(VENV) $(STATE_DIR)
