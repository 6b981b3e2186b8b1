# make help lists the targets. In short:
#   make eval   : set up what is missing, then check (eval.py test) and time (eval.py benchmark) the
#                 submission on whatever device is here (the small CPU cases when there is no GPU).
#   make test   : set up what is missing, then lint, preflight and the test suite.
#
# Python: where python3 already has torch, Triton and the dev tools, it is used as it is; where it has
# torch and Triton only (a GPU machine with its own build), a .venv that sees the system's packages
# gets requirements-dev.txt; otherwise a .venv gets everything from requirements.txt. On a machine
# without a GPU, torch's CPU build is installed first (a local wheel pip already finds, else
# TORCH_INDEX, the CPU index), so that pip does not fetch the several-GB CUDA build.

SHELL := /bin/bash
HAVE_TORCH := $(shell python3 -c "import torch, triton" >/dev/null 2>&1 && echo yes)
HAVE_TOOLS := $(shell python3 -c "import pytest, xdist, matplotlib, tqdm, kernelguard, ruff" >/dev/null 2>&1 && echo yes)
HAVE_GPU := $(shell { test -e /dev/nvidia0 || test -e /dev/kfd || command -v nvidia-smi; } >/dev/null 2>&1 && echo yes)
TORCH_PIN := $(shell grep -E '^torch==' requirements.txt)

ifeq ($(HAVE_GPU),yes)
TORCH_INDEX ?=
else
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
endif

ifeq ($(HAVE_TORCH)$(HAVE_TOOLS),yesyes)
PY := python3
SETUP :=
else ifeq ($(HAVE_TORCH),yes)
PY := .venv/bin/python
SETUP := .venv/.installed-dev
else
PY := .venv/bin/python
SETUP := .venv/.installed
endif

EVAL_FLAGS ?= --strict
# make test runs the suite in this many pytest-xdist workers (auto: one per core, at most 8), a
# test file per worker so that a module's fixtures (the kernel report's compiles) run once
TEST_WORKERS ?= auto
TUNE_FLAGS ?=
TUNE_WRITE := $(if $(filter 1 yes true,$(WRITE)),--write,)

.PHONY: help setup eval test lab-test lint preflight tune clean-venv

help:
	@echo "make setup      create .venv and install what is missing (Python >= 3.10 with venv)"
	@echo "make eval       check (eval.py test) and time (eval.py benchmark) submission.py here;"
	@echo "                EVAL_FLAGS=... replaces the default --strict"
	@echo "make test       lint, preflight, then the test suite (GPU-only tests skip without a GPU);"
	@echo "                TEST_WORKERS=N sets its pytest-xdist workers (default auto, at most 8)"
	@echo "make lab-test   the lab's own tests (lab/tests: its probes, traces and sweeps; not part of make test)"
	@echo "make preflight  the leaderboard's upload gates and KernelGuard on submission.py"
	@echo "make lint       ruff over the repository"
	@echo "make tune       tune.py over specs/benchmarks.txt on this GPU (TUNE_FLAGS=...);"
	@echo "                WRITE=1 writes the tuned tables into submission.py, then preflights it"
	@echo "make clean-venv remove .venv"
	@echo "without a GPU, torch's CPU build comes from TORCH_INDEX ($(or $(TORCH_INDEX),not used here))"

setup: $(SETUP)

.venv/.installed: requirements.txt requirements-dev.txt
	test -x .venv/bin/python || python3 -m venv .venv
ifneq ($(TORCH_INDEX),)
	.venv/bin/pip install --no-deps --no-index "$(TORCH_PIN)" >/dev/null 2>&1 \
	  || .venv/bin/pip install --index-url $(TORCH_INDEX) "$(TORCH_PIN)"
endif
	.venv/bin/pip install -r requirements.txt
	touch $@

.venv/.installed-dev: requirements-dev.txt
	python3 -m venv --system-site-packages .venv
	.venv/bin/pip install -r requirements-dev.txt
	touch $@

eval: setup
	$(PY) eval.py test $(EVAL_FLAGS)
	$(PY) eval.py benchmark $(EVAL_FLAGS)

lint: setup
	$(PY) -m ruff check .

preflight: setup
	$(PY) tools/preflight.py submission.py

tune: setup
	$(PY) tune.py specs/benchmarks.txt $(TUNE_WRITE) $(TUNE_FLAGS)
	$(if $(TUNE_WRITE),$(PY) tools/preflight.py submission.py)

test: lint preflight
	$(PY) -m pytest -q -n $(TEST_WORKERS) --maxprocesses 8 --dist loadfile tests

lab-test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --maxprocesses 8 --dist loadfile lab/tests

clean-venv:
	rm -rf .venv
