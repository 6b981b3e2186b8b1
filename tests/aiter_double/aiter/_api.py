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
get_mla_metadata_info_v1 and mla_decode_fwd are plain Python functions (their signatures read).

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

# (name, annotation[, default]) in aiter's order
STAGE1_HEAD = (
    ("Q", T), ("KV", T), ("qo_indptr", T), ("kv_indptr", T), ("kv_page_indices", T),
    ("kv_last_page_lens", T), ("num_kv_splits_indptr", OPT_T), ("work_meta_data", OPT_T),
    ("work_indptr", OPT_T), ("work_info_set", OPT_T), ("max_seqlen_q", int), ("page_size", int),
    ("nhead_kv", int), ("softmax_scale", float), ("splitData", T), ("splitLse", T),
)
STAGE1_OUTPUT = (("output", T),)
STAGE1_LSE = (("lse", OPT_T, None),)
STAGE1_SCALES = (("q_scale", OPT_T, None), ("kv_scale", OPT_T, None))
STAGE1_CONTEXT_PARALLEL = (  # fede90f463 (2026-07-13): defaults only are modelled
    ("g_kv_indptr", OPT_T, None), ("cp_world_size", int, 1), ("cp_rank", int, 0),
    ("valid_split_count", OPT_T, None), ("use_valid_split_count_reduce", int, 0),
)
STAGE1_CU_MASK = (("cu_mask", T),)  # the unknown generation's new required argument
REDUCE_HEAD = (
    ("partial_output", T), ("partial_lse", T), ("reduce_indptr", T), ("reduce_final_map", OPT_T),
    ("reduce_partial_map", T), ("max_seqlen_q", int),
)
REDUCE_SPLITS = (("num_kv_splits", int),)
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
METADATA_DTYPES = (("dtype_q", OPT_DTYPE, None), ("dtype_kv", OPT_DTYPE, None))
METADATA_NOPE_DTYPES = (  # fede90f463 (2026-07-13); MlaVersion.V32 is 0
    ("is_cp_round_robin", bool, False), ("mla_version", int, 0),
    ("dtype_q_nope", OPT_DTYPE, None), ("dtype_q_rope", OPT_DTYPE, None),
    ("dtype_kv_nope", OPT_DTYPE, None), ("dtype_kv_rope", OPT_DTYPE, None),
)
INFO = (
    ("batch_size", int), ("max_seqlen_qo", int), ("num_head_qo", int), ("q_dtype", torch.dtype),
    ("kv_dtype", torch.dtype), ("is_sparse", bool), ("fast_mode", bool, True),
    ("num_kv_splits", int, 32), ("intra_batch_mode", bool, False),
)
INFO_SPLIT_CAP = (("max_split_per_batch", int, -1),)

GENERATIONS = {
    "2026-03-04": {  # f3be04a12, the runner's aiter (runner.md section 2)
        "mla_decode_stage1_asm_fwd": STAGE1_HEAD + STAGE1_OUTPUT + STAGE1_SCALES,
        "mla_reduce_v1": REDUCE_HEAD + REDUCE_TAIL,
        "get_mla_metadata_v1": METADATA_HEAD + METADATA_DTYPES,
        "get_mla_metadata_info_v1": INFO,
    },
    "2026-03-16": {  # a235c4aa3a: stage 1 takes `lse` right after `output`, before q_scale
        "mla_decode_stage1_asm_fwd": STAGE1_HEAD + STAGE1_OUTPUT + STAGE1_LSE + STAGE1_SCALES,
        "mla_reduce_v1": REDUCE_HEAD + REDUCE_TAIL,
        "get_mla_metadata_v1": METADATA_HEAD + METADATA_DTYPES,
        "get_mla_metadata_info_v1": INFO,
    },
    "2026-06-11": {  # ff61bb3997: the reduce takes num_kv_splits; info max_split_per_batch
        "mla_decode_stage1_asm_fwd": STAGE1_HEAD + STAGE1_OUTPUT + STAGE1_LSE + STAGE1_SCALES,
        "mla_reduce_v1": REDUCE_HEAD + REDUCE_SPLITS + REDUCE_TAIL,
        "get_mla_metadata_v1": METADATA_HEAD + METADATA_DTYPES,
        "get_mla_metadata_info_v1": INFO + INFO_SPLIT_CAP,
    },
    "2026-07-13": {  # fede90f463: the metadata's dtype_q / dtype_kv became *_nope (a day long)
        "mla_decode_stage1_asm_fwd": (STAGE1_HEAD + STAGE1_OUTPUT + STAGE1_LSE + STAGE1_SCALES
                                      + STAGE1_CONTEXT_PARALLEL),
        "mla_reduce_v1": REDUCE_HEAD + REDUCE_SPLITS + REDUCE_TAIL,
        "get_mla_metadata_v1": METADATA_HEAD + METADATA_NOPE_DTYPES,
        "get_mla_metadata_info_v1": INFO + INFO_SPLIT_CAP,
    },
    "2099-01": {  # an API no submission can know: stage 1 needs a new argument before `output`
        "mla_decode_stage1_asm_fwd": (STAGE1_HEAD + STAGE1_CU_MASK + STAGE1_OUTPUT + STAGE1_LSE
                                      + STAGE1_SCALES),
        "mla_reduce_v1": REDUCE_HEAD + REDUCE_SPLITS + REDUCE_TAIL,
        "get_mla_metadata_v1": METADATA_HEAD + METADATA_DTYPES,
        "get_mla_metadata_info_v1": INFO + INFO_SPLIT_CAP,
    },
}
DEFAULT_GENERATION = "2026-03-04"
GENERATION_ALIASES = {"f3be04a12": "2026-03-04",
                      # the names earlier tests used
                      "2026-03": "2026-03-04", "2026-04": "2026-06-11"}
# the machinery's name for a renamed parameter
RENAMED = {"dtype_q_nope": "dtype_q", "dtype_kv_nope": "dtype_kv"}


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
    missing, as torch.ops hands them over) that calls the double's machinery by name. A
    parameter the machinery does not model must hold its default."""
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
            target = RENAMED.get(name, name)
            if takes_all or target in modelled:
                values[target] = value
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


def _machinery(op_name):
    if GENERATION == "2099-01" and op_name == "mla_decode_stage1_asm_fwd":
        return _unknown_api
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


def python_function(op_name):
    """A plain Python function with the generation's signature (inspect reads it)."""
    call = adapter(op_name, API[op_name], _machinery(op_name))

    def function(*args, **kwargs):
        return call(*args, **kwargs)

    function.__name__ = function.__qualname__ = op_name
    function.__signature__ = call.__signature__
    return function


mla_decode_stage1_asm_fwd = compiled_op("mla_decode_stage1_asm_fwd")
mla_reduce_v1 = compiled_op("mla_reduce_v1")
get_mla_metadata_v1 = compiled_op("get_mla_metadata_v1")
get_mla_metadata_info_v1 = python_function("get_mla_metadata_info_v1")
