"""The double's public API, per aiter generation, presented as aiter presents it.

AITER_DOUBLE_GENERATION (read at import) picks one of GENERATIONS (or an alias of one). Its
parameter lists are data below, read from aiter's sources at the commit named.

How real aiter presents its compiled ops (aiter/jit/core.py compile_ops, aiter/jit/utils/
torch_guard.py torch_compile_guard), and so the double:
- the public function is `wrapper_custom(*args, **kwargs)`: inspect.signature shows nothing;
- the op's schema is defined in the torch library namespace `aiter` from the typed stub
  (torch.library.infer_schema, mutates_args="unknown"), so the parameter names can be read only
  as torch.ops.aiter.<name>.default._schema.arguments;
- a call goes through torch.ops: the dispatcher checks and coerces the arguments against the
  schema (a float for an int is refused, a bool passes as an int) and hands the kernel its
  arguments positionally with trailing defaults dropped.
Stage 1 is bound through ctypes from 7cce7fd70d (2026-03-20) on, still behind the same
registered op, so it looks the same. get_mla_metadata_info_v1 and mla_decode_fwd are plain Python
functions (their signatures read); so is get_mla_metadata_v1 from 028756633e (2026-07-14) on, a
wrapper over the compiled op _get_mla_metadata_v1_impl (torch.ops.aiter._get_mla_metadata_v1_impl;
torch.ops.aiter.get_mla_metadata_v1 no longer exists there).

A schema can be defined once per process, and aiter's op names are the same in every generation,
so each import defines its ops under private names (<name>__g<generation>_<n>) and points
torch.ops.aiter.<name> at them (PUBLIC_OPS lists those names; loader.aiter_environment removes the
pointers again when it restores the environment).
"""
import inspect
import os
from typing import Optional

import torch

from . import _double

T = torch.Tensor
OPT_T = Optional[torch.Tensor]
OPT_DTYPE = Optional[torch.dtype]
REQUIRED = inspect.Parameter.empty

