"""utils.py: the process environment, seeds, devices, L2 flush, the runner's timing, spec parsing
(ragged lengths, sizes checked)."""
import math
import os
import sys
import time

import pytest
import torch

import utils

LEADERBOARD_TESTS = [
    (4, 1024, 4220), (32, 1024, 5412), (64, 8192, 1360), (256, 8192, 9826)]
LEADERBOARD_BENCHMARKS = [
    (4, 1024, 4217), (4, 8192, 4220), (32, 1024, 5412), (32, 8192, 5415),
    (64, 1024, 1357), (64, 8192, 1360), (256, 1024, 9823), (256, 8192, 9826)]


def test_combine_seed_is_the_runners_formula():
    assert utils.combine_seed(0, 0) == 0
    assert utils.combine_seed(4220, 0) == 4220 + 4220 * 4221 // 2
    a, b = 1360, 987654321
    assert utils.combine_seed(a, b) == a + (a + b) * (a + b + 1) // 2
    assert isinstance(utils.combine_seed(3, 5), int)


def test_set_seed_makes_torch_repeatable():
    utils.set_seed(5)
    x = torch.randn(4)
    utils.set_seed(5)
    assert torch.equal(x, torch.randn(4))


def test_get_device():
    assert utils.get_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert utils.get_device().type == expected


def test_calculate_stats_fields():
    s = utils.calculate_stats([1.0, 2.0, 3.0, 6.0])
    assert s.runs == 4
    assert s.mean == pytest.approx(3.0)
    std = math.sqrt(((1 - 3) ** 2 + (2 - 3) ** 2 + 0 + (6 - 3) ** 2) / 3)  # sample std
    assert s.std == pytest.approx(std)
    assert s.err == pytest.approx(std / 2)
    assert (s.best, s.worst) == (1.0, 6.0)
    assert [f for f in vars(s)] == ["runs", "mean", "std", "err", "best", "worst"]
    single = utils.calculate_stats([7.0])
    assert single.std == 0.0 and single.err == 0.0


def test_should_stop_rule():
    assert not utils.should_stop([100.0, 100.0], 0)  # fewer than 3 runs never stops
    assert utils.should_stop([100.0] * 3, 0)  # err 0 < 0.1% of the mean
    noisy = [100.0, 200.0, 50.0, 300.0]
    assert not utils.should_stop(noisy, 0)
    assert utils.should_stop(noisy, 121e9)  # wall time
    assert utils.should_stop([20e9, 40e9, 10e9], 0)  # 50 s of measured time


def test_parse_spec_line_values():
    args = utils.parse_spec_line("batchsize: 4; qseqlen: 1; kvseqlen: 1024; seed: 4220")
    assert args == {"batchsize": 4, "qseqlen": 1, "kvseqlen": 1024, "seed": 4220}
    args = utils.parse_spec_line("a: true; b: False; c: fp8 ; d: -3;")
    assert args == {"a": True, "b": False, "c": "fp8", "d": -3}
    with pytest.raises(ValueError):
        utils.parse_spec_line("batchsize 4")


