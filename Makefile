# pagekeeper: `make test` is the one test command (README, .ci/run); `make demo` the tour.
SHELL := /bin/bash
CACHE ?= $(HOME)/.cache/pagekeeper
VENV ?= $(CACHE)/venv
PY := $(VENV)/bin/python
export PAGEKEEPER_CACHE := $(CACHE)
export PYTHONPATH := $(CURDIR)/operator:$(CURDIR)/engine:$(CURDIR)/memplan:$(CURDIR)
export PATH := $(CACHE)/bin:$(VENV)/bin:$(PATH)
# Where `make test`'s background jobs keep their logs and exit statuses (hack/jobs.sh).
export PAGEKEEPER_JOBS ?= $(CURDIR)/.jobs

.PHONY: help venv tools tools-core lint typecheck imports crds-check test test-fast test-hog test-crash \
	cluster cluster-down demo \
	demo-autoscale clean results \
	images images-push images-test

help:
	@echo "make test     lint, type-check, import contracts, CRD drift and every test suite"
	@echo "make test-hog make test three times with one core kept busy (speed independence)"
	@echo "make test-crash  the operator killed at every fault point with every seed"
	@echo "make demo     local control plane + operator + CPU engine + the alert -> roll loop"
	@echo "make demo-autoscale   the same with autoscaling: 1 -> 3 pods under load and back"
	@echo "make tools    build/install the test tools into $(CACHE) (skips what is there)"
	@echo "make results  redraw docs/benchmarks.md's plots from docs/results/*.json"
	@echo "make images   build pagekeeper-operator and pagekeeper-engine (BASES=published|debian)"
	@echo "make images-push REGISTRY=ghcr.io/you   push them"

# The environment is reinstalled when pyproject.toml's content changes, not its time stamp (a
# fresh clone's files are all new). The code itself comes from PYTHONPATH above, whichever
# clone installed the environment.
VENV_STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-16)
$(VENV_STAMP):
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[operator,engine,dev]'
	rm -f $(VENV)/.installed*
	touch $@

venv: $(VENV_STAMP)

tools: venv
	bash hack/provision.sh all

# The control plane's tools, the CRDs and kstatus: what every integration test needs.
tools-core:
	bash hack/provision.sh core

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/hadolint Dockerfile

# mypy's cache outlives the clone: it checks each file's hash when its time stamp changed.
typecheck: venv
	MYPY_CACHE_DIR=$(CACHE)/mypy $(VENV)/bin/mypy

imports: venv
	$(VENV)/bin/lint-imports --config .importlinter

crds-check: venv
	$(PY) -m pagekeeper_operator.crdgen --check

test-fast: venv
	$(PY) -m pytest tests -q -m 'not integration and not e2e'

# pytest-xdist workers for `make test`: the suite waits on processes, the control plane and
# Prometheus as much as it computes. On two cores two workers left a quarter of the CPU idle
# (mean 75% busy) and four kept it busy (96%): see docs/development.md.
PYTEST_WORKERS ?= 4

# The slow one-off builds start first, in the background (hack/jobs.sh): the test images and
# Argo CD's Lua test binary, which only tests/images and the GitOps tests need; those wait for
# them and run last. Meanwhile the Python environment and the control plane's tools build side
# by side, then the checks run and pytest. pytest's exit code 5 (no tests collected) is a
# failure here, never a pass; so is a background job that failed.
test:
	bash hack/provision.sh packages
	bash hack/jobs.sh start images bash hack/images.sh build debian
	bash hack/jobs.sh start argocd bash hack/provision.sh argocd
	$(MAKE) --no-print-directory -j2 venv tools-core
	bash hack/provision.sh vllm
	$(MAKE) --no-print-directory -j2 lint typecheck imports crds-check
	$(PY) -m pytest tests -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=25; rc=$$?; \
	bash hack/jobs.sh wait images argocd || rc=1; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The suite three times (RUNS=n) with one core kept busy by another process throughout.
test-hog:
	bash hack/test_with_hog.sh

# The crash-consistency suite in full (make test runs seed 0 of each point): every fault point
# with every seed, each case's outcome and time to converge in build/, and the table of
# docs/crash-consistency.md printed from them.
CRASH_RESULTS := $(CURDIR)/build/crash-results.jsonl
test-crash: venv tools
	mkdir -p build && rm -f $(CRASH_RESULTS)
	PAGEKEEPER_CRASH_FULL=1 PAGEKEEPER_CRASH_RESULTS=$(CRASH_RESULTS) \
		$(PY) -m pytest tests/crash -q -m crash
	$(PY) -m tests.crash.report $(CRASH_RESULTS)

# docs/benchmarks.md's plots, drawn from the recorded figures (tests/benchmarks/test_results_plots.py
# fails where a committed SVG is not what its JSON draws).
results:
	$(PY) -m benchmarks.results_plots

cluster: venv tools
	@bash hack/cluster.sh up pagekeeper-dev

cluster-down:
	bash hack/cluster.sh down pagekeeper-dev

# Provisions what is missing, then runs the narrated alert -> roll loop; cleans up on exit.
demo: venv
	$(PY) hack/demo.py

# The same, with the autoscaling scene: 1 -> 3 pods under load and back, the loaded pod kept.
demo-autoscale: venv
	$(PY) hack/demo.py --autoscaling

# Both Dockerfile targets with buildah (hack/images.sh): BASES=published, the Dockerfile's own
# bases from their registry; BASES=debian, bases made here from Debian's packages (tags -bookworm).
BASES ?= published
images:
	bash hack/provision.sh containers
	bash hack/images.sh build $(BASES)

images-push:
	@test -n "$(REGISTRY)" || { echo "usage: make images-push REGISTRY=ghcr.io/you [BASES=...]" >&2; exit 2; }
	bash hack/images.sh push "$(REGISTRY)" $(BASES)

# The images the tests run (tests/images/); the layer cache makes a warm build take seconds.
images-test: tools
	bash hack/images.sh build debian

clean:
	rm -rf .pytest_cache .mypy_cache .ruff_cache build *.egg-info
