"""What fp8 MMA would cost the sparse form in accuracy (CPU, float64 emulation; no kernel runs).

    python lab/sparse_fp8_error.py [--heads 64,128] [--topk 2048] [--seeds 3]

The sparse cache holds each token's latent as fp8 x a power-of-two scale per 128-dim tile. A
kernel with fp8 MMA would also round q (QK^T) and P (P.V) to fp8; this measures, on
reference.generate_sparse_input's cases, out's rel. L2 error against float64 attention over the
bf16 values (the bound's reference: reference.judge_sparse allows 1.25 x the format's own error),
for each way of computing:

  format    exact attention over the dequantised cache (the format's own error: the bound's unit)
  bf16      the portable kernel's arithmetic: q bf16, K and V dequantised to bf16 (exact: fp8 x a
            power of two), P rounded to bf16 per 16-entry tile, float64 accumulation
  q8        q rounded to fp8 (a power-of-two scale per head and 128-dim tile, its amax to 448),
            the rope part bf16, P bf16
  q8p8      q8, and P rounded to fp8 per tile of entries: P x (the token's scale / the tile's
            largest scale of that 128-dim tile), so that one scale per tile leaves the MMA
            (the per-token V scales folded into P), the online softmax's running max per tile
  p8        q bf16, P as in q8p8

Each line: the error / the format's own error (the bound is 1.25), max |lse error| likewise."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reference  # noqa: E402

FP8 = torch.float8_e4m3fn
TILE = 128
LATENT = 512


def fp8_round(x, amax_to=448.0, dim=-1):
    """x rounded to fp8 e4m3 with a power-of-two scale per slice along `dim` (its amax to at most 448)."""
    amax = x.abs().amax(dim=dim, keepdim=True).clamp_min(1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / amax_to)))
    return (x / scale).to(FP8).double() * scale


def attend(q, keys, tok_scale, scale, q_mode, p_mode, tile_n=16):
    """out (heads, 512), lse (heads,) of one query token over its keys (tokens, 576) float64 with
    their per-tile scales tok_scale (tokens, 4), tile_n entries a step."""
    qd = q.double()
    if q_mode == "fp8":
        lat = qd[:, :LATENT].reshape(qd.shape[0], 4, TILE)
        qd = torch.cat([fp8_round(lat).reshape(qd.shape[0], LATENT), qd[:, LATENT:]], dim=1)
    heads = qd.shape[0]
    run_max = torch.full((heads,), float("-inf"), dtype=torch.float64)
    run_sum = torch.zeros(heads, dtype=torch.float64)
    acc = torch.zeros(heads, LATENT, dtype=torch.float64)
    for start in range(0, keys.shape[0], tile_n):
        k = keys[start:start + tile_n]
        s = (qd @ k.T) * scale  # (heads, n)
        new_max = torch.maximum(run_max, s.max(-1).values)
        corr = torch.exp(run_max - new_max)
        p = torch.exp(s - new_max[:, None])
        run_sum = run_sum * corr + p.sum(-1)
        acc = acc * corr[:, None]
        for t in range(4):
            v = k[:, t * TILE:(t + 1) * TILE]
            if p_mode == "bf16":
                pt = p.to(torch.bfloat16).double()
                acc[:, t * TILE:(t + 1) * TILE] += pt @ v
            else:  # fp8: P x (token scale / tile max scale), one scale (the tile max) after the MMA
                sc = tok_scale[start:start + tile_n, t]
                top = sc.max()
                pt = (p * (sc / top)[None, :]).to(FP8).double()
                acc[:, t * TILE:(t + 1) * TILE] += (pt @ (v / sc[:, None])) * top
        run_max = new_max
    return acc / run_sum[:, None], run_max + torch.log(run_sum)


MODES = {"bf16": ("bf16", "bf16"), "q8": ("fp8", "bf16"), "q8p8": ("fp8", "fp8"), "p8": ("bf16", "fp8")}


def errors(inputs):
    """{mode: (out rel. L2, max |lse err|)} against float64 over the bf16 values, 'format' included."""
    out_v, lse_v = reference.mla_decode_sparse_float64(inputs.q, inputs.values, inputs.indices)
    out_c, lse_c = reference.mla_decode_sparse_float64(inputs.q, inputs.k_cache, inputs.indices)
    b, s_q, heads, _ = inputs.q.shape
    found = {"format": (out_c, lse_c)}
    for mode, (q_mode, p_mode) in MODES.items():
        out = torch.zeros_like(out_v)
        lse = torch.full_like(lse_v, float("inf"))
        for i in range(b):
            for t in range(s_q):
                row = inputs.indices[i, t].long()
                row = row[row >= 0]
                if row.numel() == 0:
                    continue
                keys = reference.sparse_rows(inputs.k_cache, row)  # float64, dequantised
                raw = reference._sparse_bytes(inputs.k_cache)[row // inputs.page, row % inputs.page, 0]
                scales = raw[:, reference.SPARSE_SCALES_AT:reference.SPARSE_ROPE_AT].contiguous().view(torch.float32)
                out[i, t], lse[i, :, t] = attend(inputs.q[i, t], keys, scales.double(), inputs.softmax_scale,
                                                 q_mode, p_mode)
        found[mode] = (out, lse)
    att = torch.isfinite(lse_v)
    rows = att.permute(0, 2, 1)
    return {mode: (((o[rows] - out_v[rows]).norm() / out_v[rows].norm()).item(),
                   (lse[att] - lse_v[att]).abs().max().item()) for mode, (o, lse) in found.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", default="64,128")
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    for heads in map(int, args.heads.split(",")):
        for seed in range(args.seeds):
            inputs = reference.generate_sparse_input(1, 2, heads, 64, 2 * args.topk, args.topk, 31000 + seed,
                                                     device="cpu")
            found = errors(inputs)
            fmt_out, fmt_lse = found["format"]
            print(f"h{heads} topk{args.topk} seed{seed}: format out {fmt_out:.3e} lse {fmt_lse:.2e} | " + "  ".join(
                f"{mode} {o / fmt_out:.3f}x / lse {e / max(fmt_lse, 1e-12):.2f}x" for mode, (o, e) in found.items()
                if mode != "format"), flush=True)


if __name__ == "__main__":
    main()
