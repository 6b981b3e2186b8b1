"""Small shared helpers: the process environment, seeds, devices, L2 flush, the runner's timing,
spec-file parsing.

Nothing here knows about MLA; reference.py, eval.py and tune.py build on it. eval.py and tune.py
both prepare their process with ``prepare_environment`` and time calls with ``time_repeats``, so
that the two tools measure the same way.
"""
import dataclasses
import math
import os
import random
import re
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

REPO_DIR = os.path.dirname(os.path.abspath(__file__))

# ---------------------------------------------------------------------------------------------
# The process environment


def prepare_environment() -> None:
    """Make this process ready to import and run a submission; call it before the import.

    - The repository goes first on sys.path: a submission imports ``task`` and ``reference`` by
      name, and they must be this repository's even when the submission lives elsewhere.
    - Without a GPU, Triton kernels run in the interpreter: TRITON_INTERPRET=1 must be set before
      the submission's kernels are decorated (an explicit setting is kept).
    - The interpreter's own numerics bugs are patched (interpreter_fixes), or CPU results would
      measure them. A no-op on a GPU.
    """
    if REPO_DIR not in sys.path:
        sys.path.insert(0, REPO_DIR)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import interpreter_fixes

    interpreter_fixes.apply()


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
    """Wait for the GPU's queued work (nothing to wait for on the CPU): outputs are checked and
    times read only once the work is done."""
    device = get_device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# L2 flush

RUNNER_FLUSH_SHAPE = (16000, 1024, 1024)  # the runner's float32 randn tensor: 62.5 GiB
RUNNER_FLUSH_BYTES = 4 * math.prod(RUNNER_FLUSH_SHAPE)
GIB = float(1 << 30)
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


_RUNNER_FLUSH: Dict[int, torch.Tensor] = {}  # device index -> the last runner flush, held until the next


class FlushDoesNotFit(RuntimeError):
    """The runner's flush cannot be allocated beside what this process holds on this GPU."""


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _runner_flush_fits(device: torch.device) -> bool:
    """Whether the device has room for a new runner flush now, after giving PyTorch's cached
    blocks back when it has not (empty_cache synchronizes: call it with nothing being timed)."""
    if torch.cuda.mem_get_info(device)[0] >= RUNNER_FLUSH_BYTES:
        return True
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0] >= RUNNER_FLUSH_BYTES


def _runner_flush_too_large(device: torch.device) -> str:
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_allocated(device)
    return (f"the runner's L2 flush does not fit on this GPU: it is a {'x'.join(map(str, RUNNER_FLUSH_SHAPE))} "
            f"float32 randn ({RUNNER_FLUSH_BYTES / GIB:.2f} GiB) allocated before each timed call, and "
            f"{free / GIB:.2f} GiB of the card's {total / GIB:.2f} GiB are free ({held / GIB:.2f} GiB held by "
            f"this process's tensors: the inputs and whatever else is alive; the rest by the CUDA context "
            f"and other processes). The runner's MI355X (288 GB) holds it; here use the default flush "
            f"(--l2-flush default: 4x the L2 zeroed, which hides less host time) or a larger card.")


def runner_flush_note(device: Union[None, str, torch.device] = None) -> Optional[str]:
    """None when the runner's flush fits on the device now (or one is held already, or no GPU),
    else FlushDoesNotFit's sentence with the sizes: say so before timing anything."""
    device = get_device(device)
    if device.type != "cuda" or _cuda_index(device) in _RUNNER_FLUSH or _runner_flush_fits(device):
        return None
    return _runner_flush_too_large(device)


