"""bench/read_floor.py: the read-once floor kernel must read every word (a kernel that skipped
bytes would report a floor too low), across program boundaries and a ragged last block."""
import sys
from pathlib import Path

import torch

import reference

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import read_floor  # noqa: E402


def test_read_once_sees_every_word_of_every_block():
    words = torch.randint(-2**31, 2**31 - 200, (3 * 1024 + 17,), dtype=torch.int32)
    for position in (0, 1023, 1024, 2049, words.numel() - 1):  # first, block edges, ragged tail
        probe = words.clone()
        probe[position] = 2**31 - 1
        for policy in ("", "evict_first"):
            out = torch.full((1,), -2**31, dtype=torch.int32)
            assert read_floor.read_once(probe, out, block=1024, eviction_policy=policy).item() == 2**31 - 1, position


def test_cache_words_are_the_fp8_cache_bytes():
    kv_fp8 = reference.generate_input(2, 1, 40, 3, device="cpu")[1]["fp8"][0]
    words = read_floor.cache_words(kv_fp8)
    assert words.shape == (80, 1, 144) and words.dtype == torch.int32
    assert torch.equal(words.view(torch.uint8), kv_fp8.view(torch.uint8))
