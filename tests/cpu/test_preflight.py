"""tools/preflight.py: the real submission passes every gate; each gate fails a file made to break it.

Every bad file is a small honest submission (GOOD) with one thing broken, written to tmp_path, so
each test can demand exactly the findings (rule, line) that one break causes. CPU only.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools import preflight

REPO_ROOT = Path(__file__).resolve().parents[2]

# Passes every gate, KernelGuard's under both profiles included (test_good_file_passes).
GOOD = '''#!POPCORN leaderboard amd-mixed-mla
#!POPCORN gpu MI355X
"""A small, honest MLA decode: softmax(q k^T) v over the whole cache."""
import torch


def custom_kernel(data):
    q, kv_data, qo_indptr, kv_indptr, config = data
    kv = kv_data["bf16"]
    scores = torch.einsum("bhd,td->bht", q.float(), kv[:, 0, :].float())
    weights = torch.softmax(scores * config["sm_scale"], dim=-1)
    return torch.einsum("bht,td->bhd", weights, kv[:, 0, :512].float()).to(q.dtype)
'''
GOOD_LINES = GOOD.splitlines(keepends=True)
BODY_LINE = 8  # the first line of custom_kernel's body ("q, kv_data, ... = data")

# Caches its output by id(data) and replays it: KernelGuard filters it under both profiles.
REPLAY = '''#!POPCORN leaderboard amd-mixed-mla
#!POPCORN gpu MI355X
import torch

_cache = {}


def custom_kernel(data):
    key = id(data)
    if key in _cache:
        return _cache[key]
    q = data[0]
    out = torch.zeros_like(q)
    _cache[key] = out
    return out
'''

# Replaces the harness's timing event: KernelGuard filters it under both profiles.
TIMER_PATCH = '''#!POPCORN leaderboard amd-mixed-mla
#!POPCORN gpu MI355X
import torch


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self):
        pass

    def elapsed_time(self, other):
        return 0.001


torch.cuda.Event = _Event


def custom_kernel(data):
    return data[0] * 2
'''

# Replays a captured CUDA graph keyed by data_ptr(): not filtered, but not "valid" either, and
# classified differently by the two profiles (low_confidence by default, suspicious when strict).
GRAPH_REPLAY = '''#!POPCORN leaderboard amd-mixed-mla
#!POPCORN gpu MI355X
import torch

_graphs = {}


def custom_kernel(data):
    q = data[0]
    key = (q.shape, q.data_ptr())
    if key not in _graphs:
        out = torch.empty_like(q)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out.copy_(q * 2)
        _graphs[key] = (g, out)
    g, out = _graphs[key]
    g.replay()
    return out
'''


def with_line(text, line, new):
    """GOOD-like text with ``new`` (one or more lines) inserted before 1-based ``line``."""
    lines = text.splitlines(keepends=True)
    return "".join(lines[: line - 1] + [new] + lines[line - 1:])


def check(tmp_path, content, name="submission.py"):
    """preflight's findings for ``content`` (str or bytes) saved as tmp_path/name."""
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return preflight.check_file(path)


def rules(findings):
    """The (rule, line) pairs of the findings, in order."""
    return [(f.rule, f.line) for f in findings]


# --- what passes ---------------------------------------------------------------------------------

def test_real_submission_passes_every_gate(capsys):
    assert preflight.main([]) == 0  # no argument: submission.py at the repository root
    assert capsys.readouterr().out.splitlines() == ["PASS"]


def test_good_file_passes(tmp_path):
    assert check(tmp_path, GOOD) == []


# --- the word ------------------------------------------------------------------------------------

def test_word_in_a_comment_in_any_case(tmp_path):
    text = with_line(GOOD, BODY_LINE, "    # runs on the default Stream, nothing else\n")
    text = with_line(text, 4, "# STREAM\n")
    found = check(tmp_path, text)
    assert rules(found) == [("stream-word", 4), ("stream-word", BODY_LINE + 1)]
    assert "# STREAM" in found[0].message
    assert "default Stream" in found[1].message


def test_word_inside_an_identifier_and_a_string(tmp_path):
    text = with_line(GOOD, BODY_LINE, "    upstream_rows = 'no side work'\n    label = 'xStReAmx'\n")
    assert rules(check(tmp_path, text)) == [("stream-word", BODY_LINE),
                                            ("stream-word", BODY_LINE + 1)]


