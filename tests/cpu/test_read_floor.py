"""bench/read_floor.py: the read-once floor kernel must read every word (a kernel that skipped
bytes would report a floor too low), across program boundaries and a ragged last block.

The kernel runs where the tests run: on the GPU when there is one (Triton cannot launch on CPU
tensors there), else on the CPU under the interpreter (tests/conftest.py sets TRITON_INTERPRET)."""
import torch

import reference
import utils
from bench import read_floor

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


def test_read_once_sees_every_word_of_every_block():
    device = utils.get_device()
    words = torch.randint(INT32_MIN, INT32_MAX - 200, (3 * 1024 + 17,), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(0)).to(device)
    for position in (0, 1023, 1024, 2049, words.numel() - 1):  # first, block edges, ragged tail
        probe = words.clone()
        probe[position] = INT32_MAX
        for policy in ("", "evict_first"):
            out = torch.full((1,), INT32_MIN, dtype=torch.int32, device=device)
            assert read_floor.read_once(probe, out, block=1024, eviction_policy=policy).item() == INT32_MAX, \
                (position, policy)


def test_read_once_max_is_the_max_of_the_words():
    """Not only the planted extreme: the folded max equals torch's over every block."""
    device = utils.get_device()
    words = torch.randint(INT32_MIN, 0, (2 * 1024 + 5,), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(1)).to(device)
    out = torch.full((1,), INT32_MIN, dtype=torch.int32, device=device)
    assert read_floor.read_once(words, out, block=1024).item() == words.max().item()


def test_cache_words_are_the_fp8_cache_bytes():
    kv_fp8 = reference.generate_input(2, 1, 40, 3, device="cpu")[1]["fp8"][0]
    words = read_floor.cache_words(kv_fp8)
    assert words.shape == (80, 1, 144) and words.dtype == torch.int32
    assert torch.equal(words.view(torch.uint8), kv_fp8.view(torch.uint8))