def test_read_spec_file_and_secret_seed(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("# comment\n\nbatchsize: 2; qseqlen: 1; kvseqlen: 16; seed: 10\n")
    (case,) = utils.read_spec_file(str(path))
    assert case.spec == "batchsize: 2; qseqlen: 1; kvseqlen: 16; seed: 10"
    assert case.args["seed"] == 10
    (case,) = utils.read_spec_file(str(path), secret_seed=99)
    assert case.args["seed"] == utils.combine_seed(10, 99)
    assert utils.secret_seed_from_env({"POPCORN_SEED": "42"}) == 42
    assert utils.secret_seed_from_env({}) is None


def _cases(path):
    return [(c.args["batchsize"], c.args["kvseqlen"], c.args["seed"])
            for c in utils.read_spec_file(str(path))]


def test_project_specs_match_the_leaderboard(repo_root):
    assert _cases(repo_root / "specs" / "tests.txt") == LEADERBOARD_TESTS
    assert _cases(repo_root / "specs" / "benchmarks.txt") == LEADERBOARD_BENCHMARKS
    for path in ("tests.txt", "benchmarks.txt", "cpu.txt"):
        for case in utils.read_spec_file(str(repo_root / "specs" / path)):
            assert set(case.args) == {"batchsize", "qseqlen", "kvseqlen", "seed"}
            assert case.args["qseqlen"] == 1


def test_cpu_specs_are_small_and_awkward(repo_root):
    cases = _cases(repo_root / "specs" / "cpu.txt")
    assert cases and all(1 <= bs <= 4 and 16 <= kv <= 300 for bs, kv, _ in cases)
    assert any(kv % 16 for _, kv, _ in cases) and any(kv % 64 for _, kv, _ in cases)


def test_l2_flusher_on_cpu_is_a_no_op():
    flusher = utils.L2Flusher("default", "cpu")
    assert flusher.mode == "none" and flusher.nbytes == 0
    flusher()
    assert utils.default_flush_bytes("cpu") == 0
    with pytest.raises(ValueError):
        utils.L2Flusher("bogus", "cpu")


def test_runner_flush_size_is_the_runners():
    assert utils.RUNNER_FLUSH_SHAPE == (16000, 1024, 1024)


# ---------------------------------------------------------------------------------------------
# The runner flush on a card that cannot hold two of them (issue 58: an 80 GB H100)

GIB = 1 << 30
H100_BYTES = int(79.19 * GIB)  # what torch reports for an 80 GB H100


class _Block:
    def __init__(self, size, live=False):
        self.size, self.live = size, live


class FakeCudaAllocator:
    """PyTorch's CUDA caching allocator, as far as the runner flush's failure needs it: a freed
    block stays cached in its segment; a request takes the smallest cached free block that holds
    it (the rest stays free in the same segment), else a new segment when the card has room, else,
    after releasing the segments with nothing live (as torch does before it gives up), out of
    memory. empty_cache releases the segments with nothing live."""

    def __init__(self, total):
        self.total = total
        self.segments = []  # each a list of blocks in address order
        self.live_flushes = 0  # runner flush tensors alive now
        self.flushes = []  # (shape, dtype, device, live flushes when it was asked for)
        self.calls = {"empty_cache": 0, "mem_get_info": 0}

    @property
    def reserved(self):
        return sum(b.size for seg in self.segments for b in seg)

    def allocated(self, device=None):
        return sum(b.size for seg in self.segments for b in seg if b.live)

    def _cached(self, nbytes):
        fits = [(b.size, si, bi) for si, seg in enumerate(self.segments) for bi, b in enumerate(seg)
                if not b.live and b.size >= nbytes]
        if not fits:
            return None
        _, si, bi = min(fits)
        block = self.segments[si][bi]
        if block.size > nbytes:  # split: the rest stays free in the same segment
            self.segments[si].insert(bi + 1, _Block(block.size - nbytes))
            block.size = nbytes
        block.live = True
        return block

    def _new_segment(self, nbytes):
        if self.total - self.reserved < nbytes:
            return None
        block = _Block(nbytes, live=True)
        self.segments.append([block])
        return block

    def _release_free_segments(self):
        self.segments = [seg for seg in self.segments if any(b.live for b in seg)]

    def alloc(self, nbytes):
        block = self._cached(nbytes) or self._new_segment(nbytes)
        if block is None:
            self._release_free_segments()
            block = self._new_segment(nbytes)
        if block is None:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes / GIB:.2f} GiB")
        return block

    def free(self, block):
        block.live = False
        for si, seg in enumerate(self.segments):
            if any(b is block for b in seg):
                merged = []
                for b in seg:
                    if merged and not b.live and not merged[-1].live:
                        merged[-1] = _Block(merged[-1].size + b.size)
                    else:
                        merged.append(b)
                self.segments[si] = merged

    def tensor(self, nbytes, flush=False):
        return _FakeCudaTensor(self, self.alloc(nbytes), flush)

    # the torch.cuda functions utils calls
    def empty_cache(self):
        self.calls["empty_cache"] += 1
        self._release_free_segments()

    def mem_get_info(self, device=None):
        self.calls["mem_get_info"] += 1
        return self.total - self.reserved, self.total

    def randn(self, *shape, dtype=None, device=None, **kwargs):
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        self.flushes.append((shape, dtype, torch.device(device), self.live_flushes))
        return self.tensor(4 * math.prod(shape), flush=True)


