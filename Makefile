# Set-up and the two everyday commands. `make quickstart` and `make test` create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
# The torch build to install; the version CI tests. GPU users: `make TORCH="torch --index-url <your CUDA wheels>"`.
TORCH ?= torch==2.13.0
NPROC ?= 4

.PHONY: install quickstart test test-all gpu-check

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q $(TORCH)
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $@

# A small tp=2 x dp=2 pretraining on real text, on CPU when there is no GPU.
quickstart: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node=$(NPROC) pretrain_gpt.py +experiment=quickstart

# The default suite (every parallel dimension covered; slow matrices excluded).
test: install
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q

# Everything, including the slow multi-process matrices.
test-all: install
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q -m ""

# On a CUDA machine (one GPU is enough; estimated under 8 minutes): unit tests, bf16 throughput of llama_1b
# (seq 4096) and gpt2_125m next to transformers, FP8 against bf16, the CUDA-only kernels (flash blocks, grouped
# GEMM, FlexAttention document masks, SDPA backend, fused AdamW, weight-gradient fusion), memory statistics,
# async checkpointing, torch.compile with its graph breaks, and NCCL parity on 2+ GPUs. `--list` names every
# check and what it needs. Writes gpu_check.json and prints a table.
gpu-check: install
	OMP_NUM_THREADS=8 $(VENV)/bin/python tools/gpu_check.py --out gpu_check.json
