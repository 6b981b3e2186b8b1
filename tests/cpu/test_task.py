"""task.py: the leaderboard's types describe what the repository's spec files and reference.py hold."""
import typing
from pathlib import Path

import pytest
import torch

import reference
import task
import utils

SPECS = Path(__file__).resolve().parents[2] / "specs"
# the leaderboard-format spec files (serving*.txt and sparse*.txt hold the serving API's cases:
# tests/cpu/test_eval_serving.py, tests/cpu/test_eval_sparse.py)
SPEC_FILES = sorted(p for p in SPECS.glob("*.txt") if not p.name.startswith(("serving", "sparse")))


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.name)
def test_every_spec_line_has_the_test_spec_keys_and_types(path):
    hints = typing.get_type_hints(task.TestSpec)
    cases = utils.read_spec_file(str(path))
    assert cases, f"{path} holds no case"
    for case in cases:
        assert set(case.args) == set(hints), case.spec
        assert all(type(case.args[k]) is hints[k] for k in hints), case.spec


def test_generate_input_and_the_reference_match_input_t_and_output_t():
    args = utils.read_spec_file(str(SPECS / "cpu.txt"))[1].args  # batch 2, kv 45
    data = reference.generate_input(**args, device="cpu")
    bound = typing.get_args(task.input_t.__bound__)
    assert len(data) == len(bound) == 5
    for value, kind in zip(data, bound, strict=True):
        assert isinstance(value, typing.get_origin(kind) or kind), (type(value), kind)
    q, kv_data, qo_indptr, kv_indptr, config = data
    batch, total_kv = args["batchsize"], args["batchsize"] * args["kvseqlen"]
    assert q.shape == (batch * args["qseqlen"], 16, 576) and q.dtype == torch.bfloat16
    assert set(kv_data) == {"bf16", "fp8", "mxfp4"} and kv_data["bf16"].shape == (total_kv, 1, 576)
    assert qo_indptr.shape == kv_indptr.shape == (batch + 1,) and int(kv_indptr[-1]) == total_kv
    assert config["batch_size"] == batch and config["kv_seq_len"] == args["kvseqlen"]
    out = reference.ref_kernel(data)
    assert isinstance(out, task.output_t.__bound__)
    assert out.shape == (q.shape[0], 16, 512) and out.dtype == torch.bfloat16
