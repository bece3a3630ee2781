"""``biased_topk``, the serving-form router (vLLM / SGLang ``fused_topk``): ids in selection order
and fp32 weights against the ``amdqb.ref`` oracle for every kernel backend of ``biased_topk``; the
hip kernel's weights as its own scores renormalised (emulator) and at the seeds' shape (GPU); its
decode form (one block per token) bitwise against its warp-per-token form; and the oracle against
a hand-computed case.

Ids must be exact, (value desc, id asc) with NaN last; weights agree to fp32 rounding. On the CPU
the Triton kernels run under ``TRITON_INTERPRET=1`` and the hip kernels on the emulator.
"""

import ctypes

import pytest
import torch

import amdqb
from amdqb import dispatch, ref
from amdqb.backends.calls import TopkCall
from amdqb.backends.hip import _spec
from amdqb.backends.hip.topk import plan as topk_plan

from conftest import DEVICE, GCN, HAS_GPU, device_config, expect_declined, over_backends, set_config
from hip_emu.checks import make_logits
from router_cases import (
    E_MAIN,
    GROUPS,
    K_MAIN,
    T_MAIN,
    adversarial_rows,
    count_decode_launches,
    kernel_scores,
    tie_free_logits,
    tol,
)

# hip's own GPU tests (the emulator runs the small cases)
hip_gpu = pytest.mark.skipif(
    not HAS_GPU, reason="hip kernels at GPU shapes (on the CPU the emulator runs the small cases)"
)


# ----------------------------------------------------------------------------------------------
# every kernel backend
# ----------------------------------------------------------------------------------------------


@over_backends("biased_topk")
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize(
    "score,bias", [("sigmoid", True), ("sqrtsoftplus", False), ("softmax", False)]
)
def test_biased_topk(backend, score, bias, grouped, renormalize):
    t, e, k = T_MAIN, E_MAIN, K_MAIN
    z = tie_free_logits(t, e, seed=17)
    eb = torch.linspace(0.3, -0.3, e, device=DEVICE) if bias else None
    groups = dict(num_groups=GROUPS[0], group_topk=GROUPS[1]) if grouped else {}
    # hip runs groups that split into whole lanes of amdqb_topk (the CPU shape's 4 groups of 16);
    # the GPU shape's 8 groups of 112 experts do not fit its registers
    no_plan = grouped and topk_plan(e, k, score, *GROUPS, device_config()) is None
    expect_declined(
        backend, "biased_topk", backend == "hip" and no_plan, num_experts=e, topk=k, **groups
    )
    kw = dict(score_function=score, renormalize=renormalize, scaling_factor=2.5, **groups)
    w, ids = amdqb.biased_topk(z, k, eb, backend=backend, **kw)
    w_ref, ids_ref = ref.biased_topk(z, k, eb, **kw)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, **tol(e))


@over_backends("biased_topk")
@pytest.mark.parametrize("score,bias", [("softmax", False), ("sigmoid", True)])
@pytest.mark.parametrize("e,k", [(8, 2), (40, 12), (64, 6), (64, 3), (64, 1)])
def test_biased_topk_rows_of_few_lanes(monkeypatch, backend, score, bias, e, k):
    """hip's rows of few lanes (from hip.topk.wide_min_tokens tokens on at E >=
    hip.topk.wide_min_experts; E=8: a thread per row,
    E=40: k=12 routes over 8 lanes; E=64, k <= 4: each lane's best k of its 8 by the partial
    selection) give the oracle's ids and the same bits as its decode rows
    (the softmax sum and the weights' sum keep their order)."""
    z = tie_free_logits(9, e, seed=e + k)
    eb = torch.linspace(0.2, -0.2, e, device=DEVICE) if bias else None
    kw = dict(score_function=score, renormalize=True, scaling_factor=2.5)
    decode = amdqb.biased_topk(z, k, eb, backend=backend, **kw)
    set_config(monkeypatch, {"hip.topk.wide_min_tokens": 1, "hip.topk.wide_min_experts": 1})
    if backend == "hip":
        wide = topk_plan(e, k, score, None, None, device_config(), tokens=9)
        assert wide.lanes < topk_plan(e, k, score, None, None, device_config()).lanes
    w, ids = amdqb.biased_topk(z, k, eb, backend=backend, **kw)
    w_ref, ids_ref = ref.biased_topk(z, k, eb, **kw)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, **tol(e))
    assert torch.equal(ids, decode[1]) and torch.equal(w, decode[0])


