"""Hostile inputs on every backend: strides, aliasing, state, settings and the compiled paths.

Table-driven over the public ops (docs/memory_safety.md) and every backend that runs each of them
here: ``torch``, ``triton`` (the interpreter on the CPU) and ``hip`` (the emulator of
op_tests/hip_emu on the CPU, the real backend on a GPU). Classes:

* strides -- a strided view of every tensor argument (``amdqb.ops._checks.STRIDES``: a gap view,
  a row slice of a wider buffer, a transpose, expanded rows) gives bitwise the answer of the same
  call with contiguous arguments, and the oracle's, and leaves its buffer as it was; or, for a
  ``contiguous`` argument, is a ValueError naming it with every tensor unchanged. Outputs given as
  views at an offset of a guarded buffer are written there and nowhere else;
* aliasing -- every output overlapping every input and every other output (one start address,
  a partial byte overlap in another dtype, an expanded input over the output's bytes, the very
  same tensor) is a ValueError naming both, with every byte of the shared allocation unchanged;
  adjacent views of one allocation are accepted and give the separate buffers' answer;
* rejections -- every rejection of op_tests/test_bad_inputs.py forced onto every backend, and
  this file's own (meta and sparse tensors, non-bool flags), with a bitwise snapshot of every
  tensor before and after;
* settings -- every setting at its bounds (accepted: the oracle's answer) and past them (rejected);
* values -- the documented outcomes the host cannot check (NaN loads, a device token count of 0,
  negative counts, int64 ids and maps past int32);
* compile -- ``torch.compile(fullgraph=True)`` with dynamic and automatic-dynamic shapes on every
  backend, static shapes on the oracle: the eager answer at three token counts, then an eager rejection (an overlap, found when the
  graph runs; a bad value, found while tracing) raised from the compiled function, state unchanged.

Shapes are tiny (E = 8 experts, k = 2): the whole file runs in well under two minutes of CI.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from _pytest.mark.structures import ParameterSet

import amdqb
from amdqb.ops import _checks
from amdqb.ops import layout as layout_ops

from conftest import DEVICE, HAS_GPU
from conftest import backends as kernel_backend_params

E, K, H, BS = 8, 2, 4, 4
T0 = 6  # token count of the base calls
INT32_MAX = 2**31 - 1


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _dev(t):
    return t.to(DEVICE)


# ---------------------------------------------------------------------------------------------
# The ops: valid arguments, which are outputs, what to compare
# ---------------------------------------------------------------------------------------------
@dataclass
class Op:
    """``fn(**make(T))``: ``outputs`` are the caller buffers it writes (checked for overlap and
    compared after the call), ``kernel`` the kernel-level op whose backends run it (None: torch
    only, no ``backend=``)."""

    name: str
    fn: Callable
    make: Callable
    kernel: str | None
    outputs: tuple = ()
    rounded: bool = True  # fp32 results whose rounding may differ from the oracle's
    grad: tuple = ()  # arguments whose gradient is compared (differentiable ops)


def _router_args(t, seed=0):
    g = _gen(seed)
    return dict(
        logits=_dev(torch.randn(t, E, generator=g)),
        topk=K,
        expert_bias=_dev(torch.randn(E, generator=g) * 0.1),
        topk_indices=_dev(torch.zeros(t, K, dtype=torch.int32)),
    )


def _router_qb_args(t, seed=0):
    args = _router_args(t, seed)
    args.update(
        qb_histogram=_dev(torch.zeros(E, 16, dtype=torch.int32)),
        qb_bin_bounds=_dev(torch.tensor([-1.0, 1.0])),
        qb_histogram_mode="two_kernel",
    )
    return args


def _biased_args(t, seed=0):
    g = _gen(seed)
    return dict(
        logits=_dev(torch.randn(t, E, generator=g)),
        topk=K,
        expert_bias=_dev(torch.randn(E, generator=g) * 0.1),
    )


def _ids(t, seed=0, dtype=torch.int32):
    # ids in [-1, E]: the out-of-range ones are dropped
    return _dev(torch.randint(-1, E + 1, (t, K), generator=_gen(seed)).to(dtype))


def _route_args(t, seed=0):
    return dict(
        topk_ids=_ids(t, seed),
        num_experts=E,
        counters=_dev(torch.randint(0, 5, (E,), generator=_gen(seed + 1)).to(torch.int32)),
        deterministic=True,
    )


def _align_args(t, seed=0):
    return dict(
        topk_ids=_ids(t, seed),
        block_size=BS,
        num_experts=E,
        expert_map=_dev(torch.randperm(E, generator=_gen(seed + 1)).to(torch.int32) - 1),
    )


def _align_into_args(t, seed=0):
    rows = layout_ops.align_min_rows(t * K, E, BS)
    return dict(
        topk_ids=_ids(t, seed),
        block_size=BS,
        num_experts=E,
        sorted_token_ids=_dev(torch.zeros(rows, dtype=torch.int32)),
        expert_ids=_dev(torch.zeros(-(-rows // BS), dtype=torch.int32)),
        num_tokens_post_pad=_dev(torch.zeros(1, dtype=torch.int32)),
    )


def _split(t):
    a = t // 3
    return [a, a, t - 2 * a]


def _chunks_args(t, seed=0):
    g = _gen(seed)
    sizes = _split(t)
    out_sizes = [s + 1 for s in reversed(sizes)]
    return dict(
        inp=_dev(torch.randn(t, H, generator=g)),
        split_sizes=_dev(torch.tensor(sizes, dtype=torch.int32)),
        sorted_indices=_dev(torch.tensor([2, 1, 0], dtype=torch.int32)),
        output_split_sizes=_dev(torch.tensor(out_sizes, dtype=torch.int32)),
        num_out_tokens=sum(out_sizes),
        probs=_dev(torch.rand(t, generator=g)),
    )


def _restore_args(t, seed=0):
    g = _gen(seed)
    p = t + 2
    row_map = torch.cat([torch.randperm(t, generator=g), torch.tensor([-1, t + 5])])
    return dict(
        inp=_dev(torch.randn(p, H, generator=g)),
        row_map=_dev(row_map.to(torch.int32)),
        num_tokens=t,
    )


def _scores_args(t, seed=0):
    return dict(
        logits=_dev(torch.randn(t, E, generator=_gen(seed))), topk=K, score_function="sigmoid"
    )


def _aux_args(t, seed=0):
    g = _gen(seed)
    return dict(
        probs=_dev(torch.softmax(torch.randn(t, E, generator=g), -1)),
        tokens_per_expert=_dev(torch.randint(0, 9, (E,), generator=g).to(torch.int32)),
        total_num_tokens=_dev(torch.tensor(t * K, dtype=torch.int64)),
        num_experts=E,
        topk=K,
        coeff=0.01,
    )


def _aux_free_args(t, seed=0):
    g = _gen(seed)
    return dict(
        bias=_dev(torch.randn(E, generator=g)),
        tokens_per_expert=_dev(torch.randint(0, 9, (E,), generator=g).to(torch.int32)),
        rate=1e-3,
    )


def _load_args(t, seed=0):
    return dict(tokens_per_expert=_dev(torch.randint(0, 9, (E,), generator=_gen(seed)).float()))


OPS = {
    op.name: op
    for op in (
        Op(
            "fused_topk_with_score_function",
            amdqb.fused_topk_with_score_function,
            _router_args,
            "router_fwd",
            outputs=("topk_indices",),
        ),
        Op("biased_topk", amdqb.biased_topk, _biased_args, "biased_topk"),
        Op(
            "moe_route_rows",
            amdqb.moe_route_rows,
            _route_args,
            "route_rows",
            outputs=("counters",),
            rounded=False,
        ),
        Op(
            "moe_align_block_size",
            amdqb.moe_align_block_size,
            _align_args,
            "align_block_size",
            rounded=False,
        ),
        Op(
            "align_block_size_into",
            layout_ops.align_block_size_into,
            _align_into_args,
            "align_block_size",
            outputs=("sorted_token_ids", "expert_ids", "num_tokens_post_pad"),
            rounded=False,
        ),
        Op(
            "moe_sort_chunks_and_pad",
            amdqb.moe_sort_chunks_and_pad,
            _chunks_args,
            "chunk_copy",
            rounded=False,
            grad=("inp", "probs"),
        ),
        Op(
            "moe_unpad_and_restore_chunks",
            amdqb.moe_unpad_and_restore_chunks,
            _restore_args,
            "chunk_copy",
            rounded=False,
            grad=("inp",),
        ),
        Op(
            "fused_compute_score_for_moe_aux_loss",
            amdqb.fused_compute_score_for_moe_aux_loss,
            _scores_args,
            "aux_scores_fwd",
            grad=("logits",),
        ),
        Op(
            "fused_moe_aux_loss",
            amdqb.fused_moe_aux_loss,
            _aux_args,
            "aux_loss_fwd",
            grad=("probs",),
        ),
        Op(
            "aux_free_bias_update_",
            amdqb.aux_free_bias_update_,
            _aux_free_args,
            None,
            outputs=("bias",),
        ),
        Op("maxvio", amdqb.maxvio, _load_args, None),
        Op("cv2", amdqb.cv2, _load_args, None),
    )
}
R, B, RR, AL, AI = (
    "fused_topk_with_score_function",
    "biased_topk",
    "moe_route_rows",
    "moe_align_block_size",
    "align_block_size_into",
)
SC, UR, S, A, AF = (
    "moe_sort_chunks_and_pad",
    "moe_unpad_and_restore_chunks",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "aux_free_bias_update_",
)
ROUTER_QB = Op(
    "fused_topk_with_score_function",
    amdqb.fused_topk_with_score_function,
    _router_qb_args,
    "router_fwd",
    outputs=("topk_indices", "qb_histogram"),
)


# ---------------------------------------------------------------------------------------------
# Backends, calls, snapshots
# ---------------------------------------------------------------------------------------------
def _backends(op: Op) -> list[tuple]:
    """(value, marks, id) of torch and of every kernel backend running ``op`` here."""
    out = [("torch", (), "torch")]
    if op.kernel is None:
        return out
    for p in kernel_backend_params(op.kernel):
        value, marks, pid = (
            (p.values[0], p.marks, p.id) if isinstance(p, ParameterSet) else (p, (), p)
        )
        if value is not None:
            out.append((value, tuple(marks), pid))
    return out


def _on_backends(op: Op) -> list:
    """``backend`` params: every backend of ``op``."""
    return [pytest.param(v, id=pid, marks=marks) for v, marks, pid in _backends(op)]


def _params(cases, op_of, name_of):
    """``(case, backend)`` params: every case on every backend of its op."""
    params = []
    for case in cases:
        for value, marks, pid in _backends(op_of(case)):
            params.append(pytest.param(case, value, id=f"{name_of(case)}-{pid}", marks=marks))
    return params


def _call(op: Op, args: dict, backend):
    if op.kernel is None:
        return op.fn(**args)
    return op.fn(**args, backend=backend)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as bytes (a sparse tensor's dense values; a meta tensor holds none)."""
    if t.is_meta:
        return torch.zeros(0, dtype=torch.uint8)
    if t.layout != torch.strided:
        t = t.to_dense()
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def _snapshot(*objs):
    return [(t, _bytes(t)) for obj in objs for t in _tensors(obj)]


