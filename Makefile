# aioembed: the two commands a newcomer runs are `make demo` and `make test` (see README.md).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Transport plugins and the pip extra each is installed with on a CPU-only machine.
PLUGINS := mooncake:non-cuda ucx:cu12 nixl:cu12
PYTEST_ARGS ?=
# A hung test fails with a traceback after this long instead of stalling CI until its own limit.
TEST_TIMEOUT ?= --timeout=300

.PHONY: demo test install install-plugins system-deps check lint typecheck test-core test-plugins soak bench clean

# A venv that failed half way (Debian/Ubuntu without python3-venv: no ensurepip) leaves bin/python behind; without
# it, the next `make` would skip this step and fail with "No module named pip".
$(PY):
	$(PYTHON) -m venv $(VENV) || { rm -f $(PY); echo "could not make $(VENV) with $(PYTHON) (on Debian/Ubuntu: apt-get install python3-venv)" >&2; exit 1; }

# The CPU wheel of torch is pinned first: an unpinned torch pulls a multi-GB CUDA build.
install: $(VENV)/.core-installed
$(VENV)/.core-installed: pyproject.toml | $(PY)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	touch $@

# Mooncake's engine links libibverbs (even for TCP), libnuma and libcurl.
system-deps:
	@if ! ldconfig -p | grep -q 'libibverbs.so.1 ' || ! ldconfig -p | grep -q 'libnuma.so.1 '; then \
	  echo "installing system libraries for the Mooncake transport (libibverbs1 libnuma1 libcurl4)"; \
	  $(SUDO) apt-get update -qq; \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq libibverbs1 libnuma1 libcurl4 >/dev/null; \
	fi

install-plugins: install system-deps
	@for spec in $(PLUGINS); do \
	  name=$${spec%%:*}; extra=$${spec#*:}; \
	  if [ -f transports/$$name/pyproject.toml ]; then \
	    echo "installing transport plugin aioembed-$$name[$$extra]"; \
	    $(PIP) install --quiet -e "transports/$$name[$$extra]"; \
	  fi; \
	done

# Main job: an end-to-end transfer on the embedded default transport (loopback).
demo: install
	$(VENV)/bin/aioembed demo

lint: install
	$(VENV)/bin/ruff check src tests tools transports examples

typecheck: install-plugins
	$(VENV)/bin/mypy src
	@for d in transports/*/src; do \
	  [ -d "$$d" ] || continue; \
	  echo "mypy --strict $$d"; \
	  (cd "$$(dirname $$d)" && ../../$(VENV)/bin/mypy --strict src); \
	done

# Two pytest workers (pytest-xdist): most tests wait on timers, sockets and child processes.
TEST_WORKERS ?= 2

test-core: install
	$(PY) tools/run_pytest.py tests -m "not slow" -n $(TEST_WORKERS) $(TEST_TIMEOUT) $(PYTEST_ARGS)

# The plugins' suites run at the same time (each waits mostly on its own processes and timers); each
# suite's output is printed whole when it ends, and any failure fails the target.
test-plugins: install-plugins
	@logs=$$(mktemp -d); jobs=""; \
	for d in transports/*/tests; do \
	  [ -d "$$d" ] || continue; \
	  name=$$(basename "$$(dirname "$$d")"); \
	  (cd "$$(dirname "$$d")" && ../../$(PY) ../../tools/run_pytest.py tests -m "not slow" $(TEST_TIMEOUT) \
	    $(PYTEST_ARGS) > "$$logs/$$name.log" 2>&1) & jobs="$$jobs $$!:$$name"; \
	done; \
	fail=0; for job in $$jobs; do \
	  pid=$${job%%:*}; name=$${job#*:}; \
	  if wait "$$pid"; then status=passed; else status=FAILED; fail=1; fi; \
	  echo "== transports/$$name/tests: $$status"; cat "$$logs/$$name.log"; \
	done; \
	rm -rf "$$logs"; exit $$fail

# Everything: lint, types, core tests, every transport plugin's tests (slow soaks excluded).
test: install-plugins lint typecheck test-core test-plugins

# Full-length soak and chaos tests (CI runs bounded versions as part of `make test`).
soak: install-plugins
	$(PY) tools/run_pytest.py tests -m slow $(PYTEST_ARGS)
	@fail=0; for d in transports/*/tests; do \
	  [ -d "$$d" ] || continue; \
	  echo "== $$d (slow)"; \
	  (cd "$$(dirname "$$d")" && ../../$(PY) ../../tools/run_pytest.py tests -m slow $(PYTEST_ARGS)) || fail=1; \
	done; exit $$fail

bench: install-plugins
	$(VENV)/bin/aioembed bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