@over_backends("biased_topk", only=("hip",), gcn=GCN[:1])
@pytest.mark.parametrize("score,bias", [("softmax", False), ("sigmoid", True)])
@pytest.mark.parametrize("e,k,groups", [(64, 6, None), (40, 12, None), (64, 8, (4, 2))])
def test_biased_topk_rounds_give_the_merged_list(monkeypatch, backend, score, bias, e, k, groups):
    """hip's row Top-k by rounds of a butterfly max (from hip.topk.rounds_min_tokens tokens on)
    gives the ids and the bits of its list merges, tied and NaN rows included."""
    z = torch.cat([tie_free_logits(9, e, seed=e + k), adversarial_rows(e)])
    eb = torch.linspace(0.2, -0.2, e, device=DEVICE) if bias else None
    kw = dict(score_function=score, renormalize=True, scaling_factor=2.5)
    if groups:
        kw.update(num_groups=groups[0], group_topk=groups[1])
    merged = amdqb.biased_topk(z, k, eb, backend=backend, **kw)
    set_config(monkeypatch, {"hip.topk.rounds_min_tokens": 1})
    plan = topk_plan(e, k, score, *(groups or (None, None)), device_config(), tokens=z.shape[0])
    assert plan is not None and plan.rounds
    rounds = amdqb.biased_topk(z, k, eb, backend=backend, **kw)
    bits = [w.view(torch.int32) for w in (rounds[0], merged[0])]  # NaN weights compare too
    assert torch.equal(rounds[1], merged[1]) and torch.equal(*bits)
    assert torch.equal(rounds[1], ref.biased_topk(z, k, eb, **kw)[1])


def _boundary_ties(t, e, k, seed):
    """Tie-free rows, each given one tie: every other row its k-th and (k+1)-th values equal
    (which of them is routed is the id order's call), the others two equal values inside the
    Top-k (their order is)."""
    z = tie_free_logits(t, e, seed=seed)
    for r in range(t):
        order = z[r].argsort(descending=True)
        a, b = (order[k - 1], order[k]) if r % 2 == 0 else (order[0], order[min(1, k - 1)])
        z[r, b] = z[r, a]
    return z


@over_backends("biased_topk", only=("hip",), gcn=GCN[:1])
@pytest.mark.parametrize("score,bias", [("softmax", False), ("sigmoid", True)])
@pytest.mark.parametrize(
    "e,k,groups", [(8, 2, None), (64, 6, None), (40, 12, None), (64, 8, (4, 2))]
)
@pytest.mark.parametrize("rows", ["decode", "wide"])
def test_biased_topk_key_select_gives_the_entries_list(
    monkeypatch, backend, emu_rt, score, bias, e, k, groups, rows
):
    """hip's row Top-k over the 32-bit keys (hip.topk.key_select_min_experts) gives the ids and
    the bits of the 64-bit entries' selection: tie-free rows by the keys, rows with a tie at or
    inside the Top-k, NaN rows and too few kept experts by the entries, also where such a row
    shares its logical warp with tie-free ones; in rows of several lanes (decode) and of few
    (wide: E=8 a thread per row)."""
    z = torch.cat(
        [
            tie_free_logits(9, e, seed=e + k),
            _boundary_ties(6, e, k, seed=e * k),
            adversarial_rows(e),
            tie_free_logits(33, e, seed=e - k),
        ]
    )
    eb = torch.linspace(0.2, -0.2, e, device=DEVICE) if bias else None
    kw = dict(score_function=score, renormalize=True, scaling_factor=2.5)
    if groups:
        kw.update(num_groups=groups[0], group_topk=groups[1])
    wide = {"hip.topk.wide_min_tokens": 1, "hip.topk.wide_min_experts": 1} if rows == "wide" else {}
    set_config(monkeypatch, {"hip.topk.key_select_min_experts": 1 << 30, **wide})
    entries = amdqb.biased_topk(z, k, eb, backend=backend, **kw)
    cfg = set_config(monkeypatch, {"hip.topk.key_select_min_experts": 1, **wide})
    keys = amdqb.biased_topk(z, k, eb, backend=backend, **kw)
    bits = [w.view(torch.int32) for w in (keys[0], entries[0])]  # NaN weights compare too
    assert torch.equal(keys[1], entries[1]) and torch.equal(*bits)
    assert torch.equal(keys[1], ref.biased_topk(z, k, eb, **kw)[1])
    if emu_rt is None:
        return
    # the emulator counts the logical warps that took the entries: some above, none for a batch
    # of tie-free rows alone
    plan = topk_plan(e, k, score, *(groups or (None, None)), cfg, 2 if bias else 1, tokens=33)
    spec = _spec.topk_module(plan, "float32", "float32" if bias else None, score, cfg)
    tied = emu_rt._library(spec).amdqb_emu_tied_keys
    tied.restype = ctypes.c_longlong
    assert tied() > 0
    before = tied()
    tail = amdqb.biased_topk(z[-33:], k, eb, backend=backend, **kw)
    assert torch.equal(tail[1], keys[1][-33:]) and tied() == before


