"""bench/serving_peers.py: the profiler time per call (the flushes split the profile, nothing guessed), the
CUDA-graph replay time (one capture after the warm-up, each replay timed after a flush), and FlashInfer's
provider."""
import pytest
import torch

import reference
from bench import serving_peers
from bench.serving_peers import (errors, fastest_peer_lines, flashinfer_calls, flashinfer_pages, flashinfer_token_calls,
                                 fp8_copy, graph_times, grid_cases, kernel_label, kernel_parts, split_calls,
                                 split_kernels, within)
import flashinfer_double

FLUSH = ["fill"]


def test_each_call_sums_its_own_kernels_between_flushes():
    kernels = [("fill", 0, 50), ("split", 60, 10), ("combine", 75, 2),
               ("fill", 100, 50), ("split", 160, 12), ("combine", 175, 3)]
    assert split_calls(kernels, 2, FLUSH) == [12, 15]


def test_each_calls_kernels_are_named_and_summed_per_kernel():
    kernels = [("fill", 0, 50), ("void ns::decode_kernel<64, true>(Params)", 60, 10), ("_mla_combine_kernel", 75, 2),
               ("fill", 100, 50), ("void ns::decode_kernel<64, true>(Params)", 160, 12), ("fill", 200, 50),
               ("void ns::decode_kernel<64, true>(Params)", 260, 11), ("_mla_combine_kernel", 275, 4),
               ("_mla_combine_kernel", 280, 1)]
    calls = split_kernels(kernels, 3, FLUSH)
    assert [len(c) for c in calls] == [2, 1, 3]
    # the combine ran in two calls of three (2 and 4 + 1 us): its median is 2; decode's 11
    assert kernel_parts(calls) == {"decode_kernel": 11, "_mla_combine_kernel": 2}
    assert list(kernel_parts(calls)) == ["decode_kernel", "_mla_combine_kernel"]  # the order they ran in
    assert kernel_label("void flash::flash_fwd_splitkv_mla_kernel<Traits, true>(Params const&)") == \
        "flash_fwd_splitkv_mla_kernel"
    assert kernel_label("_mla_decode_seesaw_kernel") == "_mla_decode_seesaw_kernel"


def test_activities_are_ordered_by_start_first():
    kernels = [("split", 160, 12), ("fill", 100, 50), ("decode", 60, 10), ("fill", 0, 50)]
    assert split_calls(kernels, 2, FLUSH) == [10, 12]


def test_a_flush_of_several_kernels_is_matched_as_a_sequence():
    flush = ["fill", "touch"]
    kernels = [("fill", 0, 5), ("touch", 6, 5), ("decode", 20, 7), ("fill", 30, 5), ("touch", 36, 5),
               ("decode", 50, 9)]
    assert split_calls(kernels, 2, flush) == [7, 9]


@pytest.mark.parametrize("kernels", [
    [("fill", 0, 50), ("decode", 60, 10)],                       # one flush for two calls
    [("decode", 0, 10), ("fill", 20, 50), ("decode", 80, 10)],   # something before the first flush
    [("fill", 0, 50), ("decode", 60, 10), ("fill", 80, 50), ("fill", 140, 50), ("decode", 200, 10)],  # three flushes
])
def test_a_profile_that_does_not_split_into_the_calls_is_an_error(kernels):
    with pytest.raises(RuntimeError, match="flushes"):
        split_calls(kernels, 2, FLUSH)


def test_a_flush_that_launched_nothing_is_an_error():
    with pytest.raises(RuntimeError):
        split_calls([("decode", 0, 10)], 1, [])


def test_within_stops_starting_cases_after_the_budget_and_says_how_many_were_left(capsys):
    ticks = iter([0.0, 1.0, 5.0, 11.0])  # the start, then one reading before each case
    assert list(within(["a", "b", "c", "d"], 10, clock=lambda: next(ticks))) == ["a", "b"]
    assert "2 of 4 cases not run" in capsys.readouterr().out
    assert list(within(["a", "b"], None, clock=lambda: 1e9)) == ["a", "b"]


# FlashInfer's provider, against float64 attention through a strict double of its MLA wrapper
# (tests/doubles/flashinfer_double.py): the wiring (pages, query rows, causal mask, fp8 scale) is what
# is tested; FlashInfer's kernels are not here.

def flashinfer_case(s_q, causal, page, seed=3):
    return reference.generate_serving_input(3, s_q, 4, page, 70, seed, varlen=True, causal=causal, device="cpu")


