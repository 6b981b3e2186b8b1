"""Probe (one device call): the FlashMLA-style formulation, 16 heads padded to 64 rows, V as the B
operand in f16 from shared memory, against the kernel's tokens-as-M loop (ablate_fp8.py MODE 3)."""
import sys
import os

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import utils  # noqa: E402
from ablate_fp8 import ablate  # noqa: E402
from padded_probe_kernel import padded  # noqa: E402


def main():
    flush = utils.L2Flusher("default")
    for batch, kv_len in [(256, 8192), (64, 1024), (4, 1024)]:
        q = torch.randn(batch, 16, 576, device="cuda").bfloat16()
        kv = (torch.randn(batch * kv_len, 576, device="cuda") * 20).to(torch.float8_e4m3fn)
        out = torch.empty(batch, 16, 512, device="cuda", dtype=torch.bfloat16)
        ref = torch.empty_like(out)
        floor = batch * kv_len * 576 / 4.2e12 * 1e6
        ablate[(batch,)](q, kv, ref, kv_len, 576, BLOCK_N=64, MODE=3, num_warps=4, num_stages=3)
        t = utils.median_time_us(lambda: ablate[(batch,)](q, kv, ref, kv_len, 576, BLOCK_N=64, MODE=3, num_warps=4, num_stages=3), 15, flush)
        print(f"bs {batch} kv {kv_len} floor {floor:.0f}: tokens-as-M nw4 ns3 {t:.1f} us", flush=True)
        for nw, ns, bn in [(8, 2, 64), (8, 3, 64), (8, 2, 32), (8, 3, 32)]:
            try:
                padded[(batch,)](q, kv, out, kv_len, 576, BLOCK_N=bn, HP=64, num_warps=nw, num_stages=ns)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                t = utils.median_time_us(lambda: padded[(batch,)](q, kv, out, kv_len, 576, BLOCK_N=bn, HP=64, num_warps=nw, num_stages=ns), 15, flush)
                print(f"   padded nw{nw} ns{ns} bn{bn}: {t:.1f} us  x{t / floor:.2f}  diff vs tokens-as-M {err:.4f}", flush=True)
            except Exception as exc:
                print(f"   padded nw{nw} ns{ns} bn{bn}: FAIL {repr(exc)[:150]}", flush=True)


if __name__ == "__main__":
    main()
