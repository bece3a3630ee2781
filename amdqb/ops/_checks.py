"""Argument checks shared by the ops. Every failure names the argument and is raised before any
kernel launch and any allocation; none of these reads device memory.

Integers: Python ints and NumPy integers (anything ``numbers.Integral``) are accepted and returned
as ``int``; ``bool`` is rejected where an int is meant. Floats: any real number, returned as
``float``; ``finite=True`` rejects NaN and infinities. Sizes that allocate are bounded
(``MAX_ALLOCATED_EXPERTS`` experts) so that an absurd value fails here, not in the allocator.
"""

from __future__ import annotations

import math
import numbers

import torch

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
    if contiguous and not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return value


def _is_bool(value) -> bool:
    return isinstance(value, bool) or type(value).__name__ == "bool_"  # numpy.bool_


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
    value = float(value)
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
