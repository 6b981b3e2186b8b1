"""tools/ab_probe.py's argument helpers: the shape subset and one column per module given (a file
given twice is timed twice, so that B can be bracketed between two copies of A)."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ab_probe", ROOT / "tools" / "ab_probe.py")
ab_probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab_probe)


def test_shapes_subset():
    assert ab_probe.parse_shapes("64x1024, 4x8192") == [(64, 1024), (4, 8192)]
    with pytest.raises(SystemExit, match="'64-1024' is not BATCHxKV"):
        ab_probe.parse_shapes("64-1024")


def test_a_module_given_twice_gets_two_columns():
    assert ab_probe.column_names(["v/a.py", "w/b.py", "v/a.py"]) == ["a.py", "b.py", "a.py#3"]
    assert ab_probe.column_names(["a.py", "b.py"]) == ["a.py", "b.py"]