@pytest.mark.parametrize("s_q, causal, page", [(1, False, 16), (2, True, 64), (2, False, 1)])
def test_flashinfer_calls_give_float64_attention_through_the_double(s_q, causal, page):
    case = flashinfer_case(s_q, causal, page)
    cache8, scale8 = fp8_copy(case.k_cache)
    calls = flashinfer_calls(flashinfer_double, case, cache8, scale8)
    exact = reference.mla_decode_paged_float64(case.q, case.k_cache, case.block_table, case.cache_seqlens,
                                               causal=causal)
    exact8 = reference.mla_decode_paged_float64(case.q, cache8, case.block_table, case.cache_seqlens,
                                                k_scale=scale8, causal=causal)
    out, lse = calls["FlashInfer bf16"]()
    out8, lse8 = calls["FlashInfer fp8"]()
    assert lse is None and lse8 is None and out.dtype == out8.dtype == torch.bfloat16
    assert out.shape == out8.shape == exact[0].shape
    assert errors(out, None, *exact)[0] < 5e-3  # bf16 rounding of the output only
    assert errors(out8, None, *exact8)[0] < 5e-3  # the fp8 copy's own exact attention, scale applied
    assert errors(torch.zeros_like(out), None, *exact)[0] == 1.0  # the check sees a provider of zeros


@pytest.mark.parametrize("s_q, causal, page", [(1, False, 16), (2, True, 64)])
def test_flashinfer_on_pages_of_one_token_gives_the_same_attention(s_q, causal, page):
    """SGLang's layout: the same caches seen as pages of one token, a block table of token ids."""
    case = flashinfer_case(s_q, causal, page)
    cache8, scale8 = fp8_copy(case.k_cache)
    calls = flashinfer_token_calls(flashinfer_double, case, cache8, scale8)
    assert set(calls) == {"FlashInfer bf16 p1", "FlashInfer fp8 p1"}
    exact = reference.mla_decode_paged_float64(case.q, case.k_cache, case.block_table, case.cache_seqlens,
                                               causal=causal)
    exact8 = reference.mla_decode_paged_float64(case.q, cache8, case.block_table, case.cache_seqlens,
                                                k_scale=scale8, causal=causal)
    assert errors(calls["FlashInfer bf16 p1"]()[0], None, *exact)[0] < 5e-3
    assert errors(calls["FlashInfer fp8 p1"]()[0], None, *exact8)[0] < 5e-3


def test_flashinfer_calls_return_a_new_output_on_every_call():
    case = flashinfer_case(1, False, 16)
    calls = flashinfer_calls(flashinfer_double, case, *fp8_copy(case.k_cache))
    for name in ("FlashInfer bf16", "FlashInfer fp8"):
        first, second = calls[name]()[0], calls[name]()[0]
        assert first.data_ptr() != second.data_ptr() and torch.equal(first, second), name


def test_flashinfer_pages_list_each_requests_used_blocks_in_order():
    table = torch.tensor([[7, 3, 9, -1], [2, 8, 5, 4], [6, -1, -1, -1]], dtype=torch.int32)
    kv_indptr, kv_indices = flashinfer_pages(table, torch.tensor([33, 64, 0], dtype=torch.int32), 16)
    assert kv_indptr.tolist() == [0, 3, 7, 7] and kv_indices.tolist() == [7, 3, 9, 2, 8, 5, 4]
    assert kv_indptr.dtype == kv_indices.dtype == torch.int32


def double_plan(kv_pages=1, kv_dtype=torch.bfloat16, scale_mode="default"):
    wrapper = flashinfer_double.mla.BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8))
    index = dict(dtype=torch.int32)
    metadata = flashinfer_double.MLAPlanMetadata.csr(
        torch.tensor([0, 1], **index), torch.tensor([0, kv_pages], **index), torch.tensor([5] * kv_pages, **index),
        torch.tensor([40], **index))
    wrapper.plan(metadata=metadata, num_heads=4, head_dim_ckv=512, head_dim_kpe=64, page_size=16, causal=False,
                 sm_scale=0.1, q_data_type=torch.bfloat16, kv_data_type=kv_dtype, scale_mode=scale_mode)
    return wrapper


def test_the_double_rejects_a_page_list_that_does_not_hold_the_lengths():
    with pytest.raises(ValueError, match="kv_indptr"):
        double_plan(kv_pages=1)  # 40 tokens on pages of 16: 3 pages
    double_plan(kv_pages=3)


def test_the_double_holds_the_fp8_cache_to_its_scale_mode_and_scales():
    with pytest.raises(ValueError, match="scale_mode"):
        double_plan(kv_pages=3, kv_dtype=torch.float8_e4m3fn)  # FlashInfer 0.7.4 refuses fp8 at "default"
    with pytest.raises(ValueError, match="scale_mode"):
        double_plan(kv_pages=3, scale_mode="kv-per-tensor")  # and a bf16 cache with scales
    wrapper = double_plan(kv_pages=3, kv_dtype=torch.float8_e4m3fn, scale_mode="kv-per-tensor")
    query = torch.zeros(1, 4, 576, dtype=torch.bfloat16)
    cache = torch.zeros(6, 16, 576).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="ckv_scale"):
        wrapper.run(query=query, kv_cache=cache)
    with pytest.raises(ValueError, match="ckv_scale"):
        wrapper.run(query=query, kv_cache=cache, ckv_scale=0.5, kpe_scale=float("nan"))
    with pytest.raises(ValueError, match="kv_cache"):
        wrapper.run(query=query, kv_cache=(cache[..., :512], cache[..., 512:]), ckv_scale=0.5, kpe_scale=0.5)
    assert wrapper.run(query=query, kv_cache=cache, ckv_scale=0.5, kpe_scale=0.5).shape == (1, 4, 512)
    with pytest.raises(TypeError):  # the deprecated positional form is not modelled
        wrapper.run(query, cache)


