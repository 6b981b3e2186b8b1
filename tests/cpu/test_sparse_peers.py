"""bench/sparse_peers.py on the CPU: its cases are specs/sparse.txt's FlashMLA benchmark lines, and
each provider (ours, and FlashMLA's sparse decode through a strict double of its interface:
tests/doubles/flashmla_sparse_double.py) is called as eval.py calls a sparse case and passes the
strict check (reference.judge_sparse, with the q each provider multiplies: sparse_peers.q_format),
where zeros fail. FlashMLA's kernel is not here:
sparse_peers.py's main() checks it on the GPU before timing it."""
import os
import re
import subprocess
import types

import pytest
import torch

import flashmla_sparse_double as fm
import reference
from bench import sparse_peers

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter's CPU, else the GPU's compiler


def test_the_cases_are_flashmlas_sparse_benchmark():
    cases = sparse_peers.bench_cases()
    assert [(c["heads"], c["batchsize"]) for c in cases] == [(h, b) for h in (64, 128) for b in (2, 64, 74, 128)]
    assert all((c["qseqlen"], c["kvseqlen"], c["topk"], c["page"], c["varlen"]) == (2, 32768, 2048, 64, 1)
               for c in cases)
    peak = [c for c in sparse_peers.bench_cases(peak=True) if c not in cases]
    assert [(c["heads"], c["batchsize"], c["topk"]) for c in peak] == [(64, 148, 16384), (128, 148, 16384)]


def small_case(heads=64, topk_length=False, seed=5):
    return reference.generate_sparse_input(2, 2, heads, 64, 90, 32, seed, varlen=True, topk_length=topk_length,
                                           device=DEVICE)


@pytest.mark.parametrize("heads, topk_length", [(64, False), (128, True)])
def test_both_providers_pass_the_strict_check(heads, topk_length):
    inputs = small_case(heads, topk_length)
    found = {"FlashMLA sparse": (fm.get_mla_metadata, fm.flash_mla_with_kvcache)}
    if heads == 64:  # ours under the interpreter: one head count keeps the CPU time small
        found.update(sparse_peers.providers(types.SimpleNamespace(variants=[], flashmla_sparse=None))[0])
    calls = sparse_peers.case_calls(found, inputs)
    assert set(calls) == set(found)
    for name, fn in calls.items():
        expected = reference.sparse_expected(inputs, sparse_peers.q_format(name, [], inputs))
        for _ in range(2):  # the plan reused
            out, lse = fn()
            verdict = reference.judge_sparse(expected, out, lse)
            assert verdict["ok"], (name, reference.sparse_message(verdict))


def test_each_provider_is_judged_with_the_q_it_multiplies(monkeypatch):
    """FlashMLA's sparse decode: bf16 q always; ours and each variant: its module's
    sparse_q_format(q, k_cache), bf16 where the module has none."""
    inputs = small_case()
    seen = []

    def fp8(q, k_cache):
        seen.append((q is inputs.q, k_cache is inputs.k_cache))
        return "fp8"
    variants = [("fp8 variant", types.SimpleNamespace(sparse_q_format=fp8)), ("plain", types.SimpleNamespace())]
    assert sparse_peers.q_format("FlashMLA sparse", variants, inputs) == "bf16"
    assert sparse_peers.q_format("fp8 variant", variants, inputs) == "fp8" and seen == [(True, True)]
    assert sparse_peers.q_format("plain", variants, inputs) == "bf16"
    monkeypatch.setattr(sparse_peers.submission, "sparse_q_format", fp8, raising=False)
    assert sparse_peers.q_format("ours", variants, inputs) == "fp8"
    monkeypatch.delattr(sparse_peers.submission, "sparse_q_format")
    assert sparse_peers.q_format("ours", variants, inputs) == "bf16"


def test_a_double_of_zeros_fails_the_check():
    inputs = small_case()
    expected = reference.sparse_expected(inputs)

    def zeros(*args, **kwargs):
        out, lse = fm.flash_mla_with_kvcache(*args, **kwargs)
        return torch.zeros_like(out), lse
    out, lse = sparse_peers.case_calls({"zeros": (fm.get_mla_metadata, zeros)}, inputs)["zeros"]()
    assert not reference.judge_sparse(expected, out, lse)["ok"]


