# One-command set-up on a fresh machine (Rust, Python 3.9+, a C compiler):
#   make demo   install into .venv (with torch, transformers) and run the demo: one tree, then real decoding
#   make test   install into .venv (with torch, transformers, vLLM) and run every test
# .ci/run runs `make test`.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test install install-test lint rust-test py-test bench bench-rust bench-python clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Builds the Rust extension (release) and installs the package, editable.
install: $(PY)
	$(PIP) install -q -e .

# torch/transformers for the kernels and the engine; vLLM (CPU import only) for the adapter's tests.
install-test: $(PY)
	$(PIP) install -q -e ".[test,torch,vllm]"

# The tree demo, then real decoding with the committed trained pair (needs torch and transformers).
demo: $(PY)
	$(PIP) install -q -e ".[torch]"
	$(VENV)/bin/ddtree demo --pair tests/fixtures/models

lint: install-test
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --all-targets --features python -- -D warnings
	$(VENV)/bin/ruff check python tests benches
	$(VENV)/bin/ruff format --check python tests benches

rust-test:
	cargo test --release

py-test: install-test
	$(PY) -m pytest -q

test: lint rust-test py-test

bench-rust:
	cargo bench --bench tree -- --noplot

bench-python: install
	$(PY) benches/bench_python.py

bench: bench-rust bench-python

clean:
	rm -rf $(VENV) target