# (name, annotation[, default]) in aiter's order. Each group names the commit that brought it
# (ROCm/aiter; dates are the commits' own, read on today's main, whose history upstream rewrote).
ANY = inspect.Parameter.empty  # mla_decode_fwd's parameters carry no annotations
STAGE1_HEAD = (
    ("Q", T), ("KV", T), ("qo_indptr", T), ("kv_indptr", T), ("kv_page_indices", T),
    ("kv_last_page_lens", T), ("num_kv_splits_indptr", OPT_T), ("work_meta_data", OPT_T),
    ("work_indptr", OPT_T), ("work_info_set", OPT_T), ("max_seqlen_q", int), ("page_size", int),
    ("nhead_kv", int), ("softmax_scale", float), ("splitData", T), ("splitLse", T),
)
STAGE1_OUTPUT = (("output", T),)
STAGE1_LSE = (("lse", OPT_T, None),)  # a235c4aa3a (2026-03-16)
STAGE1_SCALES = (("q_scale", OPT_T, None), ("kv_scale", OPT_T, None))
STAGE1_CONTEXT_PARALLEL = (  # 63c44c9a0d (2026-06-19); defaults only are modelled
    ("g_kv_indptr", OPT_T, None), ("cp_world_size", int, 1), ("cp_rank", int, 0),
)
STAGE1_VALID_SPLITS = (  # c2f68ab382 (2026-06-26); defaults only are modelled
    ("valid_split_count", OPT_T, None), ("use_valid_split_count_reduce", int, 0),
)
STAGE1_CAUSAL = (("causal", bool, True),)  # 45ef304fe5 (2026-08-10)
STAGE1_CU_MASK = (("cu_mask", T),)  # the unknown generation's new required argument
REDUCE_HEAD = (
    ("partial_output", T), ("partial_lse", T), ("reduce_indptr", T), ("reduce_final_map", OPT_T),
    ("reduce_partial_map", T), ("max_seqlen_q", int),
)
REDUCE_SPLITS = (("num_kv_splits", int),)  # ff61bb3997 (2026-06-11): no default
REDUCE_TAIL = (("final_output", T), ("final_lse", OPT_T, None))
METADATA_HEAD = (
    ("seqlens_qo_indptr", T), ("seqlens_kv_indptr", T), ("kv_last_page_lens", T),
    ("num_heads_per_head_k", int), ("num_heads_k", int), ("is_causal", bool),
    ("work_metadata_ptrs", T), ("work_info_set", T), ("work_indptr", T), ("reduce_indptr", T),
    ("reduce_final_map", T), ("reduce_partial_map", T), ("page_size", int, 1),
    ("kv_granularity", int, 16), ("max_seqlen_qo", int, -1), ("uni_seqlen_qo", int, -1),
    ("fast_mode", bool, True), ("topk", int, -1), ("max_split_per_batch", int, -1),
    ("intra_batch_mode", bool, False),
)
METADATA_POSITIONAL = 12  # the leading parameters without defaults
METADATA_DTYPES = (("dtype_q", OPT_DTYPE, None), ("dtype_kv", OPT_DTYPE, None))
METADATA_CP_ROUND_ROBIN = (("is_cp_round_robin", bool, False),)  # 63c44c9a0d; default only
MLA_VERSION = (("mla_version", int, 0),)  # fede90f463 (2026-07-13); MlaVersion.V32 is 0
SPLIT_DTYPE_NAMES = ("dtype_q_nope", "dtype_q_rope", "dtype_kv_nope", "dtype_kv_rope")
METADATA_SPLIT_DTYPES = tuple((name, OPT_DTYPE, None) for name in SPLIT_DTYPE_NAMES)
# the compiled op behind the Python get_mla_metadata_v1 (028756633e) takes aiter's dtype ids
METADATA_SPLIT_DTYPE_IDS = tuple((name, Optional[int], None) for name in SPLIT_DTYPE_NAMES)
INFO = (
    ("batch_size", int), ("max_seqlen_qo", int), ("num_head_qo", int), ("q_dtype", torch.dtype),
    ("kv_dtype", torch.dtype), ("is_sparse", bool), ("fast_mode", bool, True),
    ("num_kv_splits", int, 32), ("intra_batch_mode", bool, False),
)
INFO_SPLIT_CAP = (("max_split_per_batch", int, -1),)  # ff61bb3997
DECODE_FWD = (
    ("q", ANY), ("kv_buffer", ANY), ("o", ANY), ("qo_indptr", ANY), ("kv_indptr", ANY),
    ("kv_indices", ANY), ("kv_last_page_lens", ANY), ("max_seqlen_q", ANY),
    ("page_size", ANY, 1), ("nhead_kv", ANY, 1), ("sm_scale", ANY, None), ("logit_cap", ANY, 0.0),
    ("num_kv_splits", ANY, None), ("num_kv_splits_indptr", ANY, None),
    ("work_meta_data", ANY, None), ("work_indptr", ANY, None), ("work_info_set", ANY, None),
    ("reduce_indptr", ANY, None), ("reduce_final_map", ANY, None),
    ("reduce_partial_map", ANY, None), ("q_scale", ANY, None), ("kv_scale", ANY, None),
    ("intra_batch_mode", ANY, False), ("return_logits", ANY, False), ("return_lse", ANY, False),
)
DECODE_FWD_CONTEXT_PARALLEL = (  # 63c44c9a0d; defaults only are modelled
    ("g_kv_indptr", ANY, None), ("cp_world_size", ANY, 1), ("cp_rank", ANY, 0),
)
DECODE_FWD_CAUSAL = (("causal", ANY, True),)  # 45ef304fe5

# What each generation presents. The ops named in COMPILED_OPS that a generation lists are
# compiled ops (shims over torch.ops); the others are plain Python functions. A generation
# that lists _get_mla_metadata_v1_impl has the Python get_mla_metadata_v1 over that op.
COMPILED_OPS = ("mla_decode_stage1_asm_fwd", "mla_reduce_v1", "get_mla_metadata_v1",
                "_get_mla_metadata_v1_impl")