class _FakeCudaTensor:
    def __init__(self, allocator, block, flush):
        self.allocator, self.block, self.flush = allocator, block, flush
        allocator.live_flushes += flush

    def __del__(self):
        self.allocator.live_flushes -= self.flush
        self.allocator.free(self.block)


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA card of `total` bytes under the fake allocator: torch.randn (the flush), empty_cache,
    mem_get_info and memory_allocated go to it; no runner flush held at the start."""
    def card(total):
        fake = FakeCudaAllocator(total)
        monkeypatch.setattr(torch, "randn", fake.randn)
        monkeypatch.setattr(torch.cuda, "empty_cache", fake.empty_cache)
        monkeypatch.setattr(torch.cuda, "mem_get_info", fake.mem_get_info)
        monkeypatch.setattr(torch.cuda, "memory_allocated", fake.allocated)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(utils, "_RUNNER_FLUSH", {}, raising=False)
        return fake
    return card


def _cases_under_the_runner_flush(fake, flusher, case_bytes, release=False):
    """eval.py's / ab_probe's pattern: per case (shape) its inputs (the last case's let go after
    the new ones exist), then the runner's timed loop, each call making a 64 MiB output."""
    inputs = None
    for nbytes in case_bytes:
        inputs = fake.tensor(nbytes)  # noqa: F841  (held through the case, as the data is)
        durations, failure = utils.time_repeats(lambda: fake.tensor(64 << 20), "cpu", flusher, max_repeats=4,
                                                min_runs=4)
        assert failure is None and len(durations) == 4
        assert fake.reserved <= fake.total
        if release:
            flusher.release()


def test_runner_flush_fits_a_card_that_cannot_hold_two(fake_cuda):
    """The runner's tensor freed at once stays cached; the next case's inputs took a piece of it
    and the next flush found no 62.5 GiB on an 80 GB card (out of memory at the second case's
    first flush). Now each flush lets the last one go just before it allocates: the same whole
    block comes back, two never coexist, nothing else splits it."""
    fake = fake_cuda(H100_BYTES)
    flusher = utils.L2Flusher("runner", "cuda")
    _cases_under_the_runner_flush(fake, flusher, [1 * GIB, 3 * GIB, 2 * GIB, 5 * GIB])
    assert len(fake.flushes) == 16
    assert {(shape, dtype) for shape, dtype, _, _ in fake.flushes} == {(utils.RUNNER_FLUSH_SHAPE, torch.float32)}
    assert all(device.type == "cuda" for _, _, device, _ in fake.flushes)
    assert [live for *_, live in fake.flushes] == [0] * 16  # the last one let go before each new one
    assert fake.live_flushes == 1  # the last one held until the next flush (or release)
    # the room was checked before the first allocation only; nothing emptied when it fit
    assert fake.calls == {"empty_cache": 0, "mem_get_info": 1}


def test_runner_flushers_share_the_one_held_flush_and_release_gives_it_back(fake_cuda):
    """A flusher per case (eval.py) never holds a second 62.5 GiB beside another's; release()
    (after a case's timed loop, untimed) returns it to the device so the next inputs cannot land
    in it, and the next case's first flush allocates a new one."""
    fake = fake_cuda(H100_BYTES)
    first, second = utils.L2Flusher("runner", "cuda"), utils.L2Flusher("runner", "cuda")
    first()
    second()
    first()
    assert [live for *_, live in fake.flushes] == [0, 0, 0] and fake.live_flushes == 1
    second.release()
    assert fake.live_flushes == 0 and fake.reserved == 0 and fake.calls["empty_cache"] == 1
    second.release()  # nothing held: a no-op, no second empty_cache
    assert fake.calls["empty_cache"] == 1
    fake = fake_cuda(H100_BYTES)
    _cases_under_the_runner_flush(fake, utils.L2Flusher("runner", "cuda"), [1 * GIB, 3 * GIB, 2 * GIB],
                                  release=True)
    assert fake.live_flushes == 0 and fake.calls["empty_cache"] == 3
    assert [live for *_, live in fake.flushes] == [0] * 12
    utils.L2Flusher("default", "cpu").release()  # no-op off runner mode


