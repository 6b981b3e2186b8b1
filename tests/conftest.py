"""The product's test fixtures (the shared setup, the interpreter and the workers' threads, is the
repository root's conftest.py).

- The two files of long compiles collected first (SLOW_FIRST), so that under pytest-xdist they
  overlap the many short tests.
- ``golden_mxfp4_path``: aiter's golden MXFP4 vectors in tests/data (see tests/data/README.md);
  a missing file FAILS the test rather than skipping it.
"""
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
GOLDEN_MXFP4 = REPO_ROOT / "tests" / "data" / "mxfp4_aiter.pt"


# Test files that compile for several targets in processes of their own, minutes on 2 cores: run
# first, so that under pytest-xdist they overlap the many short tests instead of ending the run.
SLOW_FIRST = ("test_kernel_report.py", "test_hopper_route.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in SLOW_FIRST)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def golden_mxfp4_path() -> Path:
    if not GOLDEN_MXFP4.exists():
        pytest.fail(f"golden MXFP4 vectors missing: {GOLDEN_MXFP4} (they are part of the repository: "
                    "tests/data/README.md)")
    return GOLDEN_MXFP4


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of many tiny CPU matmuls (the aiter double): threads gain nothing, and on a
    shared 2-core machine spinning OpenMP threads made single tests 50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def real_file_guard(repo_root, monkeypatch):
    """Fails a test that would replace the real submission.py (tune.py writes only through
    os.replace). Hashing the file instead would flag engineers editing it during a test run."""
    import tune

    real = (repo_root / "submission.py").resolve()
    replace = tune.os.replace

    def guarded(src, dst, *args, **kwargs):
        assert Path(dst).resolve() != real, "a test tried to rewrite the real submission.py"
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(tune.os, "replace", guarded)


@pytest.fixture
def sub_copy(tmp_path, repo_root, real_file_guard):
    """A copy of submission.py to rewrite (a write aimed at the real file fails the test)."""
    path = tmp_path / "submission.py"
    path.write_bytes((repo_root / "submission.py").read_bytes())
    return path
