"""bench/serving_peers.py's profiler time per call: the flushes split the profile, nothing guessed."""
import pytest

from bench.serving_peers import split_calls, within

FLUSH = ["fill"]


def test_each_call_sums_its_own_kernels_between_flushes():
    kernels = [("fill", 0, 50), ("split", 60, 10), ("combine", 75, 2),
               ("fill", 100, 50), ("split", 160, 12), ("combine", 175, 3)]
    assert split_calls(kernels, 2, FLUSH) == [12, 15]


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
