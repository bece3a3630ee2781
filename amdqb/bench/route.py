"""Route-rows benchmark: ``atomic`` (one global atomic per route) vs ``lds`` (workgroup histogram +
one reservation per non-empty expert) vs ``deterministic`` (ascending flat order, bitwise the
oracle's rows) per backend, torch ``bincount + argsort``, and
``moe_align_block_size``. Seed 004 shapes: E=896, k=16, M in {512, 2517, 8192}; distributions
uniform / shared-expert / all-one-expert / dropped. Counter zeroing is included in every timing
(the op zeroes its counters when the caller passes none), as in the seed.

Every case is checked before timing: counts equal the oracle and rows are a bijection with
per-expert ownership.
"""

from __future__ import annotations

import torch

import amdqb
from amdqb import dispatch, ref

from .common import (
    Progress,
    Report,
    TimingConfig,
    backends_for,
    environment,
    time_alternating,
)


def make_ids(m, k, e, dist, g):
    if dist == "uniform":  # k distinct experts per token
        return torch.rand(m, e, generator=g).argsort(dim=1)[:, :k].to(torch.int32)
    if dist == "shared":
        ids = torch.rand(m, e - 1, generator=g).argsort(dim=1)[:, : k - 1].to(torch.int32) + 1
        return torch.cat([torch.zeros(m, 1, dtype=torch.int32), ids], dim=1)
    if dist == "one":
        return torch.full((m, k), 7, dtype=torch.int32)
    if dist == "dropped":
        ids = torch.rand(m, e, generator=g).argsort(dim=1)[:, :k].to(torch.int32)
        ids.view(-1)[::3] = -1
        return ids
    raise ValueError(dist)


def torch_bincount_argsort(ids, e):
    """The plain-PyTorch way: counts, a stable sort by expert, offsets -> compact rows."""
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < e)
    key = torch.where(valid, flat, e)
    counts = torch.bincount(key, minlength=e + 1)[:e]
    order = torch.argsort(key, stable=True)
    rows = torch.empty_like(order)
    rows[order] = torch.arange(order.numel(), device=ids.device)
    return torch.where(valid, rows, -1), counts


def check_rows(rows, counts, ids, e, capacity):
    want_rows, want_counts = ref.moe_route_rows(ids, e, capacity)
    if not torch.equal(counts, want_counts):
        raise AssertionError("route counts differ from the oracle")
    flat, r = ids.reshape(-1).long(), rows.reshape(-1).long()
    valid = (flat >= 0) & (flat < e)
    if not torch.all(r[~valid] == -1) or r[valid].unique().numel() != int(valid.sum()):
        raise AssertionError("rows are not a bijection (duplicates or dropped ids with rows)")
    if capacity is None:  # compact layout: each expert's rows are its own contiguous range
        want = want_rows.reshape(-1).long()
        if not torch.equal(torch.sort(r[valid]).values, torch.sort(want[valid]).values):
            raise AssertionError("compact rows are not the oracle's row set")
        owner = torch.full((int(want.max()) + 1,), -1, dtype=torch.long, device=want.device)
        owner[want[valid]] = flat[valid]
        if not torch.equal(owner[r[valid]], flat[valid]):
            raise AssertionError("a compact row lies outside its expert's range")
    elif not torch.all(r[valid] // capacity == flat[valid]):
        raise AssertionError("a row lies outside its expert's capacity range")


def run(
    device,
    cfg: TimingConfig,
    tokens=(512, 2517, 8192),
    num_experts=896,
    topk=16,
    dists=("uniform", "shared", "one", "dropped", "uniform_compact"),
    block_size=64,
) -> list[Report]:
    env = environment(device)
    shape = dict(E=num_experts, k=topk, ids="int32", capacity="M*k (never drops) or compact")
    report = Report("route_rows", env, shape=shape)
    align = Report("moe_align_block_size", env, shape=dict(E=num_experts, k=topk, block=block_size))
    backends = backends_for("route_rows", device)
    g = torch.Generator().manual_seed(0)
    progress = Progress(len(tokens) * (len(dists) + 1), "route")
    for m in tokens:
        for dist in dists:
            # masked layout with a capacity that never drops (all-one-expert routes fit too), and
            # "<dist>_compact": no capacity, rows packed by expert (offsets from a counter scan)
            base, compact = dist.removesuffix("_compact"), dist.endswith("_compact")
            cap = None if compact else m * topk
            ids = make_ids(m, topk, num_experts, base, g).to(device)
            impls = {}
            for name in backends:
                for impl in ("atomic", "lds", "deterministic"):
                    kw = {"deterministic": True} if impl == "deterministic" else {"impl": impl}
                    rows, counts = amdqb.moe_route_rows(
                        ids, num_experts, capacity=cap, backend=name, **kw
                    )
                    check_rows(rows, counts, ids, num_experts, cap)
                    if impl == "deterministic":  # ascending flat order: the oracle's rows exactly
                        want_rows, _ = ref.moe_route_rows(ids, num_experts, cap)
                        if not torch.equal(rows, want_rows):
                            raise AssertionError(
                                f"{name}: deterministic rows differ from the oracle"
                            )
                    impls[f"{name}:{impl}"] = lambda n=name, k=kw: amdqb.moe_route_rows(
                        ids, num_experts, capacity=cap, backend=n, **k
                    )
            times = time_alternating(impls, device, cfg)
            # bincount sizes its output on the host, so the plain-PyTorch way cannot be captured:
            # it is timed eagerly (launch overhead and the sync included, as a user would see it)
            times.update(
                time_alternating(
                    {"torch:bincount_argsort": lambda: torch_bincount_argsort(ids, num_experts)},
                    device,
                    cfg,
                    graphs=False,
                )
            )
            for key, us in times.items():
                backend, impl = key.split(":")
                row = {"M": m, "E": num_experts, "k": topk, "dist": dist, "backend": backend}
                row.update(impl=impl, us=us)
                if impl == "lds":
                    row["atomic/lds"] = times[f"{backend}:atomic"] / us
                report.add(**row)
            progress.step(f"M={m} {dist}")
        ids = make_ids(m, topk, num_experts, "uniform", g).to(device)
        want = ref.moe_align_block_size(ids, block_size, num_experts)
        one = torch.zeros(1, device=device)
        impls = {"floor:launch": lambda one=one: one.add_(1)}  # one kernel launch, nothing else
        for name in dict.fromkeys(backends + ["torch"]):
            if "align_block_size" not in dispatch._backend_module(name).OPS:
                continue
            got = amdqb.moe_align_block_size(ids, block_size, num_experts, backend=name)
            if not all(torch.equal(a, b) for a, b in zip(got, want)):
                raise AssertionError(f"{name}: moe_align_block_size differs from the oracle")
            impls[name] = lambda n=name: amdqb.moe_align_block_size(
                ids, block_size, num_experts, backend=n
            )
        # the torch oracle sizes outputs from device values (not capturable): timed eagerly
        oracle = {"torch": impls.pop("torch")}
        times = time_alternating(impls, device, cfg)
        floor = float(times.pop("floor:launch"))
        times.update(time_alternating(oracle, device, cfg, graphs=False))
        for name, us in times.items():
            row = dict(M=m, E=num_experts, k=topk, block=block_size, backend=name, us=us)
            row.update(floor_us=floor, x_floor=float(us) / floor)
            align.add(**row)
        progress.step(f"align M={m}")
    return [report, align]