def test_the_double_refuses_what_flashmla_refuses():
    inputs = small_case()
    call = sparse_peers.case_calls({"FlashMLA sparse": (fm.get_mla_metadata, fm.flash_mla_with_kvcache)}, inputs)
    call["FlashMLA sparse"]()
    plan = fm.get_mla_metadata()[0]
    args = (inputs.q, inputs.k_cache, None, None, 512, plan)
    with pytest.raises(ValueError, match="indices"):
        fm.flash_mla_with_kvcache(*args, is_fp8_kvcache=True, indices=inputs.indices.long())
    with pytest.raises(ValueError, match="q"):
        fm.flash_mla_with_kvcache(inputs.q[:, :, :16], *args[1:], is_fp8_kvcache=True, indices=inputs.indices)
    with pytest.raises(ValueError, match="is_fp8_kvcache"):
        fm.flash_mla_with_kvcache(*args, indices=inputs.indices)
    fm.flash_mla_with_kvcache(*args, is_fp8_kvcache=True, indices=inputs.indices)
    with pytest.raises(ValueError, match="tile_scheduler_metadata"):  # one plan, one configuration
        fm.flash_mla_with_kvcache(inputs.q[:1], *args[1:], is_fp8_kvcache=True, indices=inputs.indices[:1])


def test_the_summary_is_flashmlas_time_over_the_providers():
    rows = [{"heads": h, "batchsize": b, "topk": 2048, "provider": p, "gpu_us": t, "ok": True}
            for h, b, p, t in [(64, 2, "FlashMLA sparse", 30.0), (64, 2, "ours", 20.0),
                               (64, 64, "FlashMLA sparse", 200.0), (64, 64, "ours", 200.0),
                               (128, 2, "ours", 50.0)]]
    lines = {(h, p): (gpu, ratio, ok) for h, p, gpu, ratio, ok in sparse_peers.summary(rows)}
    assert lines[(64, "ours")][1] == pytest.approx((1.5 * 1.0) ** 0.5)
    assert lines[(64, "FlashMLA sparse")][1] == pytest.approx(1.0)
    assert lines[(128, "ours")][1] is None  # FlashMLA did not run h 128: no ratio
    rows[1]["ok"] = False
    assert not {(h, p): ok for h, p, _, _, ok in sparse_peers.summary(rows)}[(64, "ours")]


MIRRORS = ("/work/.mirror/deepseek-ai+FlashMLA/repo", "/work/.mirror/NVIDIA+cutlass/repo")


@pytest.mark.skipif(not all(os.path.isdir(m) for m in MIRRORS), reason="no git snapshots of FlashMLA and CUTLASS here")
def test_the_kit_holds_every_file_the_build_compiles(tmp_path):
    """bench/flashmla_sparse_kit.sh from the snapshots, then every source bench/flashmla_sparse_build.sh
    names and every local header they include is in the kit."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    kit = tmp_path / "kit.tar.xz"
    subprocess.run(["bash", os.path.join(root, "bench", "flashmla_sparse_kit.sh"), str(kit)], check=True,
                   capture_output=True)
    subprocess.run(["tar", "xJf", str(kit), "-C", str(tmp_path)], check=True)
    csrc = tmp_path / "flashmla_sparse" / "csrc"
    build = open(os.path.join(root, "bench", "flashmla_sparse_build.sh")).read()
    listed = re.findall(r'^\s+"([\w/]+\.(?:cu|cpp))",?\)?\]?$', build, re.M)
    assert len(listed) == 8 and "api/sparse_decode_binding.cpp" in listed
    roots = [csrc, csrc / "kerutils" / "include", csrc / "sm90", csrc / "cutlass" / "include"]
    todo, seen = [csrc / f for f in listed], set()
    while todo:  # every quoted #include reachable from the sources resolves inside the kit
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        assert path.is_file(), path
        for name in re.findall(r'^\s*#include\s+[<"]([^>"]+)[>"]', path.read_text(errors="replace"), re.M):
            found = [d / name for d in [path.parent] + roots if (d / name).is_file()]
            if found:
                todo.append(found[0].resolve())
            else:  # then a system or CUDA header, never one of FlashMLA's own folders
                assert not name.startswith(("kerutils/", "sm90/", "smxx/", "api/", "cute/")) and name not in (
                    "params.h", "utils.h", "defines.h", "config.h"), (path, name)
    assert any("sparse_fp8" in str(p) for p in seen)
