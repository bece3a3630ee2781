"""Argument checks shared by the ops. Every failure names the argument and is raised before any
kernel launch and any allocation; none of these reads device memory.

Integers: Python ints and NumPy integers (anything ``numbers.Integral``) are accepted and returned
as ``int``; ``bool`` is rejected where an int is meant. Floats: any real number, returned as
``float``; ``finite=True`` rejects NaN and infinities. Sizes that allocate are bounded
(``MAX_ALLOCATED_EXPERTS`` experts) so that an absurd value fails here, not in the allocator.

Tensors: strided (dense) tensors on a device that holds data; sparse layouts and the ``meta``
device are rejected. Memory rules (docs/memory_safety.md has the table of every op's arguments):

* strides -- every tensor argument is either read through its strides (:func:`kernel_input`: in
  place when the kernel takes its layout, else through a contiguous copy the op makes, which only
  an input can be) or required contiguous (:func:`check_contiguous`: outputs and in-place buffers,
  which are never copied and written back). :data:`STRIDES` records which, per op and argument;
* overlap -- :func:`check_no_overlap`: an output shares no byte with an input or another output
  (any view, dtype or stride of one allocation counts; two tensors whose byte ranges interleave
  without sharing an element count as overlapping too). Under ``torch.compile``, where a traced
  tensor has no address, the same check runs when the graph runs, before the op's first write.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch.fx.experimental.symbolic_shapes import guard_scalar

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)
ID_DTYPES = (torch.int32, torch.int64)
LOAD_DTYPES = (
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)
INT32_MAX = 2**31 - 1
# experts of an op or a balancer that allocates per-expert buffers (route rows, align, the
# QuantileBalancer's state): an absurd E fails in the check, not in the allocator
MAX_ALLOCATED_EXPERTS = 1 << 16


def check_tensor(
    name: str,
    value,
    *,
    dtypes: tuple[torch.dtype, ...] | None = None,
    dim: int | None = None,
    min_dim: int | None = None,
    shape: tuple[int, ...] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {value.layout}")
    if value.device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device, which holds no data (amdqb ops read and write memory)"
        )
    if dtypes is not None and value.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {value.dtype}")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(value.shape)}")
    if min_dim is not None and value.dim() < min_dim:
        raise ValueError(
            f"{name} must have at least {min_dim} dims, got shape {tuple(value.shape)}"
        )
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(value.shape)}")
    if device is not None and value.device != device:
        raise ValueError(
            f"{name} must be on {device} (the logits/input device), got {value.device}"
        )
    if contiguous:
        check_contiguous(name, value)
    return value


def _is_bool(value) -> bool:
    kind = type(value)  # numpy.bool_ is named "bool" since NumPy 2
    return isinstance(value, bool) or (
        kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool")
    )


def check_int(name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an ``int`` (Python or NumPy integer, not bool) within ``[low, high]``."""
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value


def check_float(name: str, value, *, finite: bool = False) -> float:
    """``value`` as a ``float`` (any real number, not bool); ``finite`` rejects NaN / inf."""
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not isinstance(value, (int, float)):  # NumPy floats, other reals
        value = float(value)
    # a constant also where torch.compile traced the value symbolically (a guard on it)
    value = float(guard_scalar(value))
    if finite and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_bool(name: str, value) -> bool:
    """``value`` as a ``bool``: a bool, a NumPy bool or the ints 0 / 1."""
    if _is_bool(value):
        return bool(value)
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r}")


def check_backend(value) -> None:
    """``backend=``: None or one of the backend names (checked before anything else runs)."""
    from ..dispatch import BACKENDS

    if value is not None and (not isinstance(value, str) or value not in BACKENDS):
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {value!r}")


