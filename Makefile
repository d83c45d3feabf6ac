# Set-up and the two everyday commands. `make quickstart` and `make test` create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
# The torch build to install; the version CI tests. GPU users: `make TORCH="torch --index-url <your CUDA wheels>"`.
TORCH ?= torch==2.13.0
NPROC ?= 4
# Offline installs (docs/gpu.md): megand's dependencies other than torch, as wheels for this Python and platform.
WHEELHOUSE ?= wheelhouse
WHEEL_PYTHON ?= 3.12
WHEEL_ARCH ?= x86_64
# binary wheels that run on glibc 2.28 or newer (manylinux_2_28 down to manylinux2014, i.e. glibc 2.17)
WHEEL_PLATFORMS = $(foreach v,28 27 26 25 24 23 22 21 20 19 18 17,--platform manylinux_2_$(v)_$(WHEEL_ARCH)) \
    --platform manylinux2014_$(WHEEL_ARCH)
# empty: every dependency in pyproject.toml (with the dev extra) but torch; else only these (and what they need)
WHEEL_PACKAGES ?=
# The environment that uses a Python's own torch (a GPU machine's CUDA build): nothing installs torch there.
GPU_VENV ?= .venv-gpu

.PHONY: install quickstart test test-all gpu-check gpu-install gpu-first wheelhouse

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q $(TORCH)
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $@

# A small tp=2 x dp=2 pretraining on real text, on CPU when there is no GPU.
quickstart: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node=$(NPROC) pretrain_gpt.py +experiment=quickstart \
		run_dir=runs/quickstart-$$(date +%Y%m%d-%H%M%S)  # a new run directory per launch: runs never share logs

# The default suite (every parallel dimension covered; slow matrices excluded).
test: install
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q

# Everything, including the slow multi-process matrices.
test-all: install
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q -m ""

# On a connected machine: wheels of megand's dependencies but torch, for Python $(WHEEL_PYTHON) on Linux $(WHEEL_ARCH),
# into $(WHEELHOUSE)/. antlr4-python3-runtime 4.9 (omegaconf's pin) is published as a source archive only: built here
# into a pure-Python wheel. Every other package must have a binary wheel for that Python and glibc 2.28.
wheelhouse:
	$(PYTHON) -m pip wheel -q --no-deps -w $(WHEELHOUSE) 'antlr4-python3-runtime==4.9.*'
	$(PYTHON) -m pip download -q -d $(WHEELHOUSE) --find-links $(WHEELHOUSE) --only-binary=:all: \
	    --python-version $(WHEEL_PYTHON) --implementation cp $(WHEEL_PLATFORMS) \
	    'setuptools>=68' $(or $(WHEEL_PACKAGES),$(shell $(PYTHON) -c "import sys; toml = __import__('tomllib') if sys.version_info >= (3, 11) else __import__('pip._vendor.tomli', fromlist=['loads']); p = toml.loads(open('pyproject.toml').read())['project']; print(' '.join(repr(d) for d in p['dependencies'] + p['optional-dependencies']['dev'] if not d.startswith('torch')))"))
	@du -sh $(WHEELHOUSE)

# A virtual environment over $(PYTHON), which already has torch: it sees every package $(PYTHON) sees (a .pth file
# naming $(PYTHON)'s site directories, also when $(PYTHON) is itself a venv) and gets megand and what $(PYTHON) lacks,
# from $(WHEELHOUSE)/ with no network when that folder holds wheels, else from the package index.
gpu-install: $(GPU_VENV)/.installed

$(GPU_VENV)/.installed: pyproject.toml
	@$(PYTHON) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" || \
	    { echo "gpu-install: $(PYTHON) has no torch (install its CUDA build first, or use make install)"; exit 2; }
	$(PYTHON) -m venv --system-site-packages $(GPU_VENV)
	$(PYTHON) -c "import os, sys; print('\n'.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages')) and os.path.isdir(p)))" \
	    > "$$($(GPU_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/megand_base_python.pth"
	$(GPU_VENV)/bin/python -m pip install -q $(if $(wildcard $(WHEELHOUSE)/*.whl),--no-index --find-links $(WHEELHOUSE)) -e '.[dev]'
	$(GPU_VENV)/bin/python -c "import torch, megand; print('gpu-install: torch', torch.__version__, 'from', torch.__file__)"
	touch $@

# The Python the GPU targets run: $(GPU_VENV) when $(PYTHON) has its own torch (nothing installs torch there), else
# $(VENV) with $(TORCH).
RUN_PYTHON = if $(PYTHON) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; \
	then $(MAKE) -s gpu-install || exit $$?; py=$(GPU_VENV)/bin/python; else $(MAKE) -s install || exit $$?; py=$(VENV)/bin/python; fi

# On a CUDA machine (one GPU is enough; about 5 minutes on one H200, compilations included): a CUDA-relevant test
# subset, bf16 throughput of llama_1b (seq 4096) and gpt2_125m next to transformers, FP8 against bf16, the CUDA-only
# kernels (flash blocks, grouped GEMM, FlexAttention document masks, the SDPA kernel that runs, fused AdamW,
# weight-gradient fusion), memory statistics, async checkpointing, torch.compile (graph breaks, recompilations), and
# NCCL parity on 2+ GPUs. `--list` names every check and what it needs. Writes gpu_check.json and prints a table.
gpu-check:
	@$(RUN_PYTHON); OMP_NUM_THREADS=8 $$py tools/gpu_check.py --out gpu_check.json

# The first command on a lent GPU (docs/gpu.md): the figures to record, about 10 minutes on one H200, offline.
gpu-first:
	@$(RUN_PYTHON); OMP_NUM_THREADS=8 $$py tools/gpu_check.py --preset first --out gpu_first.json \
	    $(if $(wildcard gpu_first_rehearsal.json),--rehearsal gpu_first_rehearsal.json)