def test_runner_flush_empties_the_cache_only_when_a_new_flush_needs_the_room(fake_cuda):
    """A cached 20 GiB left by earlier work: the first flush gives the cache back (the GPU is idle
    there: time_call synchronized, nothing is timed yet); later flushes reuse the held block and
    neither ask the device nor empty the cache."""
    fake = fake_cuda(H100_BYTES)
    inputs = fake.tensor(2 * GIB)
    scratch = fake.tensor(20 * GIB)
    del scratch  # cached, not given back
    flusher = utils.L2Flusher("runner", "cuda")
    flusher()
    assert fake.calls == {"empty_cache": 1, "mem_get_info": 2}
    for _ in range(5):
        flusher()
    assert fake.calls == {"empty_cache": 1, "mem_get_info": 2}
    assert fake.reserved == 2 * GIB + utils.RUNNER_FLUSH_BYTES
    del inputs


def test_runner_flush_on_a_card_too_small_says_so_with_the_sizes(fake_cuda):
    """64 GiB card, 2 GiB of inputs: no out-of-memory crash but FlushDoesNotFit naming the flush's
    size, the card's, what is free and what this process holds; runner_flush_note says it before
    anything is timed (and nothing on a card where it fits)."""
    fake = fake_cuda(64 * GIB)
    inputs = fake.tensor(2 * GIB)
    flusher = utils.L2Flusher("runner", "cuda")
    with pytest.raises(utils.FlushDoesNotFit) as caught:
        utils.time_call(lambda: None, "cpu", flush=flusher)
    text = str(caught.value)
    for part in ("16000x1024x1024 float32", "62.50 GiB", "62.00 GiB of the card's 64.00 GiB are free",
                 "2.00 GiB held by this process", "--l2-flush default"):
        assert part in text, (part, text)
    assert fake.flushes == [] and fake.calls["empty_cache"] == 1  # the cache given back before giving up
    assert utils.runner_flush_note("cuda") == text
    assert utils.runner_flush_note("cpu") is None
    del inputs
    fake = fake_cuda(H100_BYTES)
    fake.tensor(2 * GIB)
    assert utils.runner_flush_note("cuda") is None


def test_runner_flush_out_of_memory_anyway_becomes_the_clear_error(fake_cuda, monkeypatch):
    """Room reported but the allocation fails (another process took it meanwhile): the same error."""
    fake = fake_cuda(H100_BYTES)

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "randn", oom)
    with pytest.raises(utils.FlushDoesNotFit, match="62.50 GiB"):
        utils.L2Flusher("runner", "cuda")()
    assert fake.live_flushes == 0


def test_eval_gives_back_the_runner_flush_it_made_for_a_case(monkeypatch):
    """run_benchmark_case releases a flusher it made itself (the popcorn path: one per case),
    also when the loop fails; a flusher passed in is the caller's to release."""
    import eval as ev
    import reference

    made = []

    class Flusher:
        def __init__(self, mode="default", device=None):
            self.released = 0
            made.append(self)

        def __call__(self):
            pass

        def release(self):
            self.released += 1

    monkeypatch.setattr(utils, "L2Flusher", Flusher)
    sub = type("Sub", (), {"custom_kernel": staticmethod(reference.ref_kernel)})
    args = {"batchsize": 1, "qseqlen": 1, "kvseqlen": 16, "seed": 1}
    ev.run_benchmark_case(sub, dict(args), recheck=False, max_repeats=3, max_time_ns=1e9, device="cpu")
    assert [f.released for f in made] == [1]
    # leaderboard mode: also before each check, so the check and the next input have the whole card
    made.clear()
    ev.run_benchmark_case(sub, dict(args), recheck=True, max_repeats=3, max_time_ns=1e9, device="cpu")
    assert [f.released for f in made] == [3 + 1]

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(utils, "time_repeats", broken)
    with pytest.raises(RuntimeError):
        ev.run_benchmark_case(sub, dict(args), recheck=False, max_repeats=3, max_time_ns=1e9, device="cpu")
    assert [f.released for f in made] == [4, 1]
    mine = Flusher()
    monkeypatch.undo()
    monkeypatch.setattr(utils, "time_repeats", lambda *a, **k: ([1.0, 2.0, 3.0], None))
    ev.run_benchmark_case(sub, dict(args), recheck=False, max_repeats=3, max_time_ns=1e9, device="cpu",
                          flusher=mine)
    assert mine.released == 0