def check_choice(name: str, value, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_groups(
    num_groups, group_topk, topk: int, num_experts: int, *, te_rule: bool = True, biased=False
) -> tuple[int | None, int | None]:
    """Grouped Top-k arguments. ``te_rule`` (TransformerEngine's router): ``group_topk`` divides
    ``topk`` and each group holds ``topk // group_topk`` of the routes; the serving rule (vLLM /
    SGLang) only needs ``topk`` experts inside the chosen groups, and two per group when the
    ``biased`` groups are ranked by their best two scores."""
    if (num_groups is None) != (group_topk is None):
        raise ValueError("num_groups and group_topk must be given together (or both None)")
    if num_groups is None:
        return None, None
    num_groups = check_int("num_groups", num_groups, low=1, high=num_experts)
    group_topk = check_int("group_topk", group_topk, low=1, high=num_groups)
    if num_experts % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the expert count {num_experts}")
    group_size = num_experts // num_groups
    if te_rule:
        if topk % group_topk:
            raise ValueError(f"group_topk={group_topk} must divide topk={topk}")
        if topk // group_topk > group_size:
            raise ValueError(
                f"topk/group_topk={topk // group_topk} exceeds the group size {group_size}"
            )
        return num_groups, group_topk
    if topk > group_topk * group_size:
        raise ValueError(
            f"topk={topk} exceeds the {group_topk * group_size} experts of group_topk="
            f"{group_topk} groups of {group_size}"
        )
    if biased and group_size < 2:
        raise ValueError(
            "groups ranked by their best two biased scores need at least 2 experts per group, "
            f"got num_experts={num_experts}, num_groups={num_groups}"
        )
    return num_groups, group_topk


def check_enum(name: str, value, names: tuple[str, ...], *, ints=None, strict=False) -> str:
    """The one of ``names`` an enumerated argument means: the name itself (any case), an enum
    member of that name (its ``.name``, any case), or an int -- a NumPy int or an IntEnum
    member too -- indexing ``ints`` (default: ``names``). ``strict`` is TransformerEngine's
    coercion: strings must match exactly, and a bool or a value of another type is a TypeError
    (otherwise a ValueError, like every unknown value)."""
    ints = names if ints is None else ints
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if 0 <= int(value) < len(ints):
            return ints[int(value)]
        raise ValueError(f"{name} int must be one of {list(range(len(ints)))}; got {value!r}")
    if isinstance(value, str):
        key = value if strict else value.lower()
        if key in names:
            return key
        case = " (lowercase)" if strict else ""
        raise ValueError(f"{name} must be one of {names}{case}; got {value!r}")
    label = getattr(value, "name", None)  # an enum of another binding with the same names
    if isinstance(label, str) and label.lower() in names and not isinstance(value, bool):
        return label.lower()
    message = f"{name} must be one of {names}, an enum of those names or its int; got {value!r}"
    raise (TypeError if strict else ValueError)(message)


# --------------------------------------------------------------------------------------------
# Strides
# --------------------------------------------------------------------------------------------
CONTIGUOUS = "contiguous"  # required contiguous: a strided view is a ValueError naming it
ROWS = "rows"  # a 2-D view with unit-stride rows is read in place (any row stride), else copied
COPY = "copy"  # any strides: read through a contiguous copy the op makes
STRIDED = "strided"  # any strides, read (and written) in place by PyTorch operations

#: How each op reads or writes each tensor argument (docs/memory_safety.md shows the same table;
#: op_tests/test_hostile_inputs.py drives a strided view of every entry through every backend).
#: Outputs and in-place buffers are CONTIGUOUS or STRIDED, never COPY: a copy written back later
#: would hide the write from every other view of the buffer.
STRIDES: dict[str, dict[str, str]] = {
    "fused_topk_with_score_function": {
        "logits": COPY,
        "expert_bias": CONTIGUOUS,
        "topk_indices": CONTIGUOUS,
    },
    "biased_topk": {"logits": ROWS, "expert_bias": COPY},
    "moe_route_rows": {"topk_ids": COPY, "counters": CONTIGUOUS},
    "moe_align_block_size": {"topk_ids": COPY, "expert_map": STRIDED},
    "align_block_size_into": {
        "topk_ids": COPY,
        "sorted_token_ids": CONTIGUOUS,
        "expert_ids": CONTIGUOUS,
        "num_tokens_post_pad": CONTIGUOUS,
    },
    "moe_sort_chunks_and_pad": {
        "inp": ROWS,
        "split_sizes": CONTIGUOUS,
        "sorted_indices": CONTIGUOUS,
        "output_split_sizes": CONTIGUOUS,
        "probs": ROWS,
    },
    "moe_unpad_and_restore_chunks": {"inp": ROWS, "row_map": CONTIGUOUS},
    "fused_compute_score_for_moe_aux_loss": {"logits": ROWS},
    "fused_moe_aux_loss": {
        "probs": ROWS,
        "tokens_per_expert": STRIDED,
        "total_num_tokens": STRIDED,
    },
    "aux_free_bias_update_": {"bias": STRIDED, "tokens_per_expert": STRIDED},
    "maxvio": {"tokens_per_expert": STRIDED},
    "cv2": {"tokens_per_expert": STRIDED},
}


def check_qb_histogram(
    name: str,
    histogram,
    binning: str,
    *,
    accumulated: bool,
    num_experts: int | None = None,
    device=None,
    max_bins: int | None = None,
) -> tuple[int, int, bool]:
    """A Quantile Balancing histogram: contiguous integer ``[E, B]``, or ``[3, E, B]`` (the
    counts and the log_margin in-bin moments); ``E == num_experts`` where given, else ``E >= 2``;
    ``2 <= B`` (``<= max_bins`` where given) and, for log_margin, an even B in the margin axis's
    range. ``accumulated``: the router adds into it, so its type is the kernels' (int32
    ``[E, B]``, int64 ``[3, E, B]``); the steps read it and take either integer type. Returns
    ``(E, B, moments)``."""
    from ..ref.router import MAX_MARGIN_BINS, MIN_MARGIN_BINS

    check_tensor(
        name, histogram, dtypes=(torch.int32, torch.int64), min_dim=2, device=device,
        contiguous=True,
    )  # fmt: skip
    shape = tuple(histogram.shape)
    moments = histogram.dim() == 3 and shape[0] == 3
    experts, bins = shape[-2:]
    want_e = "E >= 2" if num_experts is None else f"E={num_experts}"
    if (
        (histogram.dim() != 2 and not moments)
        or (num_experts is None and experts < 2)
        or (num_experts is not None and experts != num_experts)
    ):
        raise ValueError(
            f"{name} must be [E, B] or [3, E, B] (the counts and the log_margin in-bin "
            f"moments) with {want_e}, got {shape}"
        )
    if moments and binning != "log_margin":
        raise ValueError(
            f"{name} [3, E, B] (the in-bin moments) needs the log_margin binning, got {binning!r}"
        )
    want = torch.int64 if moments else torch.int32
    if accumulated and histogram.dtype != want:
        raise TypeError(f"{name} must be {want} with shape {shape}, got {histogram.dtype}")
    if bins < 2 or (max_bins is not None and bins > max_bins):
        want_b = "B >= 2" if max_bins is None else f"2 <= B <= {max_bins}"
        raise ValueError(f"{name} needs {want_b} bins, got B={bins}")
    if binning == "log_margin" and not (
        MIN_MARGIN_BINS <= bins <= MAX_MARGIN_BINS and bins % 2 == 0
    ):
        raise ValueError(
            f"{name}: the log_margin binning needs an even B (bin count) in [{MIN_MARGIN_BINS}, "
            f"{MAX_MARGIN_BINS}], got B={bins}"
        )
    return experts, bins, moments


def check_contiguous(name: str, value: torch.Tensor) -> torch.Tensor:
    """A ``CONTIGUOUS`` argument (every output and in-place buffer is one, or ``STRIDED``)."""
    if not value.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous, got shape {tuple(value.shape)} with strides "
            f"{value.stride()}"
        )
    return value