STAGE1_CP = (STAGE1_HEAD + STAGE1_OUTPUT + STAGE1_LSE + STAGE1_SCALES + STAGE1_CONTEXT_PARALLEL
             + STAGE1_VALID_SPLITS)
METADATA_SPLIT = METADATA_HEAD + METADATA_CP_ROUND_ROBIN + MLA_VERSION
TODAY = {  # 45ef304fe5 .. e4048607a (2026-08-22, v0.1.20.post1): aiter as users install it
    "mla_decode_stage1_asm_fwd": STAGE1_CP + STAGE1_CAUSAL,
    "mla_reduce_v1": REDUCE_HEAD + REDUCE_SPLITS + REDUCE_TAIL,
    "get_mla_metadata_v1": METADATA_SPLIT + METADATA_SPLIT_DTYPES + METADATA_DTYPES,
    "_get_mla_metadata_v1_impl": METADATA_SPLIT + METADATA_SPLIT_DTYPE_IDS,
    "get_mla_metadata_info_v1": INFO + INFO_SPLIT_CAP,
    "mla_decode_fwd": DECODE_FWD + DECODE_FWD_CONTEXT_PARALLEL + DECODE_FWD_CAUSAL,
}
GENERATIONS = {
    "2026-03-04": {  # f3be04a12 (16e9b5a07 on today's main), the runner's aiter (runner.md s. 2)
        "mla_decode_stage1_asm_fwd": STAGE1_HEAD + STAGE1_OUTPUT + STAGE1_SCALES,
        "mla_reduce_v1": REDUCE_HEAD + REDUCE_TAIL,
        "get_mla_metadata_v1": METADATA_HEAD + METADATA_DTYPES,
        "get_mla_metadata_info_v1": INFO,
        "mla_decode_fwd": DECODE_FWD,
    },
    "2026-03-16": {  # a235c4aa3a: stage 1 takes `lse` right after `output`, before q_scale
        "mla_decode_stage1_asm_fwd": STAGE1_HEAD + STAGE1_OUTPUT + STAGE1_LSE + STAGE1_SCALES,
        "mla_reduce_v1": REDUCE_HEAD + REDUCE_TAIL,
        "get_mla_metadata_v1": METADATA_HEAD + METADATA_DTYPES,
        "get_mla_metadata_info_v1": INFO,
        "mla_decode_fwd": DECODE_FWD,
    },
    "2026-06-11": {  # ff61bb3997 (v0.1.16): the reduce takes num_kv_splits; info max_split_per_batch
        "mla_decode_stage1_asm_fwd": STAGE1_HEAD + STAGE1_OUTPUT + STAGE1_LSE + STAGE1_SCALES,
        "mla_reduce_v1": REDUCE_HEAD + REDUCE_SPLITS + REDUCE_TAIL,
        "get_mla_metadata_v1": METADATA_HEAD + METADATA_DTYPES,
        "get_mla_metadata_info_v1": INFO + INFO_SPLIT_CAP,
        "mla_decode_fwd": DECODE_FWD,
    },
    "2026-06-26": {  # c2f68ab382 (v0.1.17's API): stage 1 and mla_decode_fwd take context-parallel
        # arguments, the compiled get_mla_metadata_v1 is_cp_round_robin after dtype_kv (63c44c9a0d,
        # 06-19), stage 1 valid_split_count (06-26)
        "mla_decode_stage1_asm_fwd": STAGE1_CP,
        "mla_reduce_v1": REDUCE_HEAD + REDUCE_SPLITS + REDUCE_TAIL,
        "get_mla_metadata_v1": METADATA_HEAD + METADATA_DTYPES + METADATA_CP_ROUND_ROBIN,
        "get_mla_metadata_info_v1": INFO + INFO_SPLIT_CAP,
        "mla_decode_fwd": DECODE_FWD + DECODE_FWD_CONTEXT_PARALLEL,
    },
    "2026-07-13": {  # fede90f463: the metadata's dtype_q / dtype_kv became nope / rope (a day long)
        "mla_decode_stage1_asm_fwd": STAGE1_CP,
        "mla_reduce_v1": REDUCE_HEAD + REDUCE_SPLITS + REDUCE_TAIL,
        "get_mla_metadata_v1": METADATA_SPLIT + METADATA_SPLIT_DTYPES,
        "get_mla_metadata_info_v1": INFO + INFO_SPLIT_CAP,
        "mla_decode_fwd": DECODE_FWD + DECODE_FWD_CONTEXT_PARALLEL,
    },
    "2026-07-14": {  # 028756633e (v0.1.18, v0.1.19): get_mla_metadata_v1 a Python function taking
        # both the nope / rope dtypes and the legacy dtype_q / dtype_kv, over a compiled op
        "mla_decode_stage1_asm_fwd": STAGE1_CP,
        "mla_reduce_v1": TODAY["mla_reduce_v1"],
        "get_mla_metadata_v1": TODAY["get_mla_metadata_v1"],
        "_get_mla_metadata_v1_impl": TODAY["_get_mla_metadata_v1_impl"],
        "get_mla_metadata_info_v1": TODAY["get_mla_metadata_info_v1"],
        "mla_decode_fwd": DECODE_FWD + DECODE_FWD_CONTEXT_PARALLEL,
    },
    "2026-08-10": TODAY,  # 45ef304fe5: stage 1 and mla_decode_fwd take `causal` last
    # an API no submission can know: today's, with stage 1 needing a new argument before `output`
    "2099-01": dict(TODAY, mla_decode_stage1_asm_fwd=(
        STAGE1_HEAD + STAGE1_CU_MASK + STAGE1_OUTPUT + STAGE1_LSE + STAGE1_SCALES)),
}
UNKNOWN_GENERATIONS = ("2099-01",)  # the product must refuse these (aiter routes off)
# Below the API (_double.FEATURES): see _double.configure. The q-length-1 kernel rows of
# e4048607a (c849fd5845 2026-04-16, 78dad4ca34 2026-05-06) predate 2026-06-11.
# The persistent fp8 tables (persistent_table): ff61bb3997's at 2026-06-11, c2f68ab382's from
# 2026-06-26 to 2026-07-14 (read there and at fede90f463 / 028756633e: the same), 45ef304fe5's
# from 2026-08-10 (the same at e4048607a); f3be04a12's before.
_FEATURES_FROM_06_26 = {"lse": "variant", "info_split_cap": "sum", "decode_lse": "written",
                        "kernel_table": "e4048607a", "persistent_table": "c2f68ab382"}