def test_time_call_on_cpu():
    calls = []
    result, ns = utils.time_call(lambda: calls.append(1) or 7, "cpu", flush=lambda: calls.append(0))
    assert result == 7 and calls == [0, 1] and ns >= 0


def test_time_repeats_order_of_steps():
    """warm-up call, then per repeat: before (untimed), flush + the timed call, after (untimed)."""
    log = []
    durations, failure = utils.time_repeats(
        lambda: log.append("call") or 7, "cpu", flush=lambda: log.append("flush"), max_repeats=3,
        warm_up=True, before=lambda: log.append("before"),
        after=lambda result: log.append(f"after {result}"))
    assert failure is None and len(durations) == 3 and all(ns >= 0 for ns in durations)
    assert log == ["call"] + ["before", "flush", "call", "after 7"] * 3


def test_time_repeats_stops_at_a_failed_after_and_by_the_stop_rule():
    results = iter(range(10))
    durations, failure = utils.time_repeats(
        lambda: next(results), "cpu", max_repeats=10,
        after=lambda r: "wrong output" if r == 2 else None)
    assert failure == "wrong output" and len(durations) == 2  # the failed repeat is not counted
    # 5 ms a call and at most 1 ms of measured time: the rule stops at its minimum of 3 repeats
    durations, failure = utils.time_repeats(lambda: time.sleep(0.005), "cpu",
                                            max_repeats=50, max_time_ns=1e6)
    assert failure is None and len(durations) == utils.RUNNER_MIN_RUNS
    durations, _ = utils.time_repeats(lambda: None, "cpu", max_repeats=50, max_time_ns=0,
                                      min_runs=7)
    assert len(durations) == 7


def test_eval_times_through_time_repeats(monkeypatch):
    """One timing loop: eval.py's reference timing and its benchmark case call utils.time_repeats
    (tune.py measures through submission.py's measuring processes, the race's own timing)."""
    import eval as ev
    import reference

    seen = []

    def fake(fn, device=None, flush=None, **kw):
        seen.append(kw)
        return [1.0, 2.0, 3.0], None

    monkeypatch.setattr(utils, "time_repeats", fake)
    ev._time_fn(lambda: None, "cpu", None, 5, 1e9)
    sub = type("Sub", (), {"custom_kernel": staticmethod(reference.ref_kernel)})
    stats = ev.run_benchmark_case(sub, {"batchsize": 1, "qseqlen": 1, "kvseqlen": 16, "seed": 1},
                                  recheck=True, max_repeats=5, max_time_ns=1e9, device="cpu")
    assert stats.runs == 3
    assert [kw["max_repeats"] for kw in seen] == [5, 5]
    assert seen[0]["warm_up"] and not seen[1].get("warm_up")
    assert seen[1]["before"] is not None and seen[1]["after"] is not None  # recheck hooks


