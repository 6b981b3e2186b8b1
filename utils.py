"""Small shared helpers: seeds, devices, L2 flush, timing statistics, spec-file parsing.

Nothing here knows about MLA; reference.py and eval.py build on it.
"""
import dataclasses
import math
import os
import random
import re
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

# ---------------------------------------------------------------------------------------------
# Seeds and devices


def combine_seed(a: int, b: int) -> int:
    """The runner's combination of a case seed ``a`` with the secret seed ``b`` (Cantor pairing)."""
    a, b = int(a), int(b)
    return a + (a + b) * (a + b + 1) // 2


def set_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's global generators."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:  # numpy is optional
        pass
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def has_gpu() -> bool:
    """True when torch sees a CUDA or ROCm device."""
    return torch.cuda.is_available()


def get_device(device: Union[None, str, torch.device] = None) -> torch.device:
    """``device`` when given, else the first GPU (CUDA or ROCm) when there is one, else the CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda") if has_gpu() else torch.device("cpu")


def device_name(device: Union[None, str, torch.device] = None) -> str:
    """A human-readable name of the device, with the gfx architecture on ROCm."""
    device = get_device(device)
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    arch = getattr(props, "gcnArchName", "") if torch.version.hip else ""
    name = props.name + (f" ({arch})" if arch else "")
    return name


def synchronize(device: Union[None, str, torch.device] = None) -> None:
    device = get_device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# L2 flush

RUNNER_FLUSH_SHAPE = (16000, 1024, 1024)  # the runner's float32 randn tensor: 62.5 GiB
MIN_FLUSH_BYTES = 512 * 1024 * 1024  # covers MI355X's 256 MiB Infinity Cache as well as any L2


def l2_cache_bytes(device: Union[None, str, torch.device] = None) -> int:
    """The device's L2 size in bytes as torch reports it (0 on the CPU or when unknown)."""
    device = get_device(device)
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 0)