def _assert_unchanged(snapshot, what="state"):
    for i, (t, data) in enumerate(snapshot):
        now = _bytes(t)
        assert now.shape == data.shape and torch.equal(now, data), f"{what}: tensor {i} changed"


def _results(op: Op, out, args) -> list:
    """What a call produced: its return value and the final values of its output arguments."""
    values = list(out) if isinstance(out, (tuple, list)) else [out]
    values += [args[name] for name in op.outputs if args.get(name) is not None]
    return [v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for v in values]


def _assert_same(got: list, want: list, exact=True, what=""):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        if not isinstance(w, torch.Tensor):
            assert g is None and w is None, f"{what}: result {i}"
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}: result {i} {g.shape} {w.shape}"
        if exact or not w.is_floating_point():
            same = torch.equal(_bytes(g), _bytes(w))  # bitwise (NaN payloads and signed zeros)
            assert same, f"{what}: result {i} differs\n{g}\n{w}"
        else:
            torch.testing.assert_close(g, w, rtol=2e-5, atol=1e-6, equal_nan=True, msg=what)


def _oracle(op: Op, args: dict) -> list:
    fresh = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    return _results(op, _call(op, fresh, "torch"), fresh)


# ---------------------------------------------------------------------------------------------
# Strides: a view of every tensor argument
# ---------------------------------------------------------------------------------------------
POISON = {torch.float32: -777.0, torch.int32: -7777, torch.int64: -77777}