def test_prepare_environment(monkeypatch):
    """The repository first on sys.path; the interpreter only without a GPU; an explicit
    TRITON_INTERPRET kept; safe to call again."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != utils.REPO_DIR])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    utils.prepare_environment()
    assert sys.path[0] == utils.REPO_DIR
    assert os.environ.get("TRITON_INTERPRET") == (None if torch.cuda.is_available() else "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    utils.prepare_environment()
    assert os.environ["TRITON_INTERPRET"] == "0" and sys.path.count(utils.REPO_DIR) == 1


def test_copy_bandwidth_and_geomean():
    assert utils.copy_bandwidth("cpu", nbytes=1 << 20, repeats=2) > 0
    assert utils.geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert math.isnan(utils.geomean([]))


def test_median_time_us_times_each_call_once_and_flushes_before_each():
    calls, flushes = [], []
    median = utils.median_time_us(lambda: calls.append(1), 5, flush=lambda: flushes.append(1))
    assert len(calls) == 5 and len(flushes) == 5
    assert median >= 0.0


def test_interleaved_median_us_takes_turns_and_flushes_each_call():
    order, flushes = [], []
    calls = {"a": (lambda: order.append("a"), lambda: flushes.append("a")),
             "b": (lambda: order.append("b"), None)}
    medians = utils.interleaved_median_us(calls, 3)
    assert order == ["a", "b"] * 3 and flushes == ["a"] * 3
    assert set(medians) == {"a", "b"} and all(m >= 0.0 for m in medians.values())


def test_benchmark_shapes_are_the_benchmark_spec_in_order():
    cases = utils.read_spec_file(utils.BENCHMARK_SPEC)
    assert utils.benchmark_shapes() == [(c.args["batchsize"], c.args["kvseqlen"]) for c in cases]
    assert utils.benchmark_shapes() == [(b, k) for b in (4, 32, 64, 256) for k in (1024, 8192)]


def test_spec_lines_take_ragged_lengths_separated_by_spaces_or_commas():
    args = utils.parse_spec_line("batchsize: 3; qseqlen: 1; kv_lens: 1 7 20; seed: 4")
    assert args == {"batchsize": 3, "qseqlen": 1, "kv_lens": [1, 7, 20], "seed": 4,
                    "kvseqlen": 20}  # kvseqlen: the longest, for generate_input's signature
    assert utils.parse_spec_line("batchsize: 3; qseqlen: 1; kvseqlen: 99; kv_lens: 1,7, 20; "
                                 "seed: 4")["kv_lens"] == [1, 7, 20]
    assert utils.parse_spec_line("batchsize: 1; qseqlen: 1; kv_lens: 5; seed: 4")["kv_lens"] == [5]
    assert utils.parse_value("1 7 20") == [1, 7, 20] and utils.parse_value("fp8 bf16") == "fp8 bf16"


@pytest.mark.parametrize("line,field", [
    ("batchsize: 0; qseqlen: 1; kvseqlen: 16; seed: 1", "batchsize must be >= 1, got 0"),
    ("batchsize: 2; qseqlen: 0; kvseqlen: 16; seed: 1", "qseqlen must be >= 1"),
    ("batchsize: 2; qseqlen: 1; kvseqlen: -5; seed: 1", "kvseqlen must be >= 1, got -5"),
    ("batchsize: 2; qseqlen: 1; kvseqlen: many; seed: 1", "kvseqlen must be an integer"),
    ("batchsize: 2; qseqlen: 1; kvseqlen: 16; seed: x", "seed must be an integer"),
    ("batchsize: 2; qseqlen: 1; kv_lens: 4 0; seed: 1", "kv_lens must all be >= 1, got 0"),
    ("batchsize: 2; qseqlen: 1; kv_lens: 4 -1; seed: 1", "kv_lens must all be >= 1, got -1"),
    ("batchsize: 2; qseqlen: 1; kv_lens: 1 7 20; seed: 1", "kv_lens needs one length per batch"),
    ("batchsize: 2; qseqlen: 1; kv_lens: 1, x; seed: 1", "kv_lens must be integers"),
])
def test_spec_lines_with_bad_sizes_name_the_field(line, field):
    with pytest.raises(ValueError, match=field):
        utils.parse_spec_line(line)


def test_read_spec_file_names_the_line_of_a_bad_case(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("batchsize: 2; qseqlen: 1; kvseqlen: 16; seed: 1\n"
                    "# ragged\nbatchsize: 3; qseqlen: 1; kv_lens: 1 7 20; seed: 2\n"
                    "batchsize: 2; qseqlen: 1; kvseqlen: 0; seed: 3\n")
    with pytest.raises(ValueError, match=r"s\.txt:4: kvseqlen must be >= 1"):
        utils.read_spec_file(str(path))
    path.write_text("batchsize: 3; qseqlen: 1; kv_lens: 1 7 20; seed: 2\n")
    (case,) = utils.read_spec_file(str(path), secret_seed=5)
    assert case.args["kv_lens"] == [1, 7, 20] and case.args["seed"] == utils.combine_seed(2, 5)


def test_a_ragged_spec_case_is_what_generate_input_makes(tmp_path):
    import reference

    args = utils.parse_spec_line("batchsize: 3; qseqlen: 1; kv_lens: 1 7 20; seed: 2")
    q, kv, qo, kv_indptr, config = reference.generate_input(**args, device="cpu")
    assert kv_indptr.tolist() == [0, 1, 8, 28] and config["kv_seq_len"] == 20
    assert q.shape[0] == 3 and kv["bf16"].shape[0] == 28