_FEATURES_FROM_08_10 = dict(_FEATURES_FROM_06_26, persistent_table="45ef304fe5")
FEATURES = {
    "2026-03-04": {},
    "2026-03-16": {"lse": "unwritten"},
    "2026-06-11": dict(_FEATURES_FROM_06_26, info_split_cap="product", persistent_table="ff61bb3997"),
    **{generation: _FEATURES_FROM_06_26 for generation in ("2026-06-26", "2026-07-13", "2026-07-14")},
    **{generation: _FEATURES_FROM_08_10 for generation in ("2026-08-10", "2099-01")},
}
DEFAULT_GENERATION = "2026-03-04"
GENERATION_ALIASES = {
    "f3be04a12": "2026-03-04", "16e9b5a07": "2026-03-04", "v0.1.16": "2026-06-11",
    "v0.1.17": "2026-06-26", "v0.1.18": "2026-07-14", "v0.1.19": "2026-07-14",
    "v0.1.20": "2026-08-10", "v0.1.20.post1": "2026-08-10", "e4048607a": "2026-08-10",
    # the names earlier tests used
    "2026-03": "2026-03-04", "2026-04": "2026-06-11",
}


def _generation_from_environment():
    name = os.environ.get("AITER_DOUBLE_GENERATION") or DEFAULT_GENERATION
    name = GENERATION_ALIASES.get(name, name)
    if name not in GENERATIONS:
        raise ImportError(f"aiter double: unknown AITER_DOUBLE_GENERATION {name!r} "
                          f"(known: {sorted(GENERATIONS)} and aliases {sorted(GENERATION_ALIASES)})")
    return name


