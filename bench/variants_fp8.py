"""Time kernel-variant modules (bench/wip_variants/var_*.py, each a copy of the fp8 route with one change)
on two shapes, checking each against float32 attention over the dequantised cache. One device call."""
import glob
import importlib.util
import os
import re
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweep_fp8 import make_input, reference_fp32, rel_l2  # noqa: E402

FLUSH = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")


def bench(fn, repeats=20):
    times = []
    for _ in range(repeats):
        FLUSH.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize()
        times.append(s.elapsed_time(e) * 1000)
    return statistics.median(times)


def main():
    mods = {}
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "wip_variants", "var_*.py"))):
        name = os.path.basename(path)[4:-3]
        spec = importlib.util.spec_from_file_location("var_" + name, path)
        mods[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[name])
    configs = [dict(num_warps=nw, num_stages=ns, block_n=bn, qk_fp8=qk)
               for nw, ns, bn, qk in [(8, 3, 64, True), (4, 3, 64, True), (4, 4, 64, True), (4, 3, 64, False)]]
    shapes = [(256, 8192, 1), (4, 1024, 16), (64, 1024, 1), (32, 8192, 4)]
    datas = {s: make_input(s[0], s[1], seed=s[0] + s[1]) for s in shapes}
    refs = {s: reference_fp32(datas[s]) for s in shapes}
    lines = []
    for name, mod in mods.items():
        for cfg in configs:
            cells = []
            for shape in shapes:
                data = datas[shape]
                params = dict(cfg, num_splits=shape[2])
                try:
                    out = mod.triton_fp8_route(*data, **params)
                    err = rel_l2(out, refs[shape])
                    t = bench(lambda: mod.triton_fp8_route(*data, **params))
                    cells.append(f"{t:8.1f}us e{err:.3f}")
                except Exception as exc:
                    cells.append("FAIL " + repr(exc)[:60])
            try:
                k = mod._mla_decode_fp8_kernel.warmup(*([torch.empty(1, device="cuda")] * 0), grid=(1,), **{}) if False else None
            except Exception:
                k = None
            line = f"{name:8s} {str(cfg):70s} " + " | ".join(cells)
            print(line, flush=True)
            lines.append(line)
    print("\nshapes:", shapes)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
