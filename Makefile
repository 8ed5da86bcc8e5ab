# specdec: `make demo` (main job on the default model), `make test` (test suite).
# Both bootstrap .venv themselves.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-interop bench clean-venv

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first and pinned: the local CPU wheel, never a multi-GB CUDA build
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test,data]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VPY) -m specdec.demo

test: $(STAMP)
	$(VPY) -m pytest -q --durations=15

# acceptance parity with vLLM CPU: installs vLLM into its own venv under the cache first (once)
test-interop: $(STAMP)
	$(VPY) -m specdec.cli peers install vllm
	$(VPY) -m pytest -q -m interop --durations=15 tests/test_interop.py

bench: $(STAMP)
	$(VPY) -m specdec.cli bench --target qwen2.5-coder-1.5b --limit-per-category 3 --max-new-tokens 128

clean-venv:
	rm -rf $(VENV)
