"""How many bits an fp8 wgmma keeps while it accumulates (sm_90): the model under
reference.sparse_fp8_mma_slack, checked on the tensor core itself.

    python3 lab/device/fp8_mma_probe.py [--json OUT.json]     # a GPU: run and report
    python3 lab/device/fp8_mma_probe.py --compile-only        # the CPU: compile for sm_90a, no run

One Gluon kernel, one warpgroup: D = C + A.B^T with A (64 x 128) and B (64 x 128) float8_e4m3fn in
shared memory (K-major, as the sparse kernel's Q.K^T chunks) and C (64 x 64) float32 in registers, one
warpgroup_mma of K = 128 (four k-steps of 32). The rows are experiments:

  rows  0-15  the accumulator as read: C = 1 + 2^-(8 + r), A = 0
  rows 16-31  one k-step: C = 0, products 1 and +-2^-j in the same step (j = row and column's)
  rows 32-47  across steps: the same two products, the small one a k-step later
  rows 48-63  random A, B and C

Each D is compared with float64 (exact) and with the model "the accumulator truncated toward zero to
13 mantissa bits after each k-step" (lab/sparse_mma_error.py's m13). The report per group: how many
results equal the model bit for bit, how many equal float64, and the largest error in units of
2^-13 x |the accumulator|."""
import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "lab"))

import sparse_mma_error  # noqa: E402  (lab/: the model's arithmetic)
import submission  # noqa: E402  (HAVE_GLUON and the Gluon names it imports)

M, N, K = 64, 64, 128
GROUPS = (("accumulator", 0, 16), ("one step", 16, 32), ("across steps", 32, 48), ("random", 48, 64))

if submission.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

    @gluon.jit
    def _fp8_mma_probe(A, B, C, D):
        """D = C + A.B^T, one fp8 warpgroup_mma (A, B: 64 x 128 bytes each, row-major)."""
        LOAD: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])
        SHARED: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv)
        rows = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, LOAD)), 1)
        cols = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, LOAD)), 0)
        a = gl.allocate_shared_memory(gl.float8e4nv, [64, 128], SHARED, gl.load(A + rows * 128 + cols))
        b = gl.allocate_shared_memory(gl.float8e4nv, [64, 128], SHARED, gl.load(B + rows * 128 + cols))
        fence_async_shared()
        out_rows = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, ACC)), 1)
        out_cols = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, ACC)), 0)
        acc = gl.load(C + out_rows * 64 + out_cols)
        acc = warpgroup_mma(a, b.permute((1, 0)), acc)
        gl.store(D + out_rows * 64 + out_cols, acc)


def experiments(seed=0):
    """(A, B) float8_e4m3fn (64 x 128), C float32 (64 x 64) of the four groups (see the module's
    docstring), on the CPU."""
    a = torch.zeros(M, K, dtype=torch.float64)
    b = torch.zeros(N, K, dtype=torch.float64)
    c = torch.zeros(M, N, dtype=torch.float64)
    cols = torch.arange(N)
    for r in range(16):
        c[r] = 1.0 + 2.0 ** -(8 + r)
    # products 1 (dims 0 and 32 of B's column: 1) and 2^-(ja + jb): ja 0..9 by row, jb by column
    b[:, 0] = 1.0
    b[:, 1] = 2.0 ** -(cols % 10).double()
    b[:, 32] = 2.0 ** -(cols % 10).double()
    for r in range(16, 32):
        a[r, 0] = 1.0
        a[r, 1] = (1.0 if r < 26 else -1.0) * 2.0 ** -((r - 16) % 10)
    for r in range(32, 48):
        a[r, 0] = 1.0
        a[r, 32] = (1.0 if r < 42 else -1.0) * 2.0 ** -((r - 32) % 10)
    gen = torch.Generator().manual_seed(seed)
    a[48:] = torch.randn(16, K, generator=gen, dtype=torch.float64) * 8
    b[48:] = torch.randn(N - 48, K, generator=gen, dtype=torch.float64) * 8
    b[:48, 2:32] = torch.randn(48, 30, generator=gen, dtype=torch.float64) * 8  # random columns for rows 48-63
    c[48:] = torch.randn(16, N, generator=gen, dtype=torch.float64) * 64
    return a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn), c.float()


def model(a, b, c):
    """D as the 13-bit model computes it (lab/sparse_mma_error.py's fp8_mma, "m13"): C, then per
    k-step of 32 the step's exact sum added and the accumulator truncated; float64 (64 x 64)."""
    return sparse_mma_error.fp8_mma(a.double(), b.double(), c.double(), "m13")


def report(a, b, c, d):
    """Per group: results equal to the model (13 bits), to float64, and the largest |D - exact| in
    units of 2^-13 x max(|exact|, |C|)."""
    exact = c.double() + a.double() @ b.double().T
    predicted = model(a, b, c)
    d = d.double()
    found = {}
    for name, lo, hi in GROUPS:
        got, want, pred = d[lo:hi], exact[lo:hi], predicted[lo:hi]
        unit = 2.0 ** -13 * torch.maximum(want.abs(), c[lo:hi].double().abs()).clamp_min(1e-30)
        found[name] = {"results": got.numel(), "equal_model": int((got == pred).sum()),
                       "equal_exact": int((got == want).sum()),
                       "largest_error_units": float(((got - want).abs() / unit).max())}
    return found


def compile_only():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {"A": "*fp8e4nv", "B": "*fp8e4nv", "C": "*fp32", "D": "*fp32"}
    src = GluonASTSource(fn=_fp8_mma_probe, signature=signature, constexprs={}, attrs={})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.compile_only:
        compiled = compile_only()
        print("compiled for sm_90a:", "wgmma" in compiled.asm["ptx"])
        return
    a, b, c = experiments()
    d = torch.empty(M, N, dtype=torch.float32, device="cuda")
    _fp8_mma_probe[(1,)](a.cuda(), b.cuda(), c.cuda(), d, num_warps=4)
    torch.cuda.synchronize()
    found = report(a, b, c, d.cpu())
    for name, row in found.items():
        print(f"{name:13s}: {row['equal_model']:4d} / {row['results']} equal the 13-bit model, "
              f"{row['equal_exact']:4d} equal float64, largest error {row['largest_error_units']:.2f} x 2^-13 |acc|")
    d = d.cpu().double()
    print("rows 0-15 (C = 1 + 2^-(8 + r)) as read back: lost from r =",
          next((r for r in range(16) if d[r, 0] != c[r, 0].double()), None))
    print("row 16 (1 + 2^-jb, jb = column % 10) and row 25 (1 + 2^-(9 + jb)):",
          [float(d[16, j] - 1) for j in range(10)], [float(d[25, j] - 1) for j in range(10)])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "groups": found}, f, indent=1)


if __name__ == "__main__":
    main()
