# Crab — two commands, both as root on Debian 12:
#   make demo   build, set up, and run the demo
#   make test   every test, privileged ones included (what CI runs)
# Both install whatever is missing first (scripts/setup.sh) and are idempotent.
#   make bench  every benchmark (docs/performance.md says what each measures)

SHELL := /bin/bash
export CRAB_STATE_DIR ?= /var/lib/crab
CARGO ?= cargo

.PHONY: demo test test-python setup build build-release image lint bench clean-state

setup:
	@scripts/toolchain.sh
	@scripts/setup.sh

build: setup
	$(CARGO) build --workspace --all-targets

build-release: setup
	$(CARGO) build --release -p crab

# The default image, built once per state directory (cached afterwards).
image-%:
	@target/$*/crab image build debian

demo: build-release
	@scripts/daemon.sh restart target/release/crab
	@$(MAKE) --no-print-directory image-release
	@scripts/demo.sh target/release/crab

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# Tests that need root or a kernel feature fail (not skip) when they cannot run.
test: export CRAB_REQUIRE_PRIVILEGED = 1
# The daemon serves the E2B API for crates/crab/tests/e2b.rs (key digest committed for tests).
test: export CRAB_E2B_LISTEN ?= 127.0.0.1:3000
test: export CRAB_E2B_KEYS ?= $(CURDIR)/crates/crab/tests/e2b/test-keys
test: build lint
	@scripts/daemon.sh restart target/debug/crab
	@$(MAKE) --no-print-directory image-debug
	$(CARGO) test --workspace -- --test-threads=4
	@$(MAKE) --no-print-directory test-python
	@scripts/daemon.sh stop

# The Python SDK (python/) against the running daemon, in the venv of scripts/install-python-sdk.sh.
test-python:
	CRAB_BIN=$(CURDIR)/target/debug/crab $$(scripts/install-python-sdk.sh | tail -n 1) -m pytest python/tests -q

bench: export CRAB_E2B_LISTEN ?= 127.0.0.1:3000
bench: export CRAB_E2B_KEYS ?= $(CURDIR)/crates/crab/tests/e2b/test-keys
bench: build-release
	@scripts/daemon.sh restart target/release/crab
	@$(MAKE) --no-print-directory image-release
	target/release/crab bench foundation
	target/release/crab bench proxy
	target/release/crab bench turns --time-scale 0.1
	E2B_API_KEY=e2b_crab_test_key target/release/crab bench e2b
	$(CARGO) run --release -p crab-inspector --bin crab-inspector-bench -- --rounds 5
	CRAB_BIN=$(CURDIR)/target/release/crab $(CARGO) test --release -p crab-checkpoint --test real_flows -- --ignored --nocapture --test-threads=1 bench
	target/release/crab bench replay --traces examples/traces --llm-latency scale:0.2 --json-out target/bench-replay.json --svg target/bench-replay.svg
