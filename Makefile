# Crab — two commands, both as root on Debian 12:
#   make demo   build, set up, and run the demo
#   make test   every test, privileged ones included (what CI runs)
# Both install whatever is missing first (scripts/setup.sh) and are idempotent.
#   make bench  every benchmark (docs/performance.md says what each measures)

SHELL := /bin/bash
export CRAB_STATE_DIR ?= /var/lib/crab
CARGO ?= cargo
# `crab bench` lives behind the crab binary's `bench` feature (the daemon does not need it).
FEATURES := --features crab/bench

.PHONY: demo test test-python setup build build-release image lint bench clean-state

setup:
	@scripts/toolchain.sh
	@scripts/setup.sh

build: setup
	$(CARGO) build --workspace --all-targets $(FEATURES)

# With the benchmarks: `make demo`'s main job is `crab bench replay`.
build-release: setup
	$(CARGO) build --release -p crab $(FEATURES)

# The default image, built once per state directory (cached afterwards; rebuilt when the
# state directory holds one from an older recipe, as a CI machine that keeps its state does).
image-%:
	@target/$*/crab image build debian --rebuild-stale

demo: build-release
	@scripts/daemon.sh restart target/release/crab
	@$(MAKE) --no-print-directory image-release
	@scripts/demo.sh target/release/crab

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets $(FEATURES) -- -D warnings

# Tests that need root or a kernel feature fail (not skip) when they cannot run.
test: export CRAB_REQUIRE_PRIVILEGED = 1
# The daemon serves the E2B API for crates/crab/tests/e2b.rs (key digest committed for tests).
test: export CRAB_E2B_LISTEN ?= 127.0.0.1:3000
test: export CRAB_E2B_KEYS ?= $(CURDIR)/crates/crab/tests/e2b/test-keys
# First-use pulls (`sandbox create REF`) from the loopback registry of tests/images_pull.rs, and
# the Harbor task's `FROM` in python/tests/test_harbor.py.
test: export CRAB_INSECURE_REGISTRIES ?= 127.0.0.1:5761,127.0.0.1:5772
test: build lint
	@scripts/daemon.sh restart target/debug/crab
	@$(MAKE) --no-print-directory image-debug
	$(CARGO) test --workspace $(FEATURES) -- --test-threads=4
	@$(MAKE) --no-print-directory test-python
	@scripts/daemon.sh stop

# The Python SDK (python/) against the running daemon, in the venv of scripts/install-python-sdk.sh;
# test_ray.py starts a two-node Ray cluster on loopback with two more daemons of its own;
# test_mini_swe_agent.py runs the real mini-swe-agent through a crab-docker link;
# test_inspect_provider.py runs Inspect AI's own sandbox checks and an eval on `sandbox="crab"`;
# test_harbor.py runs `harbor run` (its own Python >= 3.12 venv, scripts/install-harbor.sh).
test-python:
	CRAB_BIN=$(CURDIR)/target/debug/crab CRAB_HARBOR_PY=$$(scripts/install-harbor.sh | tail -n 1) \
		$$(scripts/install-python-sdk.sh --with-ray --with-agents --with-inspect | tail -n 1) -m pytest python/tests -q

bench: export CRAB_E2B_LISTEN ?= 127.0.0.1:3000
bench: export CRAB_E2B_KEYS ?= $(CURDIR)/crates/crab/tests/e2b/test-keys
# python/bench_harness.py's Harbor task is `FROM` a loopback registry.
bench: export CRAB_INSECURE_REGISTRIES ?= 127.0.0.1:5772
bench: setup
	$(CARGO) build --release -p crab -p crab-bench --features crab/bench
	@scripts/daemon.sh restart target/release/crab
	@$(MAKE) --no-print-directory image-release
	target/release/crab bench foundation
	target/release/crab bench proxy
	target/release/crab bench turns --time-scale 0.1
	E2B_API_KEY=e2b_crab_test_key target/release/crab bench e2b
	target/release/crab-inspector-bench --rounds 5
	target/release/crab bench lifecycle --rounds 10 --fork 8
	target/release/crab bench images --rounds 3
	$$(scripts/install-python-sdk.sh | tail -n 1) python/bench_sdk.py --crab target/release/crab
	python3 python/bench_harness.py --rounds 3 --samples 8 \
		--inspect-python $$(scripts/install-python-sdk.sh --with-inspect | tail -n 1) \
		--harbor-python $$(scripts/install-harbor.sh | tail -n 1)
	target/release/crab bench replay --traces examples/traces --llm-latency scale:0.2 --json-out target/bench-replay.json --svg target/bench-replay.svg