class L2Flusher:
    """Evicts the GPU caches before a timed call.

    mode "default": zero a preallocated buffer of ``default_flush_bytes`` (4x L2, >= 512 MiB);
    mode "runner": what the leaderboard's runner does before each timed call, a 16000x1024x1024
    float32 randn tensor (62.5 GiB) written on the GPU, only enqueued (the host does not wait);
    mode "none" (and any mode on the CPU): do nothing.

    Runner mode on a card that cannot hold two of them (an 80 GB H100): the runner frees its tensor
    at once and its caching allocator keeps the 62.5 GiB block; any allocation made before the
    next flush (the call's output, the next inputs) may then take a piece of that block, and the
    next flush finds no 62.5 GiB anywhere. So the tensor is held (one per device, shared by every
    flusher of the process) until the next flush, which lets it go just before it allocates: the
    allocator hands the same whole block back, nothing else can have split it, and two flushes
    never coexist. The GPU work, its order and where the host stops waiting are the runner's; only
    where the block sits between flushes differs, which nothing timed sees. The untimed work
    between flushes has the card less 62.5 GiB; ``release()`` gives the block back to the device
    (eval.py and the bench tools call it after each case or shape, eval.py's leaderboard mode also
    before each check, whose new input and check then have the whole card). A new block is
    allocated only where the device has room, after giving PyTorch's cached blocks back if it has
    not; a flush that does not fit beside this process's tensors even then raises FlushDoesNotFit,
    with the sizes.
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
            return RUNNER_FLUSH_BYTES
        return 0

    def __call__(self) -> None:
        if self.mode == "default":
            self.buffer.zero_()
        elif self.mode == "runner":
            self._runner_flush()

    def _runner_flush(self) -> None:
        """Called with the GPU idle (time_call synchronizes first), before the timed region."""
        index = _cuda_index(self.device)
        reuses = _RUNNER_FLUSH.pop(index, None) is not None  # let go: its whole block is free again
        # no block of ours to reuse: the device must have room for a new one (cached blocks of
        # earlier work are given back first when it has not: the GPU is idle, nothing is timed)
        if not reuses and not _runner_flush_fits(self.device):
            raise FlushDoesNotFit(_runner_flush_too_large(self.device))
        try:
            _RUNNER_FLUSH[index] = torch.randn(RUNNER_FLUSH_SHAPE, dtype=torch.float32, device=self.device)
        except torch.cuda.OutOfMemoryError as exc:
            raise FlushDoesNotFit(_runner_flush_too_large(self.device)) from exc

    def release(self) -> None:
        """Give the held runner flush back to the device (runner mode; a no-op otherwise or when
        none is held). Call it outside the timed region, e.g. after a case's timed loop."""
        if self.mode == "runner" and _RUNNER_FLUSH.pop(_cuda_index(self.device), None) is not None:
            torch.cuda.empty_cache()


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


# the runner's stop rule: at least 3 repeats; then stop at a standard error under 0.1% of the mean,
# 50 s of measured time (benchmark mode; leaderboard mode uses 30 s) or 120 s of wall time
RUNNER_MIN_RUNS = 3
RUNNER_REL_ERR = 1e-3
RUNNER_MAX_TIME_NS = 50e9
RUNNER_MAX_WALL_NS = 120e9


def should_stop(durations: Sequence[float], wall_ns: float, *, min_runs: int = RUNNER_MIN_RUNS,
                rel_err: float = RUNNER_REL_ERR, max_time_ns: float = RUNNER_MAX_TIME_NS,
                max_wall_ns: float = RUNNER_MAX_WALL_NS) -> bool:
    """The runner's stop rule: after at least ``min_runs`` repeats, stop when the standard error of
    the mean is under ``rel_err`` of the mean, or the measured time passes ``max_time_ns``, or the
    wall time passes ``max_wall_ns``."""
    if len(durations) < min_runs:
        return False
    stats = calculate_stats(durations)
    if stats.mean > 0 and stats.err / stats.mean < rel_err:
        return True
    return stats.mean * stats.runs > max_time_ns or wall_ns > max_wall_ns


def time_repeats(fn: Callable, device: Union[None, str, torch.device] = None,
                 flush: Optional[Callable[[], None]] = None, *, max_repeats: int,
                 max_time_ns: float = RUNNER_MAX_TIME_NS,
                 max_wall_ns: float = RUNNER_MAX_WALL_NS, min_runs: int = RUNNER_MIN_RUNS,
                 warm_up: bool = False, before: Optional[Callable[[], None]] = None,
                 after: Optional[Callable[[object], Optional[str]]] = None,
                 ) -> Tuple[List[float], Optional[str]]:
    """The runner's timed loop around ``fn()``, shared by eval.py and tune.py.

    ``warm_up``: one untimed call first, then synchronize. Each repeat (at most ``max_repeats``):
    ``before()`` untimed (e.g. make a new input), then ``time_call(fn, device, flush)`` (synchronize,
    flush, events around ONE call), then ``after(result)`` untimed (e.g. check the output: a
    returned message ends the loop); stops by ``should_stop`` with the given limits.
    Returns (durations in ns, the message ``after`` returned, or None)."""
    if warm_up:
        fn()
        synchronize(device)
    durations: List[float] = []
    wall0 = time.perf_counter_ns()
    for _ in range(max_repeats):
        if before is not None:
            before()
        result, ns = time_call(fn, device, flush)
        failure = after(result) if after is not None else None
        del result  # the output is freed before the next call, as in the runner
        if failure is not None:
            return durations, failure
        durations.append(ns)
        if should_stop(durations, time.perf_counter_ns() - wall0, min_runs=min_runs,
                       max_time_ns=max_time_ns, max_wall_ns=max_wall_ns):
            break
    return durations, None


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
_INT_LIST = re.compile(r"^[+-]?\d+(?:\s*[,\s]\s*[+-]?\d+)+$")

