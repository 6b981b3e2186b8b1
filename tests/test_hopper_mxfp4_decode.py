"""The Hopper MXFP4 route's e2m1 -> e4m3 decode, executed on the CPU: the two PTX blocks the kernel
inlines (submission._E2M1_TABLE_ASM and _E2M1_DECODE_ASM, read from submission.py itself) run on
a small interpreter of the PTX instructions they use, over every packed byte value and block
exponent, against reference.dequantize_mxfp4 (the format's definition). The kernel itself needs an
sm_90 GPU (bench/mxfp4_probe.py checks it end to end there)."""
import math
import re

import pytest
import torch

import reference
import submission

pytestmark = pytest.mark.skipif(not submission.HAVE_GLUON, reason="Triton without Gluon: no Hopper route")

MASK = 0xFFFFFFFF


def _f32(bits):
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


def _bits(value):
    return torch.tensor([value], dtype=torch.float32).view(torch.int32).item() & MASK


def _e4m3_satfinite(value):
    """cvt.rn.satfinite.e4m3x2.f32 for one value: round to nearest even, clamp to +-448."""
    value = max(-448.0, min(448.0, value))
    return torch.tensor([value], dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8).item()


def _prmt(a, b, selector):
    """prmt.b32 (default mode): byte i of the result is byte (s & 7) of {b, a}, or, when s & 8, that
    byte's sign replicated; s = nibble i of the selector."""
    pool = ((b & MASK) << 32) | (a & MASK)
    out = 0
    for i in range(4):
        s = (selector >> (4 * i)) & 0xF
        byte = (pool >> (8 * (s & 7))) & 0xFF
        if s & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a, b, c, lut):
    out = 0
    for bit in range(32):
        index = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> index) & 1) << bit
    return out


def run_ptx(asm, operands):
    """Execute asm (the subset of PTX the decode uses) with $i bound to operands[i] (32-bit ints,
    f32 as bits); returns the operand list after the block."""
    regs = {f"${i}": v for i, v in enumerate(operands)}

    def value(token):
        token = token.strip()
        if token in regs:
            return regs[token]
        if token.startswith("0f"):
            return int(token[2:], 16)
        return int(token, 0) & MASK

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dest, *src = [x.strip() for x in re.split(r",(?![^{]*})", args)]
        if op == "mov.b32" and src[0].startswith("{"):
            low, high = [value(x) for x in src[0].strip("{}").split(",")]
            result = (low & 0xFFFF) | ((high & 0xFFFF) << 16)
        elif op in ("mov.b32", "mov.f32"):
            result = value(src[0])
        elif op == "and.b32":
            result = value(src[0]) & value(src[1])
        elif op == "shl.b32":
            result = (value(src[0]) << value(src[1])) & MASK
        elif op == "shr.u32":
            result = value(src[0]) >> value(src[1])
        elif op == "prmt.b32":
            result = _prmt(value(src[0]), value(src[1]), value(src[2]))
        elif op == "lop3.b32":
            result = _lop3(value(src[0]), value(src[1]), value(src[2]), value(src[3]))
        elif op == "mul.f32":
            result = _bits(_f32(value(src[0])) * _f32(value(src[1])))
        elif op == "cvt.rn.satfinite.e4m3x2.f32":  # first source to the high byte
            result = (_e4m3_satfinite(_f32(value(src[0]))) << 8) | _e4m3_satfinite(_f32(value(src[1])))
        else:
            raise NotImplementedError(op)
        regs[dest] = result & MASK
    return [regs[f"${i}"] for i in range(len(operands))]


def decode_word(word_bytes, exponent):
    """The eight values (8w .. 8w+7 in order, float64) that the kernel's e4m3 bytes hold for one
    packed word (its 4 bytes, a uint8 tensor) of a block with exponent e - shift."""
    word = int.from_bytes(bytes(word_bytes.tolist()), "little")
    block_scale = (min(max(exponent + 127, 1), 254) << 23)
    table_low, table_high, _ = run_ptx(submission._E2M1_TABLE_ASM.value, [0, 0, block_scale])
    low, high, *_ = run_ptx(submission._E2M1_DECODE_ASM.value, [0, 0, word, table_low, table_high])
    e4m3 = [(low >> (8 * i)) & 0xFF for i in range(4)] + [(high >> (8 * i)) & 0xFF for i in range(4)]
    return torch.tensor(e4m3, dtype=torch.uint8).view(torch.float8_e4m3fn).double()


def test_decode_is_exact_for_every_code_and_the_documented_exponent_range():
    """Every pair of codes (all 256 packed bytes, four per word) at block exponents -8 .. 6: the
    e4m3 bytes equal the format's values exactly."""
    data = torch.arange(256, dtype=torch.uint8).reshape(64, 4)  # 64 words of 4 bytes
    for exponent in range(-8, 7):
        expected = reference.dequantize_mxfp4(
            data.reshape(1, 256).view(torch.float4_e2m1fn_x2),
            torch.full((1, 16), exponent + 127, dtype=torch.uint8), 1).reshape(64, 8)
        for w in range(64):
            got = decode_word(data[w], exponent)
            assert torch.equal(got, expected[w].double()), (exponent, w, got, expected[w])


def test_decode_of_golden_rows_from_aiters_quantiser(golden_mxfp4_path):
    """The golden vectors of tests/data (aiter's own packed bytes and scales: a zero row, a
    tiny one, a huge one, then ordinary ones) decode to their dequantised values, each row as its
    own cache with the kernel's exponent shift for it (_mxfp4_exponent_shift of max |x|). Blocks
    more than 14 binades below the row's largest flush towards 0, by less than 2^(shift - 9)."""
    golden = torch.load(golden_mxfp4_path)
    packed, scales = golden["fp4_packed_uint8"][:12], golden["scale_e8m0_uint8"][:12]
    expected = reference.dequantize_mxfp4(packed.view(torch.float4_e2m1fn_x2), scales, packed.shape[0])
    words = packed.reshape(packed.shape[0], 72, 4)
    exact = flushed = 0
    for row in range(packed.shape[0]):
        amax_bits = torch.tensor([golden["x_bf16"][row].float().abs().max().item()]).view(torch.int32).item()
        shift = ((amax_bits >> 23) & 255) - 127 - 6
        for w in range(72):
            exponent = scales[row, w // 4].item() - 127 - shift
            got = decode_word(words[row, w], exponent)
            want = expected[row, 8 * w:8 * w + 8].double()
            assert exponent <= 6, (row, w)  # the shift keeps every block at most 6 x 2^6
            if exponent >= -8:
                exact += 1
                assert torch.equal(got * 2.0 ** shift, want), (row, w)
            else:
                flushed += 1
                assert (got * 2.0 ** shift - want).abs().max() <= 2.0 ** (shift - 9), (row, w)
    assert exact >= 0.9 * (exact + flushed), (exact, flushed)