def _poison_like(shape, dtype):
    return torch.full(shape, POISON[dtype], dtype=dtype, device=DEVICE)


def _views(value: torch.Tensor):
    """``(variant, view, buffer, values)``: a view into ``buffer`` holding ``values`` (``value``,
    or for ``expanded`` its first row repeated)."""
    d, dtype = value.dim(), value.dtype
    if d == 0:
        buf = _poison_like((5,), dtype)
        view = buf[2]
        view.copy_(value)
        yield "offset", view, buf, value
        return
    # a contiguous view at an offset: writes must land in it and nowhere else
    buf = _poison_like((value.numel() + 7,), dtype)
    view = buf[3 : 3 + value.numel()].view(value.shape)
    view.copy_(value)
    yield "offset", view, buf, value
    if value.shape[-1] > 1:
        buf = _poison_like((*value.shape[:-1], 2 * value.shape[-1]), dtype)
        view = buf[..., ::2]
        view.copy_(value)
        yield "gap", view, buf, value
    if d == 2 and value.shape[0] > 1:
        buf = _poison_like((value.shape[0], value.shape[1] + 3), dtype)
        view = buf[:, : value.shape[1]]
        view.copy_(value)
        yield "rows", view, buf, value
        if value.shape[1] > 1:
            buf = _poison_like((value.shape[1], value.shape[0]), dtype)
            view = buf.t()
            view.copy_(value)
            yield "transposed", view, buf, value
        buf = _poison_like((value.shape[1] + 2,), dtype)
        row = buf[1 : 1 + value.shape[1]]
        row.copy_(value[0])
        yield "expanded", row.expand(value.shape), buf, value[:1].expand(value.shape)


STRIDE_CASES = []
for _op_name, _policies in _checks.STRIDES.items():
    _op = OPS[_op_name]
    for _arg, _policy in _policies.items():
        _value = _op.make(T0)[_arg]
        for _variant, _view, _, _ in _views(_value):
            STRIDE_CASES.append((_op_name, _arg, _policy, _variant))


@pytest.mark.parametrize(
    "case,backend",
    _params(STRIDE_CASES, lambda c: OPS[c[0]], lambda c: "-".join(c)),
    indirect=["backend"],
)
def test_strided_view(case, backend):
    """A view of one argument: rejected naming it (``contiguous``), or the answer of the
    contiguous call (bitwise the oracle's for exact results), the view's buffer untouched (an
    input) or written only inside the view (an output), the other inputs unchanged."""
    op_name, arg, policy, variant = case
    op = OPS[op_name]
    args = op.make(T0)
    view, buf, values = next((v, b, x) for n, v, b, x in _views(args[arg]) if n == variant)
    values = values.contiguous().clone()
    ref_args = dict(op.make(T0), **{arg: values.clone()})  # its own outputs and counters
    args[arg] = view
    others = {k: v for k, v in args.items() if k != arg}
    is_output = arg in op.outputs
    if policy == _checks.CONTIGUOUS and not view.is_contiguous():
        before = _snapshot(args, buf)
        with pytest.raises(ValueError, match=f"{arg} must be contiguous"):
            _call(op, args, backend)
        _assert_unchanged(before)
        return
    band = _bytes(buf)
    before_others = _snapshot({k: v for k, v in others.items() if k not in op.outputs})
    oracle = _oracle(op, ref_args)  # integer results (rows, layouts) and copies: bitwise
    got = _results(op, _call(op, args, backend), args)
    if op.rounded:  # bitwise the backend's own contiguous call, close to the oracle's
        want = _results(op, _call(op, ref_args, backend), ref_args)
        _assert_same(got, want, what=f"{op_name}({arg}={variant}) vs contiguous")
    _assert_same(got, oracle, exact=not op.rounded, what="vs oracle")
    _assert_unchanged(before_others, "inputs")
    if not is_output:
        assert torch.equal(_bytes(buf), band), f"{arg}: the buffer of an input view changed"
    else:
        # every byte outside the view is as it was: the writes went to the view
        mask = torch.ones(buf.numel(), dtype=torch.bool, device=buf.device)
        flat = torch.arange(buf.numel(), device=buf.device).view(buf.shape)
        mask[_view_like(flat, view).reshape(-1)] = False
        old = band.view(buf.dtype).view(-1)
        assert torch.equal(buf.reshape(-1)[mask], old[mask]), f"{arg}: a write left the view"