@over_backends("biased_topk")
def test_biased_topk_shapes_and_ties(backend):
    e = E_MAIN
    z = adversarial_rows(e)
    cap = device_config()["hip.router.cap"]  # hip selects at most this many experts per token
    for k in (1, e):
        no_plan = k > cap and topk_plan(e, k, "sigmoid", None, None, device_config()) is None
        if expect_declined(
            backend, "biased_topk", backend == "hip" and no_plan, skip=False, num_experts=e, topk=k
        ):
            continue
        w, ids = amdqb.biased_topk(z, k, backend=backend)
        s = kernel_scores(backend, z, "sigmoid")
        assert torch.equal(ids.long(), ref.ranked_indices(s, k))
    x = tie_free_logits(6, e).reshape(2, 3, e)
    w, ids = amdqb.biased_topk(x, 4, backend=backend)
    assert w.shape == (2, 3, 4) and ids.shape == (2, 3, 4)
    w0, ids0 = amdqb.biased_topk(x.reshape(-1, e)[:0], 4, backend=backend)
    assert w0.shape == (0, 4) and ids0.shape == (0, 4)
    # direct call of the kernel-level op
    wo = torch.full((6, 4), float("nan"), device=DEVICE)
    io = torch.full((6, 4), -1, dtype=torch.int32, device=DEVICE)
    op = dispatch._backend_module(backend).OPS["biased_topk"]
    op(TopkCall(e, 4), x.reshape(-1, e), None, wo, io, None, None)
    assert torch.equal(io, ids.reshape(-1, 4))
    torch.testing.assert_close(wo, w.reshape(-1, 4))


# ----------------------------------------------------------------------------------------------
# hip
# ----------------------------------------------------------------------------------------------