def rows_readable(value: torch.Tensor) -> bool:
    """A 2-D tensor whose rows are contiguous (any row stride, 0 included): what the ``ROWS``
    kernels read in place."""
    return value.dim() == 2 and (value.stride(1) == 1 or value.shape[1] <= 1)


def kernel_input(value: torch.Tensor, policy: str = COPY) -> torch.Tensor:
    """An input tensor as the kernels read it: itself when contiguous (or, for ``ROWS``, when
    :func:`rows_readable`), else a contiguous copy with its values (read through its strides)."""
    if value.is_contiguous() or (policy == ROWS and rows_readable(value)):
        return value
    return value.contiguous()


# --------------------------------------------------------------------------------------------
# Overlap
# --------------------------------------------------------------------------------------------
def byte_span(value: torch.Tensor) -> tuple[int, int] | None:
    """``[first, last + 1)`` byte addresses ``value`` can touch (None: no element). Strides are
    non-negative in PyTorch, so the span runs from the first element to ``sum((n - 1) * s)``
    elements past it; a zero stride (an expanded tensor) spans its one element."""
    if value.numel() == 0:
        return None
    extent = 1 + sum((n - 1) * s for n, s in zip(value.shape, value.stride()))
    start = value.data_ptr()
    return start, start + extent * value.element_size()