def _view_like(flat_index: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """The buffer indices ``view`` covers (its strides over the same buffer)."""
    return torch.as_strided(flat_index, view.shape, view.stride(), view.storage_offset())


GRAD_CASES = [
    (name, arg, variant)
    for name, op in OPS.items()
    for arg in op.grad
    for variant, *_ in _views(op.make(T0)[arg])
    if variant != "offset"
]


def _loss(out):
    out = out if isinstance(out, (tuple, list)) else [out]
    total = 0
    for i, o in enumerate(out):
        if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad:
            w = torch.linspace(-1, 1, o.numel(), device=o.device).view(o.shape)
            total = total + (o.float() * (w + i)).sum()
    return total


@pytest.mark.parametrize(
    "case,backend",
    _params(GRAD_CASES, lambda c: OPS[c[0]], lambda c: "-".join(c)),
    indirect=["backend"],
)
def test_strided_view_gradient(case, backend):
    """The backward of a view read in place (``rows``) or through a copy reaches the view's
    buffer, with the gradient of the contiguous call."""
    op_name, arg, variant = case
    op = OPS[op_name]
    args = op.make(T0)
    view, buf, values = next((v, b, x) for n, v, b, x in _views(args[arg]) if n == variant)
    ref = values.contiguous().clone().requires_grad_(True)
    leaf = buf.clone().requires_grad_(True)
    view = _view_like(leaf.reshape(-1), view)  # the same view of a leaf that requires grad
    args_view = dict(args, **{arg: view})
    args_ref = dict(args, **{arg: ref})
    _loss(_call(op, args_ref, backend)).backward()
    _loss(_call(op, args_view, backend)).backward()
    want = torch.zeros_like(leaf)
    # scatter the contiguous call's gradient through the view's index map (sums where it repeats)
    idx = _view_like(torch.arange(leaf.numel(), device=leaf.device), view).reshape(-1)
    want.reshape(-1).index_add_(0, idx, ref.grad.reshape(-1))
    torch.testing.assert_close(leaf.grad, want, rtol=1e-5, atol=1e-6)


def test_stride_table_matches_docs():
    """docs/memory_safety.md lists every (op, argument) of STRIDES with its policy."""
    import pathlib

    text = (pathlib.Path(__file__).parents[1] / "docs" / "memory_safety.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[2] in (
            _checks.CONTIGUOUS,
            _checks.ROWS,
            _checks.COPY,
            _checks.STRIDED,
        ):
            rows[(cells[0], cells[1])] = cells[2]
    table = {(op, a): p for op, args in _checks.STRIDES.items() for a, p in args.items()}
    assert rows == table
    for op, args in _checks.STRIDES.items():
        params = inspect.signature(OPS[op].fn).parameters
        tensors = {k for k, v in OPS[op].make(T0).items() if isinstance(v, torch.Tensor)}
        assert tensors <= set(args), (op, tensors - set(args))
        assert set(args) <= set(params), op


# ---------------------------------------------------------------------------------------------
# Aliasing: every output over every input and every other output
# ---------------------------------------------------------------------------------------------
def _place(raw: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``like`` over ``raw``'s bytes from ``offset``."""
    n = like.numel() * like.element_size()
    return raw[offset : offset + n].view(like.dtype).view(like.shape)


def _alias(out_value, in_value, variant):
    """``(raw, out_view, in_view)`` over one allocation for ``variant``."""
    osz, isz = (
        out_value.numel() * out_value.element_size(),
        in_value.numel() * in_value.element_size(),
    )
    raw = torch.zeros(osz + isz + 64, dtype=torch.uint8, device=DEVICE)
    if variant == "adjacent":  # one allocation, no shared byte: accepted
        i = _place(raw, 0, in_value)
        o = _place(raw, -(-isz // 16) * 16, out_value)
    elif variant == "same_start":
        o, i = _place(raw, 0, out_value), _place(raw, 0, in_value)
    elif variant == "partial":  # the output starts inside the input's last 8 bytes
        i = _place(raw, 0, in_value)
        o = _place(raw, max(0, (isz - 1) // 8 * 8), out_value)
    elif variant == "expanded":  # an expanded input over one element inside the output
        o = _place(raw, 0, out_value)
        one = _place(raw, 0, in_value.reshape(-1)[:1])
        i = one.reshape([1] * in_value.dim()).expand(in_value.shape)
        if in_value.dim() == 0:
            i = one.reshape(())
    else:
        raise AssertionError(variant)
    o.copy_(out_value)
    if variant == "expanded":
        one.copy_(in_value.reshape(-1)[:1])
    else:
        i.copy_(in_value)
    return raw, o, i


ALIAS_VARIANTS = ("same_start", "partial", "expanded", "adjacent")


def _alias_cases():
    cases = []
    for op in [*OPS.values(), ROUTER_QB]:
        args = op.make(T0)
        tensors = [k for k, v in args.items() if isinstance(v, torch.Tensor)]
        qb = "qb_histogram" in args
        for out in op.outputs:
            for other in tensors:
                if other == out or (qb and out == "topk_indices" and other != "qb_histogram"):
                    continue  # the QB form adds the histogram's pairs to the plain router's
                for variant in ALIAS_VARIANTS:
                    if variant == "expanded" and (
                        other in op.outputs
                        or args[other].dim() == 0
                        or _checks.STRIDES.get(op.name, {}).get(other, _checks.CONTIGUOUS)
                        == _checks.CONTIGUOUS
                    ):
                        continue  # a contiguous argument fails its own check first
                    if other in op.outputs and tensors.index(other) < tensors.index(out):
                        continue  # each pair of outputs once
                    cases.append((op, out, other, variant))
    return cases


ALIAS_CASES = _alias_cases()


def _alias_id(c):
    return f"{c[0].name}{'-qb' if c[0] is ROUTER_QB else ''}-{c[1]}-{c[2]}-{c[3]}"


@pytest.mark.parametrize(
    "case,backend", _params(ALIAS_CASES, lambda c: c[0], _alias_id), indirect=["backend"]
)
def test_alias(case, backend):
    """An output over an input or another output: a ValueError naming both, every byte of the
    allocation unchanged; adjacent views of one allocation: the separate buffers' answer."""
    op, out, other, variant = case
    args = op.make(T0)
    raw, o, i = _alias(args[out], args[other], variant)
    aliased = dict(args, **{out: o, other: i})
    if variant == "adjacent":
        want = _results(op, _call(op, args, backend), args)
        got = _results(op, _call(op, aliased, backend), aliased)
        _assert_same(got, want, what="adjacent views of one allocation")
        return
    before = _snapshot(aliased, raw)
    with pytest.raises(ValueError) as info:
        _call(op, aliased, backend)
    msg = str(info.value)
    assert out in msg and other in msg and "overlap" in msg, msg
    _assert_unchanged(before)


@pytest.mark.parametrize("backend", _on_backends(OPS[RR]), indirect=True)
def test_route_rows_counters_are_the_ids(backend):
    """``moe_route_rows(c, E, counters=c)``: the one tensor as ids and counters is rejected
    (it gave three different answers on three backends)."""
    c = _dev(torch.tensor([1, 2, 1, 1, 1, 1, 1, 0], dtype=torch.int32))
    before = _snapshot(c)
    with pytest.raises(ValueError, match="counters and topk_ids overlap"):
        amdqb.moe_route_rows(c, E, counters=c, backend=backend)
    _assert_unchanged(before)


# ---------------------------------------------------------------------------------------------
# Rejections on every backend, state unchanged
# ---------------------------------------------------------------------------------------------
def _bad_input_cases():
    import test_bad_inputs as tbi

    cases = []
    for case in tbi.CASES:
        if case.error is None or case.skip or "backend" in case.args:
            continue
        try:
            params = inspect.signature(case.call).parameters
        except (TypeError, ValueError):
            continue
        if "backend" in params:
            cases.append(case)
    return cases


BAD_CASES = _bad_input_cases()
# every backend there is here (every one implements router_fwd); the rejections come first
EVERY_BACKEND = Op("every backend", None, None, "router_fwd")


@pytest.mark.parametrize(
    "case,backend",
    _params(BAD_CASES, lambda c: EVERY_BACKEND, lambda c: c.name),
    indirect=["backend"],
)
def test_bad_input_on_every_backend(case, backend):
    """Every rejection of test_bad_inputs.py with ``backend=`` forced: the same error, and every
    tensor the call received bitwise unchanged."""
    exc, fragment = case.error
    before = _snapshot(case.args)
    extra = case.extra() if case.extra else None
    with pytest.raises(exc) as info:
        case.call(**case.args, backend=backend)
    assert fragment in str(info.value), (fragment, str(info.value))
    _assert_unchanged(before)
    if extra is not None:
        now = case.extra()
        for key, value in extra.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(now[key], value), key
            else:
                assert now[key] == value, key


def _hostile_rejections():
    """(op, argument overrides, error type, message fragment)."""
    cases = []
    for op in OPS.values():
        args = op.make(T0)
        for name, value in args.items():
            if not isinstance(value, torch.Tensor):
                continue
            cases.append(
                (op, f"{name}-meta", {name: value.to("meta")}, ValueError, f"{name} is on the meta")
            )
            if value.dim() == 2 and value.dtype in (torch.float32, torch.int32):
                sparse = value.cpu().to_sparse()
                cases.append(
                    (op, f"{name}-sparse", {name: sparse}, TypeError, f"{name} must be a dense")
                )
    for op_name in ("fused_topk_with_score_function", "biased_topk"):
        op = OPS[op_name]
        for value in ("no", 2, None, 0.5):
            cases.append((op, f"approximate-{value!r}", {"approximate_activation": value}, TypeError, "approximate_activation"))  # fmt: skip
    return cases


HOSTILE = _hostile_rejections()


@pytest.mark.parametrize(
    "case,backend", _params(HOSTILE, lambda c: c[0], lambda c: f"{c[0].name}-{c[1]}"), indirect=["backend"]
)  # fmt: skip
def test_hostile_rejection(case, backend):
    """Meta and sparse tensors for every tensor argument, flags that are not bools: rejected
    naming the argument, every tensor unchanged."""
    op, _, overrides, exc, fragment = case
    args = dict(op.make(T0), **overrides)
    before = _snapshot(args)
    with pytest.raises(exc, match=fragment):
        _call(op, args, backend)
    _assert_unchanged(before)


# ---------------------------------------------------------------------------------------------
# Settings at and past their bounds
# ---------------------------------------------------------------------------------------------
@dataclass
class Setting:
    op: str
    label: str
    overrides: dict
    error: tuple | None = None  # (type, fragment); None: accepted, the oracle's answer
    args: Callable | None = None  # base arguments (default: the op's)
    marks: list = field(default_factory=list)


def _s(op, label, overrides, error=None, **kw):
    return Setting(op, label, overrides, error, **kw)


_no_idx = dict(topk_indices=None)
SETTINGS = [
    _s(R, "topk=1", dict(topk=1, **_no_idx)),
    _s(R, "topk=E", dict(topk=E, **_no_idx)),
    _s(R, "topk=0", dict(topk=0), (ValueError, "topk must be >= 1")),
    _s(R, "topk=E+1", dict(topk=E + 1), (ValueError, "topk must be <= 8")),
    _s(R, "groups=E", dict(num_groups=E, group_topk=2, **_no_idx)),
    _s(R, "groups=E+1", dict(num_groups=E + 1, group_topk=1), (ValueError, "num_groups")),
    _s(R, "group_topk>groups", dict(num_groups=2, group_topk=3), (ValueError, "group_topk")),
    _s(R, "scaling=0", dict(scaling_factor=0.0)),
    _s(R, "scaling=-1e30", dict(scaling_factor=-1e30)),
    _s(R, "scaling=inf", dict(scaling_factor=float("inf")), (ValueError, "scaling_factor")),
    _s(R, "approximate=np.bool_", dict(approximate_activation=np.bool_(False))),
    _s(R, "approximate=1", dict(approximate_activation=1)),
    _s(B, "topk=1", dict(topk=1)),
    _s(B, "topk=E", dict(topk=E)),
    _s(B, "topk=0", dict(topk=0), (ValueError, "topk")),
    _s(B, "topk=E+1", dict(topk=E + 1), (ValueError, "topk must be <= 8")),
    _s(B, "groups=4 x 1", dict(num_groups=4, group_topk=1)),
    _s(B, "groups too few experts", dict(num_groups=4, group_topk=1, topk=3), (ValueError, "topk=3 exceeds")),  # fmt: skip
    _s(B, "scaling=nan", dict(scaling_factor=float("nan")), (ValueError, "scaling_factor")),
    _s(B, "renormalize=0", dict(renormalize=0)),
    _s(B, "renormalize=2", dict(renormalize=2), (TypeError, "renormalize")),
    _s(RR, "E=1", dict(num_experts=1, counters=_dev(torch.zeros(1, dtype=torch.int32)))),
    _s(RR, "E=0", dict(num_experts=0), (ValueError, "num_experts")),
    _s(RR, "E=2^16+1", dict(num_experts=2**16 + 1), (ValueError, "num_experts must be <= 65536")),
    _s(RR, "capacity=0", dict(capacity=0)),
    _s(RR, "capacity=int32 max / E", dict(capacity=INT32_MAX // E)),
    _s(
        RR,
        "capacity past int32 rows",
        dict(capacity=INT32_MAX // E + 1),
        (ValueError, "int32 rows"),
    ),
    _s(RR, "capacity=-1", dict(capacity=-1), (ValueError, "capacity")),
    _s(
        RR,
        "counters=int32 max",
        dict(counters=_dev(torch.full((E,), INT32_MAX, dtype=torch.int32))),
    ),
    _s(
        RR, "counters=int32 min", dict(counters=_dev(torch.full((E,), -(2**31), dtype=torch.int32)))
    ),
    _s(AL, "block=1", dict(block_size=1)),
    _s(AL, "block=0", dict(block_size=0), (ValueError, "block_size")),
    _s(AL, "block past padding", dict(block_size=2**26 // E + 2), (ValueError, "padding rows")),
    _s(AL, "block=2^31", dict(block_size=2**31), (ValueError, "block_size")),
    _s(AL, "E=1", dict(num_experts=1, expert_map=None)),
    _s(AL, "E=4096", dict(num_experts=4096, expert_map=None)),
    _s(AL, "E=0", dict(num_experts=0), (ValueError, "num_experts")),
    _s(AL, "E=2^16+1", dict(num_experts=2**16 + 1, expert_map=None), (ValueError, "num_experts")),
    _s(AL, "pad_sorted_ids=1", dict(pad_sorted_ids=1)),
    _s(AL, "pad_sorted_ids=str", dict(pad_sorted_ids="yes"), (TypeError, "pad_sorted_ids")),
    _s(AI, "sorted_token_ids one short", dict(sorted_token_ids=_dev(torch.zeros(layout_ops.align_min_rows(T0 * K, E, BS) - 1, dtype=torch.int32))), (ValueError, "sorted_token_ids holds")),  # fmt: skip
    _s(AI, "expert_ids one short", dict(expert_ids=_dev(torch.zeros(layout_ops.align_min_rows(T0 * K, E, BS) // BS - 1, dtype=torch.int32))), (ValueError, "expert_ids holds")),  # fmt: skip
    _s(AI, "num_tokens_post_pad 2", dict(num_tokens_post_pad=_dev(torch.zeros(2, dtype=torch.int32))), (ValueError, "one element")),  # fmt: skip
    _s(SC, "num_out=T (lower bound)", dict(output_split_sizes=_dev(torch.tensor(_split(T0)[::-1], dtype=torch.int32)), num_out_tokens=T0)),  # fmt: skip
    _s(SC, "num_out=T-1", dict(num_out_tokens=T0 - 1), (ValueError, "num_out_tokens")),
    _s(SC, "num_out=2^31", dict(num_out_tokens=2**31), (ValueError, "num_out_tokens")),
    _s(UR, "num_tokens=0", dict(num_tokens=0)),
    _s(UR, "num_tokens=-1", dict(num_tokens=-1), (ValueError, "num_tokens")),
    _s(UR, "num_tokens=2^31", dict(num_tokens=2**31), (ValueError, "num_tokens")),
    _s(S, "topk=1", dict(topk=1)),
    _s(S, "topk=E", dict(topk=E)),
    _s(S, "topk=E+1", dict(topk=E + 1), (ValueError, "topk")),
    _s(A, "num_experts=1", dict(num_experts=1)),
    _s(A, "num_experts=0", dict(num_experts=0), (ValueError, "num_experts")),
    _s(A, "topk=1", dict(topk=1)),
    _s(A, "topk=0", dict(topk=0), (ValueError, "topk")),
    _s(A, "total=1 (host)", dict(total_num_tokens=1)),
    _s(A, "total=0 (host)", dict(total_num_tokens=0), (ValueError, "total_num_tokens")),
    _s(A, "total int32 tensor", dict(total_num_tokens=_dev(torch.tensor(4, dtype=torch.int32))), (TypeError, "total_num_tokens")),  # fmt: skip
    _s(A, "coeff=0", dict(coeff=0.0)),
    _s(A, "coeff=-1", dict(coeff=-1.0)),
    _s(A, "coeff=inf", dict(coeff=float("inf")), (ValueError, "coeff")),
    _s(AF, "rate=0", dict(rate=0.0)),
    _s(AF, "rate=nan", dict(rate=float("nan")), (ValueError, "rate")),
]


@pytest.mark.parametrize(
    "case,backend",
    _params(SETTINGS, lambda c: OPS[c.op], lambda c: f"{c.op}-{c.label}"),
    indirect=["backend"],
)
def test_setting_bounds(case, backend):
    """A setting at its bound: the oracle's answer; past it: rejected, every tensor unchanged."""
    op = OPS[case.op]
    args = dict(op.make(T0), **case.overrides)
    if case.error is not None:
        exc, fragment = case.error
        before = _snapshot(args)
        with pytest.raises(exc, match=fragment):
            _call(op, args, backend)
        _assert_unchanged(before)
        return
    ref = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    got = _results(op, _call(op, args, backend), args)
    want = _results(op, _call(op, ref, "torch"), ref)
    _assert_same(got, want, exact=not op.rounded, what=case.label)


# ---------------------------------------------------------------------------------------------
# Values the host cannot check: the documented outcomes
# ---------------------------------------------------------------------------------------------
def _aux(backend, **kw):
    return amdqb.fused_moe_aux_loss(**dict(_aux_args(T0), **kw), backend=backend)


@pytest.mark.parametrize("backend", _on_backends(OPS[A]), indirect=True)
def test_aux_loss_device_values(backend):
    """Device token counts and loads the host never reads: T = 0 gives an infinite loss (NaN
    with coeff 0), -T the loss of T, negated counts the negated loss, a NaN count NaN."""
    t = lambda v: _dev(torch.tensor(v, dtype=torch.int64))  # noqa: E731
    assert torch.isinf(_aux(backend, total_num_tokens=t(0)))  # C = prefix / 0 / 0
    assert torch.isnan(_aux(backend, total_num_tokens=t(0), coeff=0.0))
    pos = _aux(backend, total_num_tokens=t(T0 * K))
    assert torch.equal(_aux(backend, total_num_tokens=t(-T0 * K)), pos)
    tpe = _aux_args(T0)["tokens_per_expert"]
    assert torch.equal(_aux(backend, tokens_per_expert=-tpe), -pos)
    nan_tpe = tpe.float()
    nan_tpe[3] = float("nan")
    assert torch.isnan(_aux(backend, tokens_per_expert=nan_tpe))


@pytest.mark.parametrize(
    "load,want",
    [
        ([float("nan"), 1.0, 2.0], "nan"),
        ([float("inf"), 1.0, 2.0], "nan"),
        ([0.0, 0.0], 0.0),
        ([], 0.0),
        ([3.0, 3.0, 3.0], 0.0),
        ([10.0, 0.0, 5.0, 5.0], 1.0),
    ],
)
def test_maxvio_degenerate_loads(load, want):
    got = float(amdqb.maxvio(_dev(torch.tensor(load))))
    assert np.isnan(got) if want == "nan" else got == pytest.approx(want)
    if want == "nan" and not np.isinf(load[0]):
        assert np.isnan(float(amdqb.cv2(_dev(torch.tensor(load)))))


BIG = 2**32  # an int64 id of BIG + e must not alias expert e


@pytest.mark.parametrize("backend", _on_backends(OPS[RR]), indirect=True)
def test_int64_ids_past_int32(backend):
    """int64 ids past int32 drop (compared in 64 bits), never alias the expert of their low
    32 bits: the answer of the same ids set to -1."""
    ids = _ids(T0, dtype=torch.int64)
    far = ids.clone()
    far[::2, 0] = BIG + 3
    far[1::2, 1] = -BIG + 1
    dropped = far.clone()
    dropped[(far >= BIG) | (far < -(2**31))] = -1
    for det in (True, False):
        got = amdqb.moe_route_rows(far, E, deterministic=det, capacity=4, backend=backend)
        want = amdqb.moe_route_rows(dropped, E, deterministic=det, capacity=4, backend="torch")
        assert torch.equal(got[1], want[1])
        assert torch.equal(got[0] < 0, want[0] < 0)
    got = amdqb.moe_align_block_size(far, BS, E, backend=backend)
    want = amdqb.moe_align_block_size(dropped, BS, E, backend="torch")
    _assert_same(list(got), list(want), what="align")


def test_int64_expert_map_past_int32():
    ids = _ids(T0)
    emap = _dev(torch.arange(E, dtype=torch.int64))
    emap[2], emap[5] = BIG + 1, -(2**31) - 1
    got = amdqb.moe_align_block_size(ids, BS, E, emap, backend="torch")[1]
    plain = amdqb.moe_align_block_size(ids, BS, E, backend="torch")[1]
    want = torch.where((plain == 2) | (plain == 5), -1, plain)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", _on_backends(OPS[SC]), indirect=True)
def test_int64_chunk_metadata_past_int32(backend):
    """An int64 sorted index past int32 names no chunk; an int64 size past int32 is clamped."""
    args = _chunks_args(T0)
    args["split_sizes"] = args["split_sizes"].long()
    args["sorted_indices"] = _dev(torch.tensor([2, BIG + 1, 0], dtype=torch.int64))
    args["output_split_sizes"] = _dev(torch.tensor([3, BIG + 2, 4], dtype=torch.int64))
    args["num_out_tokens"] = 12
    got = amdqb.moe_sort_chunks_and_pad(**args, backend=backend)
    dropped = dict(args, sorted_indices=_dev(torch.tensor([2, -1, 0], dtype=torch.int64)))
    want = amdqb.moe_sort_chunks_and_pad(**dropped, backend="torch")
    _assert_same(list(got), list(want), what="int64 chunk metadata")
    assert torch.equal(got[2][3:], torch.full_like(got[2][3:], -1))  # the clamped chunk: padding


# ---------------------------------------------------------------------------------------------
# torch.compile: static, dynamic and automatic-dynamic shapes; rejections from a compiled graph
# ---------------------------------------------------------------------------------------------
def _alias_counters(args):
    args["counters"] = args["topk_ids"].view(-1)[:E]


def _alias_indices(args):
    args["topk_indices"] = args["logits"].view(-1)[: args["logits"].shape[0] * K].view(torch.int32).view(-1, K)  # fmt: skip


def _alias_sorted(args):
    args["num_tokens_post_pad"] = args["topk_ids"].view(-1)[:1]


def _bad(key, value):
    def mutate(args):
        args[key] = value

    return mutate


AUX_HOST = Op(
    A,
    amdqb.fused_moe_aux_loss,
    lambda t, seed=0: dict(_aux_args(t, seed), total_num_tokens=t * K),
    "aux_loss_fwd",
)
COMPILE_OPS = {
    R: (OPS[R], _alias_indices),
    B: (OPS[B], _bad("expert_bias", _dev(torch.zeros(E - 1)))),
    RR: (OPS[RR], _alias_counters),
    AL: (OPS[AL], _bad("block_size", 0)),
    AI: (OPS[AI], _alias_sorted),
    SC: (OPS[SC], _bad("num_out_tokens", 1)),
    UR: (OPS[UR], _bad("row_map", _dev(torch.zeros(3, dtype=torch.int64)))),
    S: (OPS[S], _bad("topk", E + 1)),
    A: (OPS[A], _bad("tokens_per_expert", _dev(torch.zeros(E + 1)))),
    "fused_moe_aux_loss(host total)": (AUX_HOST, _bad("total_num_tokens", 0)),
}
COMPILE_MODES = {"static": False, "dynamic": True, "auto": None}
COMPILE_CASES = [(op, mode) for op in COMPILE_OPS for mode in COMPILE_MODES]
# Static shapes trace on the oracle alone: the backend only changes what runs inside the traced
# kernel-level op, which the dynamic modes run on every backend (a third of the file's time saved).
COMPILE_PARAMS = [
    p
    for p in _params(COMPILE_CASES, lambda c: COMPILE_OPS[c[0]][0], lambda c: f"{c[0]}-{c[1]}")
    if p.values[0][1] != "static" or p.values[1] == "torch"
]


@pytest.mark.parametrize("case,backend", COMPILE_PARAMS, indirect=["backend"])
def test_compiled(case, backend):
    """The compiled op gives the eager answer at three token counts (the second traces again with
    dynamic shapes under ``auto``), then raises the eager error on a bad call, state unchanged."""
    op_name, mode = case
    op, mutate = COMPILE_OPS[op_name]
    torch._dynamo.reset()

    def run(args):
        return _call(op, args, backend)

    compiled = torch.compile(run, fullgraph=True, backend="aot_eager", dynamic=COMPILE_MODES[mode])
    for t in (4, 7, 9):
        eager_args, args = op.make(t, seed=t), op.make(t, seed=t)
        want = _results(op, _call(op, eager_args, backend), eager_args)
        got = _results(op, compiled(args), args)
        _assert_same(got, want, what=f"{op_name} compiled ({mode}) at T={t}")
    args = op.make(9, seed=1)
    mutate(args)
    before = _snapshot(args)
    with pytest.raises((ValueError, TypeError, torch._dynamo.exc.Unsupported)) as info:
        compiled(args)
    eager = dict(args)
    with pytest.raises((ValueError, TypeError)) as eager_info:
        _call(op, eager, backend)
    # the same check failed: the eager message, sizes aside (dynamic shapes print as symbols)
    want, got = _sizes_masked(str(eager_info.value)), _sizes_masked(_chain(info.value))
    # Dynamo before torch 2.13 drops the arguments of an exception whose message formats a
    # symbolic size, reporting only its class: then the class is what can be compared.
    dropped = f"raised exception ExceptionVariable({type(eager_info.value)})"
    assert want in got or (dropped in got and _torch_before(2, 13)), (want, got)
    _assert_unchanged(before)


def _torch_before(major: int, minor: int) -> bool:
    return tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2]) < (major, minor)


def _sizes_masked(text: str) -> str:
    return re.sub(r"\b(s\d+|\d+)\b", "#", text)


def _chain(exc) -> str:
    """An error's message and its causes' (torch.compile(fullgraph=True) reports an error raised
    while tracing as an ``Unsupported`` error caused by it)."""
    text = []
    while exc is not None:
        text.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return "\n".join(text)


@pytest.mark.skipif(not HAS_GPU, reason="inductor's CPU code generation is slow to compile; the GPU run covers it")  # fmt: skip
@pytest.mark.parametrize("op_name", [RR, AI, R])
def test_compiled_inductor_rejects_overlap(op_name):
    """Under inductor (dynamic shapes) the overlap check still runs before the op's kernels."""
    op = OPS[op_name]
    torch._dynamo.reset()
    compiled = torch.compile(lambda a: _call(op, a, None), fullgraph=True, dynamic=True)
    for t in (5, 7):
        eager_args, args = op.make(t, seed=t), op.make(t, seed=t)
        want = _results(op, _call(op, eager_args, None), eager_args)
        _assert_same(_results(op, compiled(args), args), want, what=f"inductor T={t}")
    args = op.make(9, seed=1)
    COMPILE_OPS[op_name][1](args)
    before = _snapshot(args)
    with pytest.raises(ValueError, match="overlap"):
        compiled(args)
    _assert_unchanged(before)


@pytest.mark.parametrize("num_experts", [8, 896, 4096, 4097])
def test_route_gate_is_route_impl(num_experts):
    """The gate traced code evaluates (a constant threshold against the route count, symbolic
    under dynamic shapes) picks what ``route_impl`` reports, on both sides of the threshold."""
    from amdqb import configs, dispatch

    info = dispatch.device_info(DEVICE)
    threshold = layout_ops.lds_route_threshold(num_experts, configs.load(info.arch_family))
    for routes in {0, 1, max(threshold - 1, 0), threshold, threshold + 1, 10**6}:
        want = layout_ops.route_impl(info, routes, num_experts)[0]
        assert layout_ops._gate(DEVICE, routes, num_experts) == want, (routes, threshold)