def test_word_in_the_docstring(tmp_path):
    text = GOOD.replace("over the whole cache.", "over the whole cache, one streaming pass.")
    assert rules(check(tmp_path, text)) == [("stream-word", 3)]


# --- size, emptiness, name, encoding -------------------------------------------------------------

def test_over_the_size_limit(tmp_path):
    padding = "".join(f"# padding {i:07d} " + "x" * 80 + "\n" for i in range(11_000))
    text = GOOD + padding
    assert len(text.encode()) > preflight.MAX_BYTES
    found = check(tmp_path, text)
    assert rules(found) == [("size", None)]
    assert f"{len(text.encode()):,} bytes" in found[0].message


def test_at_the_size_limit_is_fine():
    def size_findings(n_bytes):
        return rules(preflight.check_size(preflight.Submission("submission.py", b"#" * n_bytes)))

    assert size_findings(preflight.MAX_BYTES) == []
    assert size_findings(preflight.MAX_BYTES + 1) == [("size", None)]


def test_empty_file(tmp_path):
    assert rules(check(tmp_path, b"")) == [("empty", None)]


@pytest.mark.parametrize("name", ["submission.txt", "submission", "submission.py.bak"])
def test_bad_file_name(tmp_path, name):
    found = check(tmp_path, GOOD, name=name)
    assert rules(found) == [("file-name", None)]
    assert name in found[0].message


@pytest.mark.parametrize("name", ["kernel.cu", "kernel.cuh", "kernel.cpp"])
def test_other_allowed_suffixes_pass_the_name_gate(name):
    assert preflight.check_file_name(preflight.Submission(name=name, data=b"x")) == []


def test_invalid_utf8(tmp_path):
    data = with_line(GOOD, 5, "# caf\x00\n").encode().replace(b"\x00", b"\xe9")  # latin-1 e-acute
    found = check(tmp_path, data)
    assert rules(found) == [("utf-8", 5)]
    assert f"byte offset {data.index(bytes([0xE9]))}" in found[0].message


def test_byte_order_mark(tmp_path):
    found = check(tmp_path, b"\xef\xbb\xbf" + GOOD.encode())
    assert ("utf-8", 1) == rules(found)[0]
    assert "byte-order mark" in found[0].message


# --- the POPCORN directives ----------------------------------------------------------------------

def test_missing_leaderboard_directive(tmp_path):
    found = check(tmp_path, GOOD.replace("#!POPCORN leaderboard amd-mixed-mla\n", ""))
    assert rules(found) == [("popcorn", 1)]
    assert "#!POPCORN leaderboard amd-mixed-mla" in found[0].message


def test_wrong_leaderboard_name(tmp_path):
    found = check(tmp_path, GOOD.replace("amd-mixed-mla", "amd-mla-decode"))
    assert rules(found) == [("popcorn", 1)]
    assert "'amd-mla-decode'" in found[0].message


def test_wrong_gpu(tmp_path):
    found = check(tmp_path, GOOD.replace("gpu MI355X", "gpu MI300X"))
    assert rules(found) == [("popcorn", 2)]
    assert "'MI300X'" in found[0].message


def test_directives_after_the_first_comment_block_are_ignored(tmp_path):
    # the service reads directives only until the first line not starting with '#' or '//'
    text = "import torch\n" + GOOD.replace("import torch\n", "")
    found = check(tmp_path, text)
    assert rules(found) == [("popcorn", 1), ("popcorn", 1)]
    assert "leaderboard" in found[0].message and "gpu" in found[1].message


def test_duplicate_and_unknown_directives(tmp_path):
    text = with_line(GOOD, 3, "#!POPCORN leaderboard amd-mixed-mla\n#!POPCORN mode test\n")
    assert rules(check(tmp_path, text)) == [("popcorn", 3), ("popcorn", 4)]


# --- Python 3.10's grammar -----------------------------------------------------------------------

@pytest.mark.parametrize("statement, bad_line", [
    ("type Rows = int\n", 6),                                        # PEP 695 alias (3.12)
    ("def first[T](items: list[T]) -> T:\n    return items[0]\n", 6),  # PEP 695 generic (3.12)
    ("try:\n    pass\nexcept* ValueError:\n    pass\n", 8),          # exception groups (3.11)
])
def test_syntax_newer_than_310(tmp_path, statement, bad_line):
    found = check(tmp_path, with_line(GOOD, 6, statement))
    assert rules(found) == [("syntax", bad_line)]
    assert "not valid Python 3.10" in found[0].message


