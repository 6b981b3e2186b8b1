"""Load submission.py as a fresh module against the aiter test double, or with aiter absent.

Each load is a new module object (its own caches, its own HAVE_AITER) and, with a double, a fresh
import of the double (its own call counters, its own ops). Afterwards sys.modules, sys.path, the
double's environment variables and torch.ops.aiter's public names are as before, so other tests
see no aiter.
"""
import contextlib
import importlib.util
import io
import itertools
import os
import sys
from pathlib import Path

import torch

DOUBLE_DIR = Path(__file__).resolve().parent
REPO_ROOT = DOUBLE_DIR.parents[2]
ENV_KEYS = ("AITER_DOUBLE_GENERATION", "AITER_DOUBLE_PAGE_MODE")
_serial = itertools.count()


class Loaded:
    """module: the fresh submission module; aiter: the double it imported (None without);
    stderr: what the import printed on stderr."""

    def __init__(self, module, aiter, stderr):
        self.module, self.aiter, self.stderr = module, aiter, stderr


def _is_aiter(name):
    return name == "aiter" or name.startswith("aiter.")


def _withdraw_public_ops(double):
    """torch.ops.aiter.<name> pointed at the double's private ops only while it was imported."""
    namespace = vars(torch.ops.aiter)
    for name in getattr(double, "PUBLIC_OPS", ()):
        namespace.pop(name, None)


@contextlib.contextmanager
def aiter_environment(generation, page_mode=None):
    """generation None: `import aiter` fails (ImportError) whatever is installed; otherwise the
    double of that generation (a name or alias from aiter/_api.py) is the aiter found first.
    page_mode: the double's AITER_DOUBLE_PAGE_MODE ("exact" when None)."""
    saved_modules = {name: mod for name, mod in sys.modules.items() if _is_aiter(name)}
    saved_path = list(sys.path)
    saved_env = {key: os.environ.get(key) for key in ENV_KEYS}
    for name in saved_modules:
        del sys.modules[name]
    for key in ENV_KEYS:
        os.environ.pop(key, None)
    try:
        if generation is None:
            sys.modules["aiter"] = None
        else:
            sys.path.insert(0, str(DOUBLE_DIR))
            os.environ["AITER_DOUBLE_GENERATION"] = generation
            if page_mode is not None:
                os.environ["AITER_DOUBLE_PAGE_MODE"] = page_mode
        if str(REPO_ROOT) not in sys.path:
            sys.path.insert(0, str(REPO_ROOT))
        yield
    finally:
        _withdraw_public_ops(sys.modules.get("aiter"))
        for name in [name for name in sys.modules if _is_aiter(name)]:
            del sys.modules[name]
        sys.modules.update(saved_modules)
        sys.path[:] = saved_path
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def load_submission(generation=None, page_mode=None):
    """SUBMISSION_UNDER_TEST (environment, optional) names another file to load instead of the
    repository's submission.py: how a deliberately broken copy is shown to fail these tests."""
    name = f"submission_under_test_{next(_serial)}"
    path = os.environ.get("SUBMISSION_UNDER_TEST") or REPO_ROOT / "submission.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    stderr = io.StringIO()
    with aiter_environment(generation, page_mode), contextlib.redirect_stderr(stderr):
        spec.loader.exec_module(module)
        double = sys.modules.get("aiter")
    return Loaded(module, double, stderr.getvalue())
