"""The race's measuring process as the tests (and tools/race_safety.py) run it: submission.py over
the aiter double, stand-in candidates registered, a fake timer where one is given, then
race_child_main() (submission.py, "Candidate race"). A test points race_command at this file.

RACE_TEST_CHILD (JSON, in the environment): {"generation": aiter double generation or null (no
aiter: the Triton table), "page_mode": the double's page mode or null, "stand_ins": names from
STAND_INS to register, "times": {candidate key: [us per call]} (absent: CUDA events)}.
"""
import ctypes
import json
import os
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(TESTS), str(TESTS.parents[1])]

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from aiter_double import loader  # noqa: E402


def key(candidate):
    return json.dumps(candidate, sort_keys=True)


def zeros(q, *args, **kwargs):
    return torch.zeros(q.shape[0], 16, 512, dtype=torch.bfloat16, device=q.device)


def every_2nd_token(q, kv_data, qo_indptr, kv_indptr, config, **kwargs):
    """Honest-looking attention over every 2nd token of each row's fp8 cache."""
    kv, scale = kv_data["fp8"]
    out = torch.empty(q.shape[0], 16, 512, dtype=torch.bfloat16, device=q.device)
    bounds = kv_indptr.tolist()
    for b in range(q.shape[0]):
        k = kv[bounds[b]:bounds[b + 1]:2, 0].float() * scale.float()
        probs = torch.softmax(q[b].float() @ k.T / 24.0, dim=-1)
        out[b] = (probs @ k[:, :512]).to(torch.bfloat16)
    return out


def _attention(q, kv_data, kv_indptr, dims=576, drop_last=0):
    """Attention of each row over its fp8 cache, q.k over the first `dims` dims, without the last
    drop_last(row length) tokens: an honest shape with a moderate error."""
    kv, scale = kv_data["fp8"]
    out = torch.empty(q.shape[0], 16, 512, dtype=torch.bfloat16, device=q.device)
    bounds = kv_indptr.tolist()
    for b in range(q.shape[0]):
        end = bounds[b + 1] - drop_last(bounds[b + 1] - bounds[b])
        k = kv[bounds[b]:end, 0].float() * scale.float()
        probs = torch.softmax(q[b].float()[:, :dims] @ k[:, :dims].T / 24.0, dim=-1)
        out[b] = (probs @ k[:, :512]).to(torch.bfloat16)
    return out


def no_rope(q, kv_data, qo_indptr, kv_indptr, config, **kwargs):
    """Scores from the 512 latent dims only (the rope part of q.k dropped): rel. L2 about 0.3."""
    return _attention(q, kv_data, kv_indptr, dims=512, drop_last=lambda n: 0)


def last_tokens_lost(q, kv_data, qo_indptr, kv_indptr, config, **kwargs):
    """The last sixteenth of each row's tokens lost (a last tile forgotten): rel. L2 about 0.2."""
    return _attention(q, kv_data, kv_indptr, drop_last=lambda n: max(1, n // 16))


def aborts(*args, **kwargs):
    os.abort()


def segfaults(*args, **kwargs):
    ctypes.string_at(0)


def hangs(*args, **kwargs):
    time.sleep(3600)


def raises(*args, **kwargs):
    raise RuntimeError("no kernel for this shape")


@triton.jit
def _store_far(OUT, offset):
    tl.store(OUT + offset + tl.arange(0, 16), tl.zeros([16], tl.float32))


def gpu_fault(q, *args, **kwargs):
    """A Triton kernel storing about 4 TB past its buffer: an illegal address on the GPU."""
    out = torch.empty(16, dtype=torch.float32, device=q.device)
    _store_far[(1,)](out, 1 << 40)
    torch.cuda.synchronize()
    return zeros(q)


@triton.jit
def _spin(FLAG):
    while tl.load(FLAG, volatile=True) == 0:
        pass


def gpu_hang(q, *args, **kwargs):
    """A Triton kernel waiting for a flag nobody sets."""
    flag = torch.zeros(1, dtype=torch.int32, device=q.device)
    _spin[(1,)](flag)
    torch.cuda.synchronize()
    return zeros(q)


STAND_INS = {"gpu_fault": gpu_fault, "gpu_hang": gpu_hang, "zeros": zeros, "every_2nd_token": every_2nd_token,
             "no_rope": no_rope, "last_tokens_lost": last_tokens_lost, "aborts": aborts, "segfaults": segfaults,
             "hangs": hangs, "raises": raises}


def register(module, names, routes=STAND_INS):
    """Stand-in routes judged like fp8 routes (the widest bound a real route here has but mxfp4's)."""
    for name in names:
        module.ROUTES[name] = routes[name]
        module.ROUTE_INFO[name] = {"kv_format": "fp8", "q_format": "fp8", "rel_l2_bound": 0.06}


class FakeTimer:
    def __init__(self, times):
        self.times = times

    def __call__(self, candidate, fn, repeats, flush):
        fn()  # the candidate really runs, as it would between the events
        return list(self.times[key(candidate)])


def main(extra_routes=None):
    config = json.loads(os.environ.get("RACE_TEST_CHILD", "{}"))
    module = loader.load_submission(config.get("generation"), page_mode=config.get("page_mode")).module
    register(module, config.get("stand_ins", ()), {**STAND_INS, **(extra_routes or {})})
    if "times" in config:
        module.race_timer = FakeTimer(config["times"])
    module.race_child_main()


if __name__ == "__main__":
    main()
