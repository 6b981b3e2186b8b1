"""lab/profile/length_fit.py: the line through a provider's times over the batch's tokens, from
serving_peers.py's output."""
import json
import math

import pytest

from lab.profile.length_fit import case_tokens, fits, read_rows, report

H72 = "bench/results/h200/serving_peers_h72_flashmla_2026-12-04.txt"


def rows_on_a_line(provider, fixed, per_token, tokens, grid="A", s_q=1, h_q=128):
    return [{"grid": grid, "batch": 128, "s_q": s_q, "h_q": h_q, "s_k": 0, "long": 0, "provider": provider,
             "tokens": n, "gpu": fixed + per_token * n, "event": fixed + per_token * n + 5.0} for n in tokens]


def test_a_line_is_recovered_with_its_rates():
    rows = rows_on_a_line("ours fp8", 120.0, 2.5e-4, (500_000, 1_000_000, 2_000_000))
    fit = fits(rows)[("A", 128, 1, 128, 0)]["ours fp8"]
    assert fit["fixed_us"] == pytest.approx(120.0)
    assert fit["us_per_mtok"] == pytest.approx(250.0)
    assert fit["tb_s"] == pytest.approx(576 / 2.5e-4 / 1e6)  # an fp8 cache: 576 bytes a token
    assert fit["tflops"] == pytest.approx(2 * 128 * 1088 / 2.5e-4 / 1e6)
    assert fit["fixed_share"] == pytest.approx((120 / 245, 120 / 620))
    assert fit["worst_residual"] == pytest.approx(0.0, abs=1e-12)
    assert fits(rows, "event")[("A", 128, 1, 128, 0)]["ours fp8"]["fixed_us"] == pytest.approx(125.0)


def test_bytes_a_token_follow_the_cache():
    for provider, token_bytes in (("ours bf16", 1152), ("vLLM fp8 fork", 576), ("FlashInfer fp8", 576)):
        fit = fits(rows_on_a_line(provider, 10.0, 1e-4, (1000, 2000)))[("A", 128, 1, 128, 0)][provider]
        assert fit["tb_s"] == pytest.approx(token_bytes / 1e-4 / 1e6)


def test_a_single_length_or_a_missing_time_gives_no_line():
    rows = rows_on_a_line("ours fp8", 10.0, 1e-4, (1000,)) + rows_on_a_line("base fp8", 10.0, 1e-4, (1000, 2000))
    rows[-1]["gpu"] = math.nan
    assert fits(rows) == {}


def test_residuals_show_a_bent_line():
    rows = rows_on_a_line("ours fp8", 100.0, 1e-4, (1_000_000, 2_000_000, 3_000_000))
    rows[1]["gpu"] += 30.0  # 330 where the line says 300
    fit = fits(rows)[("A", 128, 1, 128, 0)]["ours fp8"]
    assert fit["fixed_us"] == pytest.approx(110.0)
    assert fit["worst_residual"] == pytest.approx(20.0 / 200.0)


def test_case_tokens_are_serving_peers_lengths():
    assert case_tokens("C", 32, 1, 8192, 0) == 32 * 8192
    assert case_tokens("S", 128, 1, 1024, 65536) == 127 * 1024 + 65536
    varied = case_tokens("A", 128, 1, 4096, 0)
    assert varied != 128 * 4096 and abs(varied / (128 * 4096) - 1) < 0.1  # normal around the mean
    assert case_tokens("B", 128, 1, 4096, 0) == varied  # one seed: the same lengths on A and B


def test_the_h72_run_parses_and_fits():
    rows = read_rows(H72)
    assert {r["provider"] for r in rows} == {"ours bf16", "ours fp8", "base bf16", "base fp8", "FlashMLA bf16"}
    assert sum(r["grid"] == "A" for r in rows) == 30 and sum(r["grid"] == "B" for r in rows) == 30
    grid_a = fits(rows)[("A", 128, 1, 128, 0)]
    # lab/NOTES.md h80: the fixed part FlashMLA's 43.6 us against ours 124.7 (fp8) and 126.0 (bf16)
    assert grid_a["FlashMLA bf16"]["fixed_us"] == pytest.approx(43.6, abs=0.05)
    assert grid_a["ours fp8"]["fixed_us"] == pytest.approx(124.7, abs=0.05)
    assert grid_a["ours bf16"]["fixed_us"] == pytest.approx(126.0, abs=0.05)
    assert grid_a["ours fp8"]["tflops"] == pytest.approx(1000, abs=1)
    text = report(fits(rows))
    assert "grid A b128 s_q1 h128" in text and "0.35x, 1.42x" in text


def test_a_json_run_gives_the_same_rows(tmp_path):
    rows = read_rows(H72)[:6]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"rows": [{**{k: r[k] for k in ("grid", "batch", "s_q", "h_q", "s_k", "long",
                                                                  "provider", "tokens")},
                                           "median_us": r["event"], "gpu_us": r["gpu"], "host_us": 1.0}
                                          for r in rows]}))
    assert read_rows(str(path)) == rows


def test_a_kernels_part_is_fitted_alone_from_the_printed_brackets(tmp_path):
    line = ("A b128 s_q1 h128 s_k{k} ours fp8           352.9 us (mean     379.7) gpu     {gpu:.1f}  host  180.1 / "
            "busy 182.5 us   389.8 TFLOPS   1.61 TB/s(bf16)  rel nan  [_mla_decode_seesaw_kernel {main:.1f} + "
            "_mla_combine_kernel {comb:.1f}]\n")
    path = tmp_path / "run.txt"
    path.write_text("".join(line.format(k=k, gpu=m + c, main=m, comb=c)
                            for k, m, c in ((4096, 240.0, 22.0), (8192, 380.0, 20.0), (16384, 660.0, 21.0))))
    rows = read_rows(str(path))
    assert rows[0]["kernels"] == {"_mla_decode_seesaw_kernel": 240.0, "_mla_combine_kernel": 22.0}
    key = ("A", 128, 1, 128, 0)
    whole = fits(rows)[key]["ours fp8"]
    main = fits(rows, kernel="_mla_decode_seesaw_kernel")[key]["ours fp8"]
    combine = fits(rows, kernel="_mla_combine_kernel")[key]["ours fp8"]
    assert whole["fixed_us"] == pytest.approx(main["fixed_us"] + combine["fixed_us"])
    assert whole["us_per_mtok"] == pytest.approx(main["us_per_mtok"] + combine["us_per_mtok"])
    assert fits(rows, kernel="flash_fwd_splitkv_mla_kernel") == {}  # a kernel it never launched
    assert fits(read_rows(H72), kernel="_mla_combine_kernel") == {}  # h72's run printed no kernels
