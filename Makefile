# Quickstart targets. Without an active virtual environment, a local .venv is created.
# torch==2.13.0 is installed first (CPU build) so nothing pulls a CUDA build.
ifdef VIRTUAL_ENV
PY := python
else
PY := .venv/bin/python
endif

.PHONY: setup demo test test-cluster clean

setup: .setup-stamp

.setup-stamp: pyproject.toml
	@if [ -z "$$VIRTUAL_ENV" ] && [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@touch .setup-stamp

demo: setup
	$(PY) pretrain_gpt_moe.py --config configs/gpt_moe_tiny.yaml training.run_dir=runs/demo

# everything but the full multi-node set (its two smoke tests run here too)
test: setup
	$(PY) -m pytest -q -m "not cluster" tests

# the multi-node tests alone, on a two-node SLURM cluster in network namespaces (root; docs/running.md)
test-cluster: setup
	$(PY) -m pytest -q tests/e2e/test_two_node.py

clean:
	rm -rf .setup-stamp runs .pytest_cache
