# Slipway: two set-up commands on a fresh machine — `make demo` and `make test` (both install first).
SHELL := /bin/bash

# Where make installs. A stock Debian 12 refuses `pip install` into its system Python (PEP 668: the
# interpreter is EXTERNALLY-MANAGED), so by default make creates a project virtual environment, $(VENV),
# from $(BASE_PYTHON) and installs there. --system-site-packages (VENV_FLAGS) lets it reuse what that
# interpreter already has (a cluster's or a container's torch, CI's preinstalled packages) instead of
# downloading it again. VENV= (empty) installs into the current environment, as before this option existed
# (a conda env, a container); so does PYTHON=<interpreter> given on the command line.
VENV ?= .venv
BASE_PYTHON ?= python3
VENV_FLAGS ?= --system-site-packages
ifeq ($(origin PYTHON),command line)
  USE_VENV :=
else ifneq ($(strip $(VENV)),)
  USE_VENV := 1
  PYTHON := $(VENV)/bin/python
endif
PYTHON ?= python3
# The install stamp names the environment it installed (a venv's folder; else the interpreter's prefix and
# path), so installing into a second environment is not skipped because the first one was installed.
ifdef USE_VENV
  ENV_ID := $(abspath $(VENV))
  VENV_CFG := $(VENV)/pyvenv.cfg
else
  ENV_ID := $(shell $(PYTHON) -c 'import sys; print(sys.prefix, sys.executable)' 2>/dev/null || echo '$(PYTHON)')
  VENV_CFG :=
