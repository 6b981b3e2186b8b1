"""One call of the sparse form per case on the GPU, judged strictly (reference.check_sparse with the
route's q format): a quick gate before a device call's tests and timing of a new sparse kernel.
Exits 1 if a case fails. Usage: python3 lab/device/sparse_smoke.py [FILE]  (FILE: a submission.py)"""
import importlib.util
import sys
import time

import torch

sys.path.insert(0, ".")
import eval as harness  # noqa: E402
import reference as R  # noqa: E402

path = sys.argv[1] if len(sys.argv) > 1 else "submission.py"
spec = importlib.util.spec_from_file_location("sub", path)
S = importlib.util.module_from_spec(spec)
spec.loader.exec_module(S)
failed = 0
for b, h, topk, kw in [(2, 64, 128, {}), (2, 128, 2048, {}), (3, 64, 2048, {"topk_length": True}), (74, 64, 2048, {}),
                       (2, 16, 256, {}), (4, 64, 2048, {"varlen": True, "zeros": 1})]:
    x = R.generate_sparse_input(b, 2, h, 64, 4096, topk, 7, device="cuda", **kw)
    plan, _ = S.get_mla_decode_metadata()
    t0 = time.time()
    out, lse = S.mla_decode_with_kvcache(x.q, x.k_cache, None, None, 512, plan, is_fp8_kvcache=True,
                                         indices=x.indices, topk_length=x.topk_length)
    torch.cuda.synchronize()
    fmt = harness.sparse_q_format(S, x)
    ok, msg = R.check_sparse(x, out, lse, q_format=fmt)
    print(f"b {b} h {h} topk {topk} {kw} q {fmt} route {plan.route['route']}: {'ok' if ok else 'FAIL'} "
          f"({time.time() - t0:.1f} s) {msg}", flush=True)
    failed += not ok
sys.exit(1 if failed else 0)