def test_syntax_error_line(tmp_path):
    found = check(tmp_path, with_line(GOOD, BODY_LINE, "    x = (1,\n"))
    assert rules(found)[0][0] == "syntax"
    assert rules(found)[0][1] in (BODY_LINE, BODY_LINE + 1)


# --- the entry point -----------------------------------------------------------------------------

def test_no_custom_kernel(tmp_path):
    found = check(tmp_path, GOOD.replace("def custom_kernel(", "def kernel("))
    assert rules(found) == [("custom-kernel", None)]


def test_custom_kernel_only_as_a_method_is_not_top_level(tmp_path):
    text = GOOD.replace("def custom_kernel(data):", "class Holder:\n  def custom_kernel(data):")
    assert rules(check(tmp_path, text)) == [("custom-kernel", None)]


def test_async_custom_kernel(tmp_path):
    found = check(tmp_path, GOOD.replace("def custom_kernel(", "async def custom_kernel("))
    assert rules(found) == [("custom-kernel", 7)]
    assert "async" in found[0].message


# --- KernelGuard ---------------------------------------------------------------------------------

@pytest.mark.parametrize("source, pattern", [(REPLAY, "OUTPUT_REPLAY_CACHE"),
                                             (TIMER_PATCH, "TIMER_MONKEYPATCH")])
def test_kernelguard_filters_under_both_profiles(tmp_path, source, pattern):
    found = check(tmp_path, source)
    assert rules(found) == [("kernelguard-default", None), ("kernelguard-strict", None)]
    for finding in found:
        assert "'hacked'" in finding.message and "should_filter True" in finding.message
        assert pattern in finding.message


def test_kernelguard_not_valid_differs_by_profile(tmp_path):
    found = check(tmp_path, GRAPH_REPLAY)
    assert rules(found) == [("kernelguard-default", None), ("kernelguard-strict", None)]
    assert "'low_confidence'" in found[0].message and "'suspicious'" in found[1].message
    assert all("should_filter False" in f.message and "CUDA_GRAPH_PYTHON" in f.message
               for f in found)


@pytest.mark.parametrize("profile", preflight.KERNELGUARD_PROFILES)
def test_in_process_verdict_is_what_the_cli_prints(profile):
    cli = subprocess.run([sys.executable, "-m", "kernelguard", "--api-mode", "--profile", profile],
                         input=GRAPH_REPLAY.encode(), capture_output=True, check=True, timeout=120)
    printed = json.loads(cli.stdout.decode().strip().splitlines()[-1])
    assert preflight.kernelguard_verdict(GRAPH_REPLAY, profile) == printed


def test_kernelguard_configuration_is_restored():
    kg = preflight.load_kernelguard()
    before = kg.ACTIVE_RUNTIME_CONFIG["profile"]
    preflight.kernelguard_verdict(GOOD, "strict", kg)
    assert kg.ACTIVE_RUNTIME_CONFIG["profile"] == before


def test_kernelguard_missing_is_a_failure(tmp_path, monkeypatch):
    def missing():
        raise ImportError("No module named 'kernelguard'")

    monkeypatch.setattr(preflight, "load_kernelguard", missing)
    found = check(tmp_path, GOOD)
    assert rules(found) == [("kernelguard", None)]
    assert "pip install kernelguard==0.3.1" in found[0].message


def test_other_kernelguard_version_is_a_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "kernelguard_version", lambda: "0.4.0")
    found = check(tmp_path, GOOD)
    assert rules(found) == [("kernelguard", None)]
    assert "0.4.0" in found[0].message and "0.3.1" in found[0].message


# --- the command line ----------------------------------------------------------------------------

def test_cli_prints_findings_then_fail(tmp_path):
    path = tmp_path / "submission.py"
    path.write_text(with_line(GOOD, 4, "# one Stream only\n").replace("def custom_kernel(",
                                                                      "def kernel("))
    run = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "preflight.py"), str(path)],
                         capture_output=True, text=True, timeout=120)
    lines = run.stdout.splitlines()
    assert run.returncode == 1
    assert lines[-1] == "FAIL"
    assert lines[0].startswith(f"{path}:4: [stream-word] ")
    assert f"{path}: [custom-kernel] no top-level 'def custom_kernel(data)'" in lines
    assert all(line.startswith(f"{path}") for line in lines[:-1])
