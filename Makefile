# Quickstart targets. Without an active virtual environment, a local .venv is created and used;
# `make test PY=python` (any interpreter) uses that one and creates no .venv (the launch scripts
# would pick an empty one: scripts/python_env.sh).
# torch==2.13.0 is installed first (CPU build) so nothing pulls a CUDA build.
# `make demo ARGS="moe.top_k=1 training.train_iters=20"` passes config overrides to the demo run; it saves
# a checkpoint after its last iteration in runs/demo/checkpoints (tools/generate.py, docs/evaluation.md).
VENV_PY := .venv/bin/python
ifdef VIRTUAL_ENV
PY := python
else
PY := $(VENV_PY)
endif

.PHONY: setup demo test test-gpu test-cluster clean

setup: .setup-stamp

$(VENV_PY):
	python3 -m venv .venv

# the .venv (order-only: made if missing) only when PY is its python
.setup-stamp: pyproject.toml | $(filter $(VENV_PY),$(PY))
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@touch .setup-stamp

demo: setup
	$(PY) pretrain_gpt_moe.py --config configs/gpt_moe_tiny.yaml training.run_dir=runs/demo checkpoint.save_interval=100 $(ARGS)

# the CPU suite (gloo processes), on the CPU even on a GPU node; the gpu-marked tests are left to
# test-gpu, the full multi-node set to test-cluster (its two smoke tests run here too).
# TEST_WORKERS pytest-xdist workers, one test file each at a time (module fixtures spawn once):
# tests wait on process start-up, ranks, SLURM and timeouts: on 2 cores, 3 workers ran the suite
# in 20:49 against 22:29 for 2 (the same checkout, one after the other); 13:42 once e2e ranks forked
TEST_WORKERS ?= 3
test: setup
	CUDA_VISIBLE_DEVICES= $(PY) -m pytest -q -m "not gpu and not cluster" -n $(TEST_WORKERS) --dist loadfile tests

# on a GPU node (a CUDA build of torch), `pytest -m gpu`: the CPU suite's exactness checks on NCCL, one
# process per GPU (every schedule and balancer, node_dedup, vExperts with edp 2, pipeline and ZeRO-1,
# checkpoints, bf16 layouts against one GPU, layout invariance through pretrain_gpt_moe.py; MLA, the
# DeepSeek-V3 / gpt-oss / GLM-4.5 families and KV-cache generation against one GPU), NCCL's rules
# (group devices, moves on a subset of ranks), the host syncs under CUDA's sync debug mode, the
# CUDA-only attention paths against the CPU (fused SDPA with windows / padding / MLA, sinks, generation),
# a benchmarks/moe_layer.py run on 2 GPUs and a train_throughput.py bf16 smoke run printing tokens/s
# and MFU (README, "On a GPU node"); skipped, with the reason, without enough GPUs
test-gpu: setup
	$(PY) -m pytest -q -m gpu -rs tests

# the multi-node tests alone, on a two-node SLURM cluster in network namespaces (root; docs/running.md)
test-cluster: setup
	$(PY) -m pytest -q tests/e2e/test_two_node.py

clean:
	rm -rf .setup-stamp runs .pytest_cache
