"""Shared test setup: runs before any test module imports the project.

- Without a GPU, Triton kernels must run in the interpreter: TRITON_INTERPRET=1 has to be set
  before any module that defines @triton.jit kernels is imported, so it is set here, first.
- The repository root goes on sys.path (task.py, reference.py, utils.py, eval.py, submission.py).
- interpreter_fixes.apply(): the interpreter's bf16 dot and float down-casts are made to match the
  GPU, or kernel tests would measure the interpreter's bugs.
- ``golden_mxfp4_path``: the golden MXFP4 vectors in ../shared (a missing file FAILS the test:
  CI always has ../shared beside the clone).
"""
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import interpreter_fixes  # noqa: E402  (after TRITON_INTERPRET and sys.path: see its docstring)

interpreter_fixes.apply()

GOLDEN_MXFP4 = REPO_ROOT.parent / "shared" / "golden" / "mxfp4_aiter.pt"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def golden_mxfp4_path() -> Path:
    if not GOLDEN_MXFP4.exists():
        pytest.fail(f"golden MXFP4 vectors missing: {GOLDEN_MXFP4} (expected ../shared beside the "
                    "repository, as CI lays it out)")
    return GOLDEN_MXFP4


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of many tiny CPU matmuls (the aiter double): threads gain nothing, and on a
    shared 2-core machine spinning OpenMP threads made single tests 50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
