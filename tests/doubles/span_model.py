"""The Hopper serving kernel's span schedule (submission._span_start, _span_segment; lab/NOTES.md h42)
in Python, integer for integer (the kernel also counts the warp's padding entries, which changes
nothing): which schedule a call takes, and the segments each program runs.
The kernel computes it on the GPU, where no test can watch it; this model lets the CPU tests hold
its arithmetic to what the merge needs (every token in exactly one split, at most 16 splits per
request, partial slots unique and below programs + batch) and lets the GPU tests know which path a
case exercises. segment_tiles: the kernel's SEGMENT_TILES, units each request counts before its
tiles (lab/NOTES.md h83)."""

TILE = 64


def cdiv(a, b):
    return -(-a // b)


def _passes(splits):
    return 0 if splits <= 1 else 4 if splits <= 4 else 8 if splits <= 8 else 16


def units_of(lens, capacity):
    """Each request's length as used (0 where negative or past capacity) and its tiles (at least 1)."""
    lengths = [0 if (n < 0 or n > capacity) else n for n in lens]
    return lengths, [max(cdiv(n, TILE), 1) for n in lengths]


def spans_used(units, programs, min_chunk, max_splits=16):
    total = sum(units)
    return max(1, min(programs, total // max(min_chunk // TILE, 1), (max_splits - 1) * total // max(units)))


def takes_spans(lens, capacity, programs, min_chunk=256, max_splits=16, segment_tiles=0):
    """Whether _span_start's cost model takes spans over chunks for these lengths."""
    lengths, tiles = units_of(lens, capacity)
    units = [t + segment_tiles for t in tiles]
    total, widest = sum(units), max(units)
    used = spans_used(units, programs, min_chunk, max_splits)
    chunk_tiles = cdiv(max(cdiv(sum(lengths), programs), cdiv(max(lengths), max_splits), min_chunk), TILE)
    splits = [max(cdiv(t, chunk_tiles), 1) for t in tiles]
    biggest = min(chunk_tiles, max(tiles)) + segment_tiles
    chunk_time = ((biggest if sum(splits) <= programs else cdiv(sum(tiles) + sum(splits) * segment_tiles, programs)
                   + biggest) * 8 + 3 * _passes(max(splits)))
    span_time = (cdiv(total, used) + segment_tiles) * 8 + 3 * _passes(min(cdiv(widest * used, total) + 1, max_splits))
    return span_time < chunk_time


def span_segments(lens, capacity, programs, min_chunk=256, max_splits=16, segment_tiles=0):
    """Every program's segments as the kernel runs them: dicts of program, request, split, splits,
    slot (the partial slot: first span + request + split), begin, end (tokens)."""
    lengths, tiles = units_of(lens, capacity)
    units = [t + segment_tiles for t in tiles]
    total = sum(units)
    used = spans_used(units, programs, min_chunk, max_splits)
    ends, acc = [], 0
    for u in units:
        acc += u
        ends.append(acc)
    starts = [e - u for e, u in zip(ends, units, strict=True)]
    out = []
    for program in range(programs):
        span_begin, span_end = program * total // used, (program + 1) * total // used
        request = sum(e <= span_begin for e in ends)
        segments = max(sum(s + segment_tiles < span_end for s in starts) - request, 0)
        unit_begin = sum(u for u, e in zip(units, ends, strict=True) if e <= span_begin)
        for _ in range(segments):
            tile_begin = unit_begin + segment_tiles
            tile_end = tile_begin + tiles[request]
            first = ((tile_begin + 1) * used - 1) // total
            last = (tile_end * used - 1) // total
            out.append({"program": program, "request": request, "split": program - first, "splits": last - first + 1,
                        "slot": first + request + program - first,
                        "begin": (max(span_begin, tile_begin) - tile_begin) * TILE,
                        "end": min((min(span_end, tile_end) - tile_begin) * TILE, lengths[request])})
            request, unit_begin = request + 1, tile_end
    return out