def default_flush_bytes(device: Union[None, str, torch.device] = None) -> int:
    """4x the L2, rounded up to a whole MiB, and at least 512 MiB (0 on the CPU)."""
    device = get_device(device)
    if device.type != "cuda":
        return 0
    mib = 1024 * 1024
    four_l2 = -(-4 * l2_cache_bytes(device) // mib) * mib
    return max(four_l2, MIN_FLUSH_BYTES)


class L2Flusher:
    """Evicts the GPU caches before a timed call.

    mode "default": zero a preallocated buffer of ``default_flush_bytes`` (4x L2, >= 512 MiB);
    mode "runner": exactly what the leaderboard's runner does, allocate a 16000x1024x1024 float32
    randn tensor (62.5 GiB) and free it; mode "none" (and any mode on the CPU): do nothing.
    """

    MODES = ("default", "runner", "none")

    def __init__(self, mode: str = "default", device: Union[None, str, torch.device] = None):
        if mode not in self.MODES:
            raise ValueError(f"unknown L2 flush mode {mode!r}; expected one of {self.MODES}")
        self.device = get_device(device)
        self.mode = mode if self.device.type == "cuda" else "none"
        self.buffer = None
        if self.mode == "default":
            nbytes = default_flush_bytes(self.device)
            self.buffer = torch.empty(nbytes // 4, dtype=torch.int32, device=self.device)

    @property
    def nbytes(self) -> int:
        if self.mode == "default":
            return self.buffer.numel() * 4
        if self.mode == "runner":
            return 4 * math.prod(RUNNER_FLUSH_SHAPE)
        return 0

    def __call__(self) -> None:
        if self.mode == "default":
            self.buffer.zero_()
        elif self.mode == "runner":
            # allocated, written and freed at once, as the runner's clear_l2_cache
            torch.randn(RUNNER_FLUSH_SHAPE, dtype=torch.float32, device=self.device)


# ---------------------------------------------------------------------------------------------
# Timing


@dataclasses.dataclass
class Stats:
    """Per-case timing statistics, the fields of the runner's Stats (times in nanoseconds)."""

    runs: int
    mean: float
    std: float
    err: float
    best: float
    worst: float


def calculate_stats(durations: Sequence[float]) -> Stats:
    """runs, mean, sample std (n-1), err = std/sqrt(runs), best, worst."""
    runs = len(durations)
    if runs == 0:
        raise ValueError("no durations")
    mean = sum(durations) / runs
    if runs > 1:
        var = sum((d - mean) ** 2 for d in durations) / (runs - 1)
    else:
        var = 0.0
    std = math.sqrt(var)
    return Stats(
        runs=runs,
        mean=float(mean),
        std=float(std),
        err=float(std / math.sqrt(runs)),
        best=float(min(durations)),
        worst=float(max(durations)),
    )


def time_call(fn: Callable, device: Union[None, str, torch.device] = None,
              flush: Optional[Callable[[], None]] = None):
    """Synchronize, flush, then time ONE call of ``fn()``.

    On a GPU: CUDA events around the call (host time inside the call counts whenever the GPU waits
    for it), synchronize after. On the CPU: perf_counter around the call.
    Returns ``(result, nanoseconds)``.
    """
    device = get_device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if flush is not None:
            flush()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        torch.cuda.synchronize(device)
        return result, start.elapsed_time(end) * 1e6
    if flush is not None:
        flush()
    t0 = time.perf_counter_ns()
    result = fn()
    return result, float(time.perf_counter_ns() - t0)


def median_time_us(fn: Callable, repeats: int, flush: Optional[Callable[[], None]] = None) -> float:
    """Median over ``repeats`` of time_call(fn) (one call each, flushed before), in microseconds."""
    return statistics.median(time_call(fn, flush=flush)[1] for _ in range(repeats)) / 1e3


def interleaved_median_us(calls: Dict[object, tuple], repeats: int) -> Dict[object, float]:
    """``{key: (fn, flush)}`` -> ``{key: median us of time_call(fn, flush=flush)}``. Each repeat times
    every call once, in turn, so that a drift of the machine falls on all of them alike (the way
    to compare versions in one run)."""
    times = {key: [] for key in calls}
    for _ in range(repeats):
        for key, (fn, flush) in calls.items():
            times[key].append(time_call(fn, flush=flush)[1] / 1e3)
    return {key: statistics.median(samples) for key, samples in times.items()}


def should_stop(durations: Sequence[float], wall_ns: float, *, min_runs: int = 3,
                rel_err: float = 1e-3, max_time_ns: float = 50e9,
                max_wall_ns: float = 120e9) -> bool:
    """The runner's stop rule: after at least ``min_runs`` repeats, stop when the standard error of
    the mean is under ``rel_err`` of the mean, or the measured time passes ``max_time_ns``, or the
    wall time passes ``max_wall_ns``."""
    if len(durations) < min_runs:
        return False
    stats = calculate_stats(durations)
    if stats.mean > 0 and stats.err / stats.mean < rel_err:
        return True
    return stats.mean * stats.runs > max_time_ns or wall_ns > max_wall_ns


def copy_bandwidth(device: Union[None, str, torch.device] = None, nbytes: Optional[int] = None,
                   repeats: int = 10) -> float:
    """Measured device-to-device copy bandwidth in GB/s (bytes read + bytes written)."""
    device = get_device(device)
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (128 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(repeats):
        _, ns = time_call(lambda: dst.copy_(src), device)
        times.append(ns)
    return 2.0 * nbytes / min(times)  # bytes per ns == GB/s


def geomean(values: Sequence[float]) -> float:
    values = [float(v) for v in values]
    if not values or any(v <= 0 or not math.isfinite(v) for v in values):
        return float("nan")
    return math.exp(sum(math.log(v) for v in values) / len(values))


# ---------------------------------------------------------------------------------------------
# Spec files: one case per line, `key: value` pairs separated by `;`


@dataclasses.dataclass
class TestCase:
    """One line of a spec file: ``args`` for generate_input and the line itself as ``spec``."""

    __test__ = False  # not a pytest class

    args: Dict[str, object]
    spec: str


_INT = re.compile(r"^[+-]?\d+$")


def parse_value(text: str):
    """ints stay ints, true/false become bools, anything else stays a (stripped) string."""
    text = text.strip()
    if _INT.match(text):
        return int(text)
    if text.lower() == "true":
        return True
    if text.lower() == "false":
        return False
    return text


def parse_spec_line(line: str) -> Dict[str, object]:
    """``"batchsize: 4; qseqlen: 1"`` -> ``{"batchsize": 4, "qseqlen": 1}``."""
    args: Dict[str, object] = {}
    for part in line.split(";"):
        part = part.strip()
        if not part:
            continue
        if ":" not in part:
            raise ValueError(f"bad spec item {part!r} in line {line!r}: expected 'key: value'")
        key, value = part.split(":", 1)
        key = key.strip()
        if not key:
            raise ValueError(f"empty key in spec line {line!r}")
        args[key] = parse_value(value)
    return args


BENCHMARK_SPEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "specs", "benchmarks.txt")


def benchmark_shapes(path: str = BENCHMARK_SPEC) -> List[tuple]:
    """(batch size, KV length) of each case of a spec file: by default the leaderboard's 8
    benchmark shapes, in their order."""
    return [(case.args["batchsize"], case.args["kvseqlen"]) for case in read_spec_file(path)]


def read_spec_file(path: str, secret_seed: Optional[int] = None) -> List[TestCase]:
    """All cases of a spec file (blank lines and lines starting with '#' are skipped). With
    ``secret_seed`` every case's seed becomes ``combine_seed(seed, secret_seed)``."""
    cases = []
    with open(path) as f:
        for raw in f:
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            args = parse_spec_line(line)
            if secret_seed is not None and "seed" in args:
                args["seed"] = combine_seed(args["seed"], secret_seed)
            cases.append(TestCase(args=args, spec=line))
    return cases


def secret_seed_from_env(env=None) -> Optional[int]:
    """POPCORN_SEED as an int, or None when unset/empty."""
    env = os.environ if env is None else env
    value = env.get("POPCORN_SEED", "").strip()
    return int(value) if value else None
