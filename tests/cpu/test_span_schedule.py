"""The span schedule of the serving API's Hopper kernel (lab/NOTES.md h42), its arithmetic on the CPU:
tests/doubles/span_model.py computes what _span_start and _span_segment compute, integer for integer (the
kernel itself runs on an H100/H200 only: tests/gpu/test_serving_gpu.py runs it on cases this model
says take spans). What the merge needs must hold for any lengths: every token of a request in
exactly one split, splits numbered 0..n-1 with n <= 16 (the merge's widest layout), partial slots
unique, contiguous per request and below programs + batch (the plan's workspace)."""
import random

import pytest

from span_model import span_segments, takes_spans


def _cases(count, seed):
    rng = random.Random(seed)
    for _ in range(count):
        batch = rng.choice([1, 2, 3, 5, 17, 64, 128, 300])
        capacity = rng.choice([5000, 70000])
        lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(0, capacity), rng.randint(-5, capacity + 100)])
                for _ in range(batch)]
        yield lens, capacity, rng.choice([1, 4, 33, 132, 264]), rng.choice([64, 256, 512])


@pytest.mark.parametrize("segment_tiles", [0, 8])
@pytest.mark.parametrize("seed", range(4))
def test_every_token_in_one_split_and_slots_unique(seed, segment_tiles):
    for lens, capacity, programs, min_chunk in _cases(250, seed):
        segments = span_segments(lens, capacity, programs, min_chunk, segment_tiles=segment_tiles)
        by_request = {}
        for segment in segments:
            by_request.setdefault(segment["request"], []).append(segment)
        assert sorted(by_request) == list(range(len(lens))), "every request, empty or poisoned too, writes its rows"
        slots = [segment["slot"] for segment in segments]
        assert len(set(slots)) == len(slots) and max(slots) < programs + len(lens)
        for request, parts in by_request.items():
            splits = parts[0]["splits"]
            assert splits <= 16 and all(p["splits"] == splits for p in parts)
            assert sorted(p["split"] for p in parts) == list(range(splits))
            assert sorted(p["slot"] for p in parts) == list(range(parts[0]["slot"] - parts[0]["split"],
                                                                  parts[0]["slot"] - parts[0]["split"] + splits))
            length = lens[request] if 0 <= lens[request] <= capacity else 0  # poisoned: nothing read
            assert all(p["end"] <= length for p in parts), (request, parts)
            covered = 0
            for part in sorted(parts, key=lambda p: p["begin"]):
                if part["begin"] < length:
                    assert part["begin"] == covered, (request, parts)
                    covered = part["end"]
            assert covered == length, (request, parts)


def test_spread_lengths_take_spans_of_equal_tiles():
    """FlashMLA's benchmark lengths (128 requests, normal around 4096 with spread 2048): spans,
    every program an equal share of the batch's tiles within one tile."""
    rng = random.Random(0)
    lens = [int(max(rng.normalvariate(4096, 2048), 1)) for _ in range(128)]
    assert takes_spans(lens, max(lens), 264)
    tiles = {}
    for segment in span_segments(lens, max(lens), 264):
        tiles[segment["program"]] = tiles.get(segment["program"], 0) + -(-(segment["end"] - segment["begin"]) // 64)
    assert len(tiles) == 264 and max(tiles.values()) - min(tiles.values()) <= 1


def test_a_segments_cost_gives_programs_of_more_requests_fewer_tiles():
    """FlashMLA's benchmark lengths on grid A (128 requests around 4096, 66 programs a row group):
    with SEGMENT_TILES 8, a program's tiles plus 8 per segment (what it costs, if a segment costs
    8 tiles) is within 3% of the mean (1%), where equal tiles leave the program of most segments 12%
    above it (lab/NOTES.md h83); the spans' tiles are no longer equal."""
    rng = random.Random(1)
    lens = [int(max(rng.normalvariate(4096, 2048), 1)) for _ in range(128)]

    def cost(segment_tiles):
        per = {}
        for segment in span_segments(lens, max(lens), 66, segment_tiles=segment_tiles):
            tiles, count = per.get(segment["program"], (0, 0))
            per[segment["program"]] = (tiles + -(-(segment["end"] - segment["begin"]) // 64), count + 1)
        costs = [tiles + 8 * count for tiles, count in per.values()]
        return max(costs) / (sum(costs) / len(costs)), max(t for t, _ in per.values()) - min(t for t, _ in per.values())

    assert takes_spans(lens, max(lens), 66) and takes_spans(lens, max(lens), 66, segment_tiles=8)
    (equal, spread_equal), (aware, spread_aware) = cost(0), cost(8)
    assert spread_equal <= 1 and spread_aware > 8
    assert aware < 1.03 and equal > 1.10, (aware, equal)


def test_a_segments_cost_keeps_a_few_short_requests_in_chunks():
    """Four one-tile requests: spans of a few units would each cost a whole segment, so with
    SEGMENT_TILES 8 the model keeps them in chunks (one each); the spans it would cut hold programs
    with no tile at all (a span within a request's first units), which run nothing."""
    assert not takes_spans([1, 1, 1, 1], 64, 132, segment_tiles=8)
    programs = {segment["program"] for segment in span_segments([1, 1, 1, 1], 64, 132, segment_tiles=8)}
    assert len(programs) == 4 and programs != set(range(4))


def test_one_long_request_among_short_ones_is_bound_by_sixteen_splits():
    """127 requests of 1k tokens and one of 64k: the long one may meet 16 programs at most (the
    merge's widest layout), in either schedule, so its 1024 tiles take 64 per program while the
    batch's share is 12: chunks, as the model finds (lab/NOTES.md h42: the limit left)."""
    lens = [1024] * 127 + [65536]
    assert not takes_spans(lens, 65536, 264)
    assert max(s["splits"] for s in span_segments(lens, 65536, 264) if s["request"] == 127) <= 16


def test_a_uniform_batch_takes_chunks_where_they_fit_one_wave():
    """FlashMLA's benchmark spreads lengths (spans); the leaderboard's uniform shapes take chunks
    where they fit one wave (h42: spans cut every request there and merge more)."""
    for batch, kv in ((4, 1024), (32, 1024), (32, 8192), (64, 8192), (256, 1024)):
        assert not takes_spans([kv] * batch, kv, 264), (batch, kv)
    assert takes_spans([kv for kv in (2000, 6000, 4000, 9000) for _ in range(32)], 9000, 264)