@over_backends("biased_topk", emulator=True)
@pytest.mark.parametrize("score", ["sigmoid", "softmax", "sqrtsoftplus"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_biased_topk_weights_are_the_own_scores(backend, score, renormalize):
    """The kernel's weights are its own scores of the selected experts (renormalised), scaled."""
    e, t, k = 384, 10, 8
    logits = make_logits(t, e, "normal", 4)
    bias = None if score == "softmax" else torch.randn(e) * 0.05
    w, ids = amdqb.biased_topk(
        logits,
        k,
        bias,
        score_function=score,
        renormalize=renormalize,
        scaling_factor=0.5,
        backend=backend,
    )
    s = kernel_scores("hip", logits, score)
    sel = s if bias is None else s + bias
    want_ids = ref.ordering.ranked_indices(sel, k).to(torch.int32)
    assert torch.equal(ids, want_ids)
    want_w, _ = ref.biased_topk(logits, k, bias, score, renormalize, 0.5)
    torch.testing.assert_close(w, want_w, atol=1e-6, rtol=1e-4)
    gathered = s.gather(1, ids.long())
    if renormalize:
        gathered = gathered / (gathered.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(w, gathered * 0.5, atol=1e-7, rtol=1e-6)


@hip_gpu
@over_backends("biased_topk", only=("hip",))
@pytest.mark.parametrize("score", ["sigmoid", "softmax", "sqrtsoftplus"])
@pytest.mark.parametrize("t", [1, 8, 64, 256])
def test_biased_topk_matches_oracle_on_own_scores(backend, score, t):
    e, k = 896, 16
    logits = make_logits(t, e, "normal", t).to(DEVICE)
    bias = None if score == "softmax" else torch.randn(e, device=DEVICE) * 0.05
    w, ids = amdqb.biased_topk(logits, k, bias, score_function=score, backend=backend)
    s = kernel_scores("hip", logits, score).cpu()
    sel = s if bias is None else s + bias.cpu()
    assert torch.equal(ids.cpu(), ref.ordering.ranked_indices(sel, k).to(torch.int32))
    want_w, _ = ref.biased_topk(logits.cpu(), k, None if bias is None else bias.cpu(), score)
    torch.testing.assert_close(w.cpu(), want_w, atol=1e-6, rtol=1e-4)


@hip_gpu
@over_backends("biased_topk", only=("hip",))
@pytest.mark.parametrize("score,bias", [("softmax", False), ("sigmoid", True)])
@pytest.mark.parametrize("e,k,slots", [(8, 2, 1), (8, 2, 2), (8, 2, 4), (8, 2, 8), (128, 8, 8)])
def test_biased_topk_quotient_fast_path_is_the_division(
    monkeypatch, backend, score, bias, e, k, slots
):
    """amdqb_topk's softmax and weight quotients (on NVIDIA with the IEEE division's fast path
    written out, amdqb_activation.h quotient_fast) equal the module built with the compiler's own
    division (-DAMDQB_DIVISION_ONLY), bit for bit: normal rows, logits spread so wide that the
    softmax's exponentials are tiny, denormal or zero, and the adversarial rows (NaN, inf, ties)."""
    g = torch.Generator().manual_seed(e * 31 + k)
    wide = torch.randn(200, e, generator=g) * torch.logspace(0, 2.3, 200).unsqueeze(1)
    z = torch.cat([wide.to(DEVICE), tie_free_logits(56, e, seed=e), adversarial_rows(e)])
    eb = torch.linspace(0.2, -0.2, e, device=DEVICE) if bias else None
    set_config(monkeypatch, {"hip.topk.decode_lane_slots": slots, "hip.topk.lane_slots": slots})
    kw = dict(score_function=score, renormalize=True, scaling_factor=2.5)
    fast = amdqb.biased_topk(z, k, eb, backend=backend, **kw)
    base = _spec.topk_module
    monkeypatch.setattr(
        _spec,
        "topk_module",
        lambda *a, **kw_: base(*a, **kw_).with_defines(("AMDQB_DIVISION_ONLY", "1")),
    )
    division = amdqb.biased_topk(z, k, eb, backend=backend, **kw)
    assert torch.equal(fast[1], division[1])
    assert torch.equal(fast[0].view(torch.int32), division[0].view(torch.int32))
    if score == "softmax":  # routed scores below the fast path's range: the division's
        weights = fast[0][: wide.shape[0]]
        assert bool(((weights > 0) & (weights < 1e-19)).any()), "no weight left the fast path"


# (E, k, logits dtype, style): the emulator's at 3 tokens, the GPU's at 37
DECODE_TOPK_CASES = (
    [
        (896, 16, torch.float32, "ties"),
        (896, 16, torch.bfloat16, "normal"),
        (300, 32, torch.float32, "nan_inf"),  # n = 32: full 32-entry lists
        (64, 8, torch.float16, "ties"),
        (4096, 24, torch.float32, "saturated"),
    ]
    if HAS_GPU
    else [
        (64, 8, torch.float32, "ties"),  # one warp: its list is the answer
        (300, 32, torch.float32, "normal"),  # 3 warps, partial last row, n = 32 (full lists)
        (300, 4, torch.float32, "nan_inf"),
        (896, 16, torch.float32, "ties"),  # the SPEC shape: 8 warps of 4 experts per thread
        (1100, 16, torch.float32, "saturated"),  # 8 warps, 5 experts per thread, partial
    ]
)


@over_backends("biased_topk", only=("hip",), waves=(32, 64), gcn=GCN)
@pytest.mark.parametrize("e,k,dtype,style", DECODE_TOPK_CASES)
def test_biased_topk_decode_kernel_is_bitwise_the_warp_kernel(
    monkeypatch, backend, emu_rt, e, k, dtype, style
):
    """amdqb_router_decode (one block per token) against amdqb_router's serving form (one warp per
    token): identical ids and identical weight bits, ids in the oracle's order on the kernel's own
    scores. Emulator (wave32 and wave64: even warp counts, whole 64-lane waves): with and without
    bias and renormalisation at 3 tokens; GPU: with bias at 37 tokens."""
    if HAS_GPU:
        t, seed, scaling, renorms = 37, e, 1.5, (True,)
        biases = [(torch.randint(-2, 3, (e,)) * 0.125).float().to(DEVICE)]
    else:
        t, seed, scaling, renorms = 3, e + k, 0.75, (True, False)
        g = torch.Generator().manual_seed(e)
        biases = [None, (torch.randint(-2, 3, (e,), generator=g) * 0.25).float()]
    logits = make_logits(t, e, style, seed, dtype).to(DEVICE)
    forms = count_decode_launches(monkeypatch)
    for bias in biases:
        for renorm in renorms:
            outs = []
            for limit in (1 << 30, 0):
                set_config(
                    monkeypatch,
                    # the router kernels (amdqb_topk declined: no experts per lane allowed)
                    {"hip.biased_topk.decode_max_tokens": limit, "hip.topk.max_slots": 0},
                    logits.device,
                )
                forms.append(0)
                if emu_rt is not None:
                    emu_rt.launches.clear()
                outs.append(
                    amdqb.biased_topk(
                        logits,
                        k,
                        bias,
                        renormalize=renorm,
                        scaling_factor=scaling,
                        backend=backend,
                    )
                )
                if emu_rt is not None:
                    names = [n for n, *_ in emu_rt.launches]
                    assert names == ["amdqb_router_decode" if limit else "amdqb_router"]
            assert forms[-2:] == [1, 0], "the two forms did not both run"
            (w1, i1), (w2, i2) = outs
            assert torch.equal(i1, i2)
            assert torch.equal(w1.view(torch.int32), w2.view(torch.int32))
            sel = kernel_scores("hip", logits, "sigmoid").cpu()
            sel = sel if bias is None else sel + bias.cpu()
            assert torch.equal(i1.cpu(), ref.ordering.ranked_indices(sel, k).to(torch.int32))


# ----------------------------------------------------------------------------------------------
# the oracle
# ----------------------------------------------------------------------------------------------


def test_biased_topk_oracle():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    w, ids = ref.biased_topk(logits, 2, torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert ids.tolist() == [[3, 1]] and ids.dtype == torch.int32
    s = torch.sigmoid(logits[0])
    torch.testing.assert_close(w[0], torch.stack([s[3], s[1]]) / (s[3] + s[1] + 1e-20))


# ----------------------------------------------------------------------------------------------
# the peers' extra outputs (amdqb.ops.router.serving_topk, TopkCall)
# ----------------------------------------------------------------------------------------------


@over_backends("biased_topk", waves=(32, 64), gcn=GCN)
@pytest.mark.parametrize(
    "e,k,groups,score",
    [(8, 2, None, "softmax"), (256, 8, (8, 4), "sigmoid"), (40, 6, None, "sigmoid")],
)
def test_serving_outputs(backend, emu_rt, e, k, groups, score):
    """Fused shared experts (constant weight, and the routed sum over the scaling factor with every
    lane of the row holding it), token_expert_indices, padded rows from a device scalar and from
    an int, int64 ids, an fp16 / bf16 bias read in its dtype and strided logit rows: the oracle's
    outputs (ids exact, weights to fp32 rounding). On the emulator every call is one amdqb_topk
    launch (on the AMDGCN models: the prelude's AMD shuffles and ballots in that kernel)."""
    from amdqb.ops.router import serving_topk

    t = 37
    g = torch.Generator().manual_seed(e + k)
    wide = torch.randn(t, 2 * e, generator=g).to(DEVICE)
    logits = wide[:, :e]  # rows 2E apart: read through the row stride
    bias = None
    if score == "sigmoid":
        bias = (torch.randn(e, generator=g) * 0.1).to(DEVICE, torch.bfloat16)
    kw = dict(score_function=score)
    if groups:
        kw.update(num_groups=groups[0], group_topk=groups[1])
    cases = [
        dict(num_shared=2, shared_weight=0.4, ids_dtype=torch.int64),
        dict(num_shared=1, shared_div=2.5, renormalize=False, token_expert_indices=True),
        dict(non_padded=torch.tensor(t // 3, device=DEVICE), token_expert_indices=True),
        dict(non_padded=t - 5, scaling_factor=1.5, num_shared=1, shared_weight=1.0),
    ]
    for case in cases:
        opts = {**kw, **case}
        if emu_rt is not None:
            emu_rt.launches.clear()
        w, ids, tei = serving_topk(logits, k, bias, backend=backend, **opts)
        if emu_rt is not None:
            assert [n for n, *_ in emu_rt.launches] == ["amdqb_topk"], case
        oracle = {n: v for n, v in opts.items() if n not in ("ids_dtype", "token_expert_indices")}
        if isinstance(oracle.get("non_padded"), torch.Tensor):
            oracle["non_padded"] = oracle["non_padded"].cpu()
        cpu_bias = None if bias is None else bias.cpu()
        w_ref, ids_ref = ref.serving_topk(logits.contiguous().cpu(), k, cpu_bias, **oracle)
        assert ids.dtype == case.get("ids_dtype", torch.int32)
        assert torch.equal(ids.cpu().long(), ids_ref.cpu().long()), case
        torch.testing.assert_close(w.cpu(), w_ref.cpu(), rtol=1e-5, atol=1e-6)
        if case.get("token_expert_indices"):
            assert torch.equal(tei.cpu(), ref.token_expert_indices(t, k))
        else:
            assert tei is None


@over_backends("biased_topk", waves=(32,))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_input_dtype_math(monkeypatch, backend, emu_rt, dtype):
    """SGLang's moe_fused_gate arithmetic (scores, bias, biased scores and group sums rounded to
    the logits' dtype): the oracle's ids and weights on every backend that offers it, and not the
    fp32 answer (the option changes what is computed)."""
    from amdqb.compat.sglang import moe_fused_gate

    e, k, t = 256, 8, 64
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(t, e, generator=g) * 3).to(DEVICE, dtype)
    bias = (torch.randn(e, generator=g) * 0.02).to(DEVICE, dtype)
    expect_declined(
        backend,
        "biased_topk",
        backend == "triton",
        num_experts=e,
        topk=k,
        num_groups=8,
        group_topk=4,
        input_dtype_math=True,
    )
    monkeypatch.setenv("AMDQB_BACKEND", backend)  # the compat names take no backend=
    dispatch._select.cache_clear()
    if emu_rt is not None:
        emu_rt.launches.clear()
    w, ids = moe_fused_gate(x, bias, 8, 4, k, 0, 1.0, input_dtype_math=True)
    if emu_rt is not None:
        assert [n for n, *_ in emu_rt.launches] == ["amdqb_topk"]
    w_ref, ids_ref = ref.serving_topk(
        x.cpu(), k, bias.cpu(), num_groups=8, group_topk=4, input_dtype_math=True
    )
    assert torch.equal(ids.cpu().long(), ids_ref)
    torch.testing.assert_close(w.cpu(), w_ref, rtol=1e-5, atol=1e-6)
    w32, ids32 = moe_fused_gate(x, bias, 8, 4, k, 0, 1.0)
    assert not (torch.equal(ids32, ids) and torch.equal(w32, w))