GENERATION = _generation_from_environment()
API = GENERATIONS[GENERATION]


def signature(params):
    """An inspect.Signature from (name, annotation[, default]) rows."""
    return inspect.Signature(
        [inspect.Parameter(row[0], inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=row[1],
                           default=row[2] if len(row) > 2 else REQUIRED) for row in params],
        return_annotation=None)


def _is_default(value, default):
    if default is REQUIRED or isinstance(value, torch.Tensor):
        return value is default
    return value is default or value == default


def _describe(value):
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return repr(value)


def adapter(op_name, params, machinery):
    """A callable taking the op's arguments in the generation's order (trailing defaults may be
    missing, as torch.ops hands them over) that calls the double's machinery by NAME: a value
    reaches the machinery under the parameter it was bound to, so a value passed to the wrong
    parameter meets that parameter's checks. A parameter the machinery does not model must hold
    its default."""
    sig = signature(params)
    machinery_parameters = inspect.signature(machinery).parameters.values()
    takes_all = any(p.kind is p.VAR_KEYWORD for p in machinery_parameters)
    modelled = {p.name for p in machinery_parameters}
    defaults = {row[0]: row[2] for row in params if len(row) > 2}

    def call(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        values = {}
        for name, value in bound.arguments.items():
            if takes_all or name in modelled:
                values[name] = value
            elif not _is_default(value, defaults.get(name, REQUIRED)):
                raise _double.ContractError(
                    f"{op_name}: '{name}' = {_describe(value)} is not modelled (the double "
                    "models its default only)")
        return machinery(**values)

    call.__signature__ = sig
    return call


def _unknown_api(**_):
    raise _double.ContractError(f"aiter double {GENERATION}: this API is not callable (the "
                                "product must not recognise it)")


def _component_dtype(fn, part, nope, rope, as_ids):
    """The one dtype the double models for q or kv from aiter's nope / rope pair: nope None is
    bf16 and rope None is nope (csrc/kernels/mla/metadata.cu); a rope unlike nope is not
    modelled. as_ids: the values are aiter's dtype ids (the op behind the Python wrapper)."""
    if as_ids:
        for name, value in ((f"dtype_{part}_nope", nope), (f"dtype_{part}_rope", rope)):
            _double.expect(value is None or value in _double.DTYPES_BY_ID,
                           f"{fn}: '{name}' = {value!r} is no aiter dtype id")
        nope, rope = (None if v is None else _double.DTYPES_BY_ID[v] for v in (nope, rope))
    for name, value in ((f"dtype_{part}_nope", nope), (f"dtype_{part}_rope", rope)):
        _double.expect(value is None or isinstance(value, torch.dtype), f"{fn}: '{name}' = "
                                                                        f"{value!r}")
    nope = torch.bfloat16 if nope is None else nope
    _double.expect(rope is None or rope == nope,
                   f"{fn}: dtype_{part}_rope {rope} unlike dtype_{part}_nope {nope} is not "
                   "modelled")
    return nope


def _split_dtype_fill(op_name, as_ids):
    """Machinery for a metadata op taking the nope / rope dtypes: _double.metadata_fill with one
    dtype for q and one for kv."""
    kept = [p for p in inspect.signature(_double.metadata_fill).parameters.values()
            if p.name not in ("dtype_q", "dtype_kv")]
    split = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
             for name in SPLIT_DTYPE_NAMES]

    def fill(**values):
        q, kv = (_component_dtype(op_name, part, values.pop(f"dtype_{part}_nope"),
                                  values.pop(f"dtype_{part}_rope"), as_ids)
                 for part in ("q", "kv"))
        return _double.metadata_fill(**values, dtype_q=q, dtype_kv=kv)

    fill.__signature__ = inspect.Signature(kept + split)
    return fill


