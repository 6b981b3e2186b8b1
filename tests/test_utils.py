"""utils.py: seeds, devices, L2 flush, timing statistics, spec parsing."""
import math

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


def test_time_call_on_cpu():
    calls = []
    result, ns = utils.time_call(lambda: calls.append(1) or 7, "cpu", flush=lambda: calls.append(0))
    assert result == 7 and calls == [0, 1] and ns >= 0


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