# Fields of a case that are sizes (at least 1), and the field that lists per-batch KV lengths.
SIZE_FIELDS = ("batchsize", "qseqlen", "kvseqlen")
KV_LENS_FIELD = "kv_lens"


def parse_value(text: str):
    """ints stay ints; several ints separated by spaces or commas (``1 7 20``, ``1,7,20``) become a
    list of ints; true/false become bools; anything else stays a (stripped) string."""
    text = text.strip()
    if _INT.match(text):
        return int(text)
    if _INT_LIST.match(text):
        return [int(x) for x in re.split(r"[,\s]+", text)]
    if text.lower() == "true":
        return True
    if text.lower() == "false":
        return False
    return text


def check_case_args(args: Dict[str, object], where: str = "") -> Dict[str, object]:
    """Refuse a case that ``reference.generate_input`` cannot make, naming the field.

    Sizes (batchsize, qseqlen, kvseqlen) must be integers >= 1; ``kv_lens`` (ragged lengths) must
    be integers >= 1, one per batch; ``seed`` an integer. With ``kv_lens`` and no ``kvseqlen``,
    kvseqlen becomes the longest length (generate_input takes it, and ignores it given kv_lens).
    Fields this function does not know pass unchanged. Returns ``args``; ``where`` (e.g. the spec
    line) is added to the message."""
    suffix = f" in {where}" if where else ""
    for field in SIZE_FIELDS:
        if field in args:
            value = args[field]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{field} must be an integer >= 1, got {value!r}{suffix}")
            if value < 1:
                raise ValueError(f"{field} must be >= 1, got {value}{suffix}")
    if "seed" in args and (isinstance(args["seed"], bool) or not isinstance(args["seed"], int)):
        raise ValueError(f"seed must be an integer, got {args['seed']!r}{suffix}")
    if KV_LENS_FIELD in args:
        lens = args[KV_LENS_FIELD]
        if isinstance(lens, int) and not isinstance(lens, bool):
            lens = [lens]
        if not isinstance(lens, (list, tuple)) or not all(
                isinstance(n, int) and not isinstance(n, bool) for n in lens):
            raise ValueError(f"kv_lens must be integers separated by spaces, got {lens!r}{suffix}")
        bad = [n for n in lens if n < 1]
        if bad:
            raise ValueError(f"kv_lens must all be >= 1, got {bad[0]} in {list(lens)}{suffix}")
        if "batchsize" in args and len(lens) != args["batchsize"]:
            raise ValueError(f"kv_lens needs one length per batch (batchsize {args['batchsize']}), "
                             f"got {len(lens)}{suffix}")
        args[KV_LENS_FIELD] = list(lens)
        args.setdefault("kvseqlen", max(lens))
    return args


def parse_spec_line(line: str) -> Dict[str, object]:
    """``"batchsize: 4; qseqlen: 1"`` -> ``{"batchsize": 4, "qseqlen": 1}``; ragged lengths as
    ``kv_lens: 1 7 20``. Sizes are checked (``check_case_args``): a ValueError names the field."""
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
    return check_case_args(args, f"line {line!r}")


BENCHMARK_SPEC = os.path.join(REPO_DIR, "specs", "benchmarks.txt")


def benchmark_shapes(path: str = BENCHMARK_SPEC) -> List[tuple]:
    """(batch size, KV length) of each case of a spec file: by default the leaderboard's 8
    benchmark shapes, in their order."""
    return [(case.args["batchsize"], case.args["kvseqlen"]) for case in read_spec_file(path)]


def read_spec_file(path: str, secret_seed: Optional[int] = None) -> List[TestCase]:
    """All cases of a spec file (blank lines and lines starting with '#' are skipped). With
    ``secret_seed`` every case's seed becomes ``combine_seed(seed, secret_seed)``.

    The one reader of spec files for eval.py, tune.py and bench/: each case's ``args`` are
    ``generate_input``'s keyword arguments (``batchsize``, ``qseqlen``, ``kvseqlen``, ``seed``,
    and ``kv_lens`` for ragged lengths). A bad line raises ValueError naming the file, the line
    number and the field."""
    cases = []
    with open(path) as f:
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            try:
                args = parse_spec_line(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
            if secret_seed is not None and "seed" in args:
                args["seed"] = combine_seed(args["seed"], secret_seed)
            cases.append(TestCase(args=args, spec=line))
    return cases


def secret_seed_from_env(env=None) -> Optional[int]:
    """POPCORN_SEED as an int, or None when unset/empty."""
    env = os.environ if env is None else env
    value = env.get("POPCORN_SEED", "").strip()
    return int(value) if value else None