def _metadata_wrapper(**values):
    """aiter's Python get_mla_metadata_v1 (028756633e on): dtype_q / dtype_kv fill the nope and
    rope dtypes not given (an explicit one wins); the four go to the compiled op as aiter's
    dtype ids (AssertionError for a value that is no aiter dtype), mla_version as an int."""
    for part in ("q", "kv"):
        legacy = values.pop(f"dtype_{part}")
        for half in ("nope", "rope"):
            if legacy is not None and values[f"dtype_{part}_{half}"] is None:
                values[f"dtype_{part}_{half}"] = legacy
    for name in SPLIT_DTYPE_NAMES:
        if values[name] is not None:
            values[name] = _double.aiter_dtype_id(values[name])
    values["mla_version"] = int(values["mla_version"])
    head = [values.pop(row[0]) for row in METADATA_HEAD[:METADATA_POSITIONAL]]
    return _get_mla_metadata_v1_impl(*head, **values)


def _machinery(op_name):
    if GENERATION in UNKNOWN_GENERATIONS and op_name == "mla_decode_stage1_asm_fwd":
        return _unknown_api
    if op_name == "get_mla_metadata_v1":
        if "_get_mla_metadata_v1_impl" in API:
            return _metadata_wrapper
        if any(row[0] == "dtype_q_nope" for row in API[op_name]):
            return _split_dtype_fill(op_name, as_ids=False)
    if op_name == "_get_mla_metadata_v1_impl":
        return _split_dtype_fill("get_mla_metadata_v1", as_ids=True)
    return {"mla_decode_stage1_asm_fwd": _double.stage1, "mla_reduce_v1": _double.reduce,
            "get_mla_metadata_v1": _double.metadata_fill,
            "get_mla_metadata_info_v1": _double.metadata_info}[op_name]


def _free_private_name(op_name):
    tag = GENERATION.replace("-", "_")
    n = 0
    while hasattr(torch.ops.aiter, f"{op_name}__g{tag}_{n}"):
        n += 1
    return f"{op_name}__g{tag}_{n}"


_LIBRARY = torch.library.Library("aiter", "FRAGMENT")  # lives as long as this import
PUBLIC_OPS = []


def compiled_op(op_name):
    """The public function of one compiled op, registered as real aiter registers it."""
    params = API[op_name]
    kernel = adapter(op_name, params, _machinery(op_name))  # also the schema's typed prototype
    private = _free_private_name(op_name)
    _LIBRARY.define(private + torch.library.infer_schema(kernel, mutates_args="unknown"))
    for key in ("CPU", "CUDA"):
        _LIBRARY.impl(private, kernel, key)
    packet = getattr(torch.ops.aiter, private)
    setattr(torch.ops.aiter, op_name, packet)  # what torch.ops.aiter.<op_name> finds now
    PUBLIC_OPS.append(op_name)

    def wrapper_custom(*args, **kwargs):
        return packet(*args, **kwargs)

    return wrapper_custom


def python_function(op_name, machinery=None):
    """A plain Python function with the generation's signature (inspect reads it)."""
    call = adapter(op_name, API[op_name], machinery or _machinery(op_name))

    def function(*args, **kwargs):
        return call(*args, **kwargs)

    function.__name__ = function.__qualname__ = op_name
    function.__signature__ = call.__signature__
    return function


def public_function(op_name):
    """The op as this generation presents it: a shim over torch.ops or a Python function."""
    if op_name in COMPILED_OPS and not (op_name == "get_mla_metadata_v1"
                                        and "_get_mla_metadata_v1_impl" in API):
        return compiled_op(op_name)
    return python_function(op_name)


_double.configure(**FEATURES[GENERATION])
if "_get_mla_metadata_v1_impl" in API:
    _get_mla_metadata_v1_impl = compiled_op("_get_mla_metadata_v1_impl")
mla_decode_stage1_asm_fwd = public_function("mla_decode_stage1_asm_fwd")
mla_reduce_v1 = public_function("mla_reduce_v1")
get_mla_metadata_v1 = public_function("get_mla_metadata_v1")
get_mla_metadata_info_v1 = public_function("get_mla_metadata_info_v1")
