# make eval : set up what is missing, then check (eval.py test) and time (eval.py benchmark) the
#             submission on whatever device is here (the CPU specs when there is no GPU).
# make test : set up what is missing, then run the test suite.
#
# Python: where `python3 -c "import torch, triton"` already works (e.g. a GPU machine with its own
# torch), python3 is used as it is; otherwise a .venv is created from requirements.txt.

SHELL := /bin/bash
SYSTEM_PY_OK := $(shell python3 -c "import torch, triton" >/dev/null 2>&1 && echo yes)

ifeq ($(SYSTEM_PY_OK),yes)
PY := python3
SETUP :=
else
PY := .venv/bin/python
SETUP := .venv/.installed
endif

EVAL_FLAGS ?= --strict

.PHONY: setup eval test clean-venv

setup: $(SETUP)

.venv/.installed: requirements.txt
	python3 -m venv .venv
	.venv/bin/pip install -r requirements.txt
	touch $@

eval: setup
	$(PY) eval.py test $(EVAL_FLAGS)
	$(PY) eval.py benchmark $(EVAL_FLAGS)

test: setup
	$(PY) -m pytest -q tests

clean-venv:
	rm -rf .venv