endif
STAMP := .make/install-$(shell printf '%s' '$(ENV_ID)' | sha256sum | cut -c1-16).stamp
# The local CPU build; a bare "torch" could pull a multi-GB CUDA wheel. Clusters bring their own torch.
TORCH_SPEC ?= torch==2.13.0
CSRC := $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.cpp csrc/cuda/*.h csrc/cuda/*.cuh)
DEVCLUSTER := slurm/devcluster
PYTEST_ARGS ?=

.PHONY: install mcore demo test test-fast test-stress lint bench cuda-check dev-image devcluster-up devcluster-down \
  devcluster-status clean show-env

install: $(STAMP)

# Where make installs (the environment, its interpreter, the stamp); changes nothing.
show-env:
	@echo "PYTHON=$(PYTHON)"; echo "VENV=$(if $(USE_VENV),$(VENV),)"; echo "STAMP=$(STAMP)"

# The project environment. Without Debian's python3-venv, venv cannot bootstrap pip (no ensurepip); a venv
# without its own pip then uses the system's (python3-pip) through --system-site-packages.
$(VENV)/pyvenv.cfg:
	@command -v $(BASE_PYTHON) >/dev/null || { echo "make: $(BASE_PYTHON) not found: install Python >= 3.10 \
	  (Debian: apt-get install python3 python3-venv) or name one with BASE_PYTHON=" >&2; exit 1; }
	$(BASE_PYTHON) -m venv $(VENV_FLAGS) $(VENV) 2>/dev/null || { rm -rf $(VENV); \
	  $(BASE_PYTHON) -m venv $(VENV_FLAGS) --without-pip $(VENV); }
	@$(VENV)/bin/python -m pip --version >/dev/null 2>&1 || { rm -rf $(VENV); echo "make: a virtual \
	  environment from $(BASE_PYTHON) has no pip: apt-get install python3-venv (or python3-pip), or install \
	  into the current environment with VENV=" >&2; exit 1; }

# Idempotent: re-runs only when setup.py or the C++/CUDA sources change, or for another environment. A
# cluster's container or conda env already has the right torch (see README): --system-site-packages keeps
# it, and VENV= installs into that environment itself.
$(STAMP): setup.py $(CSRC) $(VENV_CFG)
	@mkdir -p .make
	@$(PYTHON) -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(\
	  sysconfig.get_paths()['include'], 'Python.h')))" || { echo "make: Python's headers (Python.h) are \
	  missing, the C++ extension cannot build: apt-get install python3-dev" >&2; exit 1; }
	@command -v $(CXX) >/dev/null || { echo "make: no C++ compiler ($(CXX)): apt-get install g++" >&2; exit 1; }
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -q setuptools wheel
	$(PYTHON) -m pip install -q --no-build-isolation -e '.[dev]'
	@$(PYTHON) -c "import torch, trainer._C" && echo "slipway installed; C++ extension trainer._C built"
	@touch $(STAMP)

# Real megatron-core releases side by side, the oracle of tests/mcore (versions: tests/mcore/versions.py),
# each in .make/mcore/<version> with --no-deps (they need only torch, numpy, packaging); an installed
# version is not downloaded again. From 0.17 the wheels need Python 3.12: under an older $(PYTHON) they
# run in .make/mcore/python3.12, a virtual environment of pyenv's (or the PATH's) python3.12 with this
# project's torch release (PyTorch's CPU index when reachable, else PyPI's CUDA build, ~2.6 GB, once).
mcore: install
	$(PYTHON) -m tests.mcore.install

demo: install
	$(PYTHON) launch.py +experiment=codeparrot_smoke

# CUDA sources compile to objects with nvcc even on machines without a GPU (with the flags torch's
# CUDAExtension adds), so a CUDA syntax or type error fails `make test` everywhere nvcc exists. The
# torch-side bindings (csrc/cuda/*.cpp) are then type-checked with g++ -fsyntax-only: a CPU build of torch
# lacks c10/cuda/impl/cuda_cmake_macros.h, so an empty stand-in is searched last (-idirafter); a CUDA
# torch's own header wins where it exists.
cuda-check: install
	@if command -v nvcc >/dev/null 2>&1 && ls csrc/cuda/*.cu >/dev/null 2>&1; then \
	  mkdir -p .make/cuda/stub/c10/cuda/impl && for f in csrc/cuda/*.cu; do \
	    nvcc -std=c++17 -O2 --use_fast_math -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
	      -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr -Icsrc \
	      -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
	      -c $$f -o .make/cuda/$$(basename $$f .cu).o || exit 1; \
	  done && echo "cuda-check: compiled $$(ls csrc/cuda/*.cu | wc -l) CUDA sources for sm_80 and sm_90"; \
	  touch .make/cuda/stub/c10/cuda/impl/cuda_cmake_macros.h; \
	  inc=$$($(PYTHON) -c "from torch.utils.cpp_extension import include_paths as p; print(' '.join('-I' + d for d in p()))"); \
	  for f in csrc/cuda/*.cpp; do \
	    $(CXX) -std=c++17 -fsyntax-only -w -DSLIPWAY_WITH_CUDA=1 $$inc -I$${CUDA_HOME:-/usr/local/cuda}/include \
	      -idirafter .make/cuda/stub -Icsrc $$f || exit 1; \
	  done && echo "cuda-check: type-checked $$(ls csrc/cuda/*.cpp | wc -l) torch binding(s) against CUDA headers"; \
	else echo "cuda-check: nvcc or CUDA sources absent, skipped"; fi

# The CPU image the container tests run in (container=charliecloud): Debian's Python, the CPU torch and
# Slipway's kernels built inside it (containers/dev_image.py). Cached in .make/images by its inputs: only
# the first run after a change of them builds (a few minutes; csrc/ changes rebuild the kernel layer only).
dev-image: install
	TORCH_SPEC="$(TORCH_SPEC)" $(PYTHON) containers/dev_image.py build

devcluster-up:
	$(DEVCLUSTER) up

devcluster-down:
	-$(DEVCLUSTER) down

devcluster-status:
	$(DEVCLUSTER) status

# Brings the devcluster up around the suite and always down after it, keeping pytest's exit status.
# A cluster that fails to come up fails the target at once (its error and log tail are on stderr). `up`
# makes every node a host of its own (network, UTS and mount namespaces, slurm/README.md), as the Slurm
# tests need (CI runs as root); where namespaces are not to be had it refuses in one line (no --single-host).
test: install mcore lint cuda-check dev-image
	@set -o pipefail; $(DEVCLUSTER) up | tail -n 5 || { $(DEVCLUSTER) down >/dev/null 2>&1; \
	  echo "make test: slurm/devcluster up failed (see above)" >&2; exit 1; }; \
	eval "$$($(DEVCLUSTER) env)"; \
	$(PYTHON) -m pytest $(PYTEST_ARGS); rc=$$?; \
	$(DEVCLUSTER) down >/dev/null 2>&1; exit $$rc

# The timing-sensitive tests (tests/stress.py's list) STRESS_REPS times under two CPU hogs, the devcluster up
# for the Slurm ones, STRESS_STREAMS pytest runs at a time (more load); the report goes to
# bench/results/stress.txt. Not part of `make test` (~1 h).
STRESS_REPS ?= 20
STRESS_STREAMS ?= 2
test-stress: install
	@set -o pipefail; $(DEVCLUSTER) up | tail -n 5 || { $(DEVCLUSTER) down >/dev/null 2>&1; exit 1; }; \
	eval "$$($(DEVCLUSTER) env)"; \
	$(PYTHON) -m tests.stress --reps $(STRESS_REPS) --streams $(STRESS_STREAMS) --hogs 2 \
	  --out bench/results/stress.txt; rc=$$?; \
	$(DEVCLUSTER) down >/dev/null 2>&1; exit $$rc

test-fast: install mcore
	$(PYTHON) -m pytest -m "not slurm and not slow" $(PYTEST_ARGS)

lint: install
	$(PYTHON) -m ruff check .

bench: install
	$(PYTHON) bench/run_all.py

# Keeps the project environment ($(VENV)): `rm -rf .venv` removes it.
clean:
	rm -rf .make build trainer/_C*.so *.egg-info