def test_grid_s_is_the_long_request_among_short_ones():
    cases = grid_cases(["S"], skip_32k=True)
    assert cases == [("S", 128, 1, h_q, 1024, False, False, 65536) for h_q in (16, 128)]
    assert all(case[-1] == 0 for case in grid_cases(["A", "B", "C"], skip_32k=True))
    assert len(grid_cases(["A", "B", "C"], skip_32k=False)) == 2 * 2 * 4 + 8


class _Capture:
    """torch.cuda.graph's stand-in: records the capture's begin and end (or fails at its begin)."""

    def __init__(self, graph, events, fail=False):
        self.events, self.fail = events, fail
        events.append("capture")

    def __enter__(self):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.events.append("begin")

    def __exit__(self, *exc):
        self.events.append("end")


def _fake_graphs(monkeypatch, events, fail=False):
    class Graph:
        def replay(self):
            events.append("replay")
    times = iter([5000.0, 7000.0, 6000.0])

    def time_call(fn, device, flush):
        events.append("flush")
        fn()
        return None, next(times)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: _Capture(graph, events, fail))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(serving_peers.utils, "time_call", time_call)


def test_graph_times_capture_once_after_the_warmup_then_time_each_replay(monkeypatch):
    events = []
    _fake_graphs(monkeypatch, events)
    assert graph_times(lambda: events.append("call"), 3, None) == (6.0, 6.0)  # us: median and mean
    assert events == ["call", "call", "capture", "begin", "call", "end"] + ["flush", "replay"] * 3


def test_a_provider_that_cannot_be_captured_raises_for_the_caller_to_say(monkeypatch):
    events = []
    _fake_graphs(monkeypatch, events, fail=True)
    with pytest.raises(RuntimeError, match="capturing"):
        graph_times(lambda: events.append("call"), 3, None)
    assert "replay" not in events


def test_the_fastest_peer_is_chosen_over_the_cases_ours_ran():
    def row(grid, provider, s_k, gpu):
        return {"grid": grid, "provider": provider, "batch": 128, "s_q": 1, "h_q": 128, "s_k": s_k, "long": 0,
                "gpu_us": gpu}
    rows = [row("A", "ours bf16", 4096, 100.0), row("A", "ours bf16", 8192, 200.0),
            row("A", "FlashMLA bf16", 4096, 80.0), row("A", "FlashMLA bf16", 8192, 160.0),
            row("A", "FA3 bf16", 4096, 50.0),  # fastest, but missed a case: not a candidate
            row("A", "FlashInfer bf16 p1", 4096, 90.0), row("A", "FlashInfer bf16 p1", 8192, 150.0),
            row("A", "ours fp8", 4096, 50.0), row("A", "vLLM fp8 fork", 4096, 60.0)]
    lines = fastest_peer_lines(rows)
    assert len(lines) == 2
    assert lines[0].startswith("grid A bf16: fastest peer FlashMLA bf16") and lines[0].endswith("0.80x")
    assert lines[1].startswith("grid A fp8: fastest peer vLLM fp8 fork") and lines[1].endswith("1.20x")


def test_provider_times_gives_every_field_and_nan_for_what_cannot_be_measured(monkeypatch, capsys):
    def no_profile(*args):
        raise RuntimeError("expected 2 flushes")

    def no_graph(*args):
        raise RuntimeError("capture failed")
    monkeypatch.setattr(serving_peers, "kernel_times", lambda fn, repeats, flush: (10.0, 11.0))
    monkeypatch.setattr(serving_peers, "profiler_times", no_profile)
    monkeypatch.setattr(serving_peers, "host_time", lambda fn, repeats, busy=False: 30.0 if busy else 20.0)
    monkeypatch.setattr(serving_peers, "graph_times", no_graph)
    times = serving_peers.provider_times(None, 2, 3, None, "A b1: ours bf16")
    nan = [k for k, v in times.items() if v != v]
    assert sorted(nan) == ["gpu_mean_us", "gpu_us", "graph_mean_us", "graph_us"]
    assert (times["median_us"], times["mean_us"], times["host_us"], times["host_busy_us"], times["kernels_us"]) == \
        (10.0, 11.0, 20.0, 30.0, {})
    said = capsys.readouterr().out
    assert "A b1: ours bf16 profiler: expected 2 flushes" in said and "A b1: ours bf16 graph:" in said
    assert "host_busy_us" not in serving_peers.provider_times(None, 2, 3, None, "x", busy=False)