def _placed(value: torch.Tensor):
    """(device, byte span) of ``value``, the span None when it has no element."""
    return value.device, byte_span(value)


def _overlaps(a, b) -> bool:
    """Whether two :func:`_placed` tensors share a byte."""
    (da, sa), (db, sb) = a, b
    return da == db and sa is not None and sb is not None and sa[0] < sb[1] and sb[0] < sa[1]


def _find_overlap(outputs, out_names, inputs, in_names) -> None:
    outs = [_placed(t) for t in outputs]  # each tensor's span once, not once per pair
    ins = [_placed(t) for t in inputs]
    for i, (out, name) in enumerate(zip(outs, out_names)):
        for other, other_name in zip(outs[i + 1 :], out_names[i + 1 :]):
            if _overlaps(out, other):
                raise ValueError(
                    f"{name} and {other_name} overlap in memory: two outputs of one call must "
                    "not share storage"
                )
        for inp, inp_name in zip(ins, in_names):
            if _overlaps(out, inp):
                raise ValueError(
                    f"{name} and {inp_name} overlap in memory: an output must not share storage "
                    "with an input"
                )


@torch.library.custom_op("amdqb::check_no_overlap", mutates_args=())
def _check_no_overlap_op(
    outputs: list[torch.Tensor], out_names: str, inputs: list[torch.Tensor], in_names: str
) -> None:
    # the compiled form: runs with the graph's real tensors (names joined by ",")
    _find_overlap(outputs, out_names.split(","), inputs, in_names.split(",") if in_names else [])


_check_no_overlap_op.register_fake(lambda *args: None)
# a check without outputs: kept by the graph passes that drop unused pure nodes
_side_effect = getattr(torch.fx.node, "has_side_effect", None)
if _side_effect is not None:
    _side_effect(torch.ops.amdqb.check_no_overlap.default)
else:  # torch < 2.6
    torch.fx.node._side_effectful_functions.add(torch.ops.amdqb.check_no_overlap.default)


def check_no_overlap(outputs: dict, inputs: dict) -> None:
    """``ValueError`` naming both arguments when an output (``name -> tensor | None``) shares a
    byte with an input or another output. Host metadata only (addresses, sizes, strides), no
    device read. Under ``torch.compile`` the check is a graph node that runs before the op's
    kernels (a traced tensor has no address); a raise there leaves the caller's tensors as they
    were, since the graph writes its inputs back only at its end."""
    outs = [(n, t) for n, t in outputs.items() if t is not None]
    ins = [(n, t) for n, t in inputs.items() if t is not None]
    if not outs:
        return
    if torch.compiler.is_compiling():
        torch.ops.amdqb.check_no_overlap(
            [t for _, t in outs],
            ",".join(n for n, _ in outs),
            [t for _, t in ins],
            ",".join(n for n, _ in ins),
        )
        return
    _find_overlap(
        [t for _, t in outs], [n for n, _ in outs], [t for _, t in ins], [n for n, _ in ins]
    )


# --------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------
def static_int(value):
    """``value`` as a trace-time constant. A size torch.compile traces symbolically (dynamic
    shapes) is specialised to its value with a guard (a new value traces again); an int is
    returned as is. For what selects kernels and backends (dispatch features, the arguments of
    ``assume_constant_result`` functions), which must be constants. (Traced code cannot tell a
    symbolic int from an int, so every value goes through the guard, a no-op on an int.)"""
    return guard_scalar(value)
