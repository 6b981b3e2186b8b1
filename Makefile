# make eval      : set up what is missing, then check (eval.py test) and time (eval.py benchmark) the
#                  submission on whatever device is here (the CPU specs when there is no GPU).
# make test      : set up what is missing, then lint, preflight and the test suite.
# make preflight : the leaderboard's upload gates and KernelGuard on submission.py (PASS or FAIL).
# make lint      : ruff over the repository.
#
# Python: where python3 already has torch, Triton and the dev tools, it is used as it is; where it has
# torch and Triton only (a GPU machine with its own build), a .venv that sees the system's packages
# gets requirements-dev.txt; otherwise a .venv gets everything from requirements.txt.

SHELL := /bin/bash
HAVE_TORCH := $(shell python3 -c "import torch, triton" >/dev/null 2>&1 && echo yes)
HAVE_TOOLS := $(shell python3 -c "import pytest, matplotlib, tqdm, kernelguard, ruff" >/dev/null 2>&1 && echo yes)

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

.PHONY: setup eval test lint preflight clean-venv

setup: $(SETUP)

.venv/.installed: requirements.txt requirements-dev.txt
	python3 -m venv .venv
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

test: lint preflight
	$(PY) -m pytest -q tests

clean-venv:
	rm -rf .venv
