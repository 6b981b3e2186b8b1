"""Shared test setup for tests/ (the product's) and lab/tests/ (the lab's), before any test module
imports the project.

- Without a GPU, Triton kernels must run in the interpreter: TRITON_INTERPRET=1 has to be set
  before any module that defines @triton.jit kernels is imported, so it is set here, first.
- interpreter_fixes.apply(): the interpreter's bf16 dot and float down-casts are made to match the
  GPU, or kernel tests would measure the interpreter's bugs.
- Under pytest-xdist (make test runs a worker per core): torch's threads shared among the workers.
The repository root, tests/cpu and tests/doubles are on sys.path through pytest.ini (`pythonpath`).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Under pytest-xdist (make test) each worker gets its share of the cores for torch's threads, and
# so do the processes it starts: on a 2-core machine two workers of 2 spinning OpenMP threads each
# cost more CPU time than they save.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    THREADS = max(1, CORES // WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
    torch.set_num_threads(THREADS)

import interpreter_fixes  # noqa: E402  (after TRITON_INTERPRET: see its docstring)

interpreter_fixes.apply()
