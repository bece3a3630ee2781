"""Input generators and oracle checks shared by the hip backend's emulator and GPU tests."""

from __future__ import annotations

import torch

from amdqb import ref


def make_ids(m, k, e, dist, seed, dtype=torch.int32):
    """[m, k] expert ids: uniform / shared (expert 0 in every token) / one (all to E-1) / dropped
    (-1, E, E+5 and, for int64, 2^32 + 1 -- which must drop, not alias expert 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, e, (m, k), generator=g, dtype=torch.int64)
    if dist == "shared" and k > 1:
        ids[:, 0] = 0
    elif dist == "one":
        ids.fill_(e - 1)
    elif dist == "dropped":
        flat = ids.view(-1)
        flat[::3] = -1
        flat[1::7] = e
        flat[2::11] = e + 5
        if dtype == torch.int64:
            flat[3::13] = 2**32 + 1
    return ids.to(dtype)


def check_routes(ids, e, capacity, c0, rows, counts, counters, deterministic=False):
    """Counts and counters equal the oracle's; every expert's rows are exactly the oracle's row
    set (a bijection onto the expert's claimed slots, each row owned by one route of that expert);
    invalid ids get -1. ``deterministic``: rows bitwise equal to the oracle's."""
    ids, c0 = ids.cpu(), c0.cpu()
    rows, counts, counters = rows.cpu(), counts.cpu(), counters.cpu()
    want_counters = c0.clone()
    want_rows, want_counts = ref.moe_route_rows(ids, e, capacity, want_counters)
    assert torch.equal(counts, want_counts), "counts differ from the oracle"
    assert torch.equal(counters, want_counters), "counters differ from the oracle"
    if deterministic:
        assert torch.equal(rows, want_rows), "deterministic rows differ from the oracle"
        return
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < e)
    assert torch.all(rows.reshape(-1)[~valid] == -1), "invalid ids must get row -1"

    def per_expert(r):  # sorted (expert, row) pairs of the valid routes
        return torch.sort(flat[valid] * (2**33) + r.reshape(-1)[valid].long()).values

    assert torch.equal(per_expert(rows), per_expert(want_rows)), "not the oracle's row sets"
    got = rows[rows >= 0]
    assert got.unique().numel() == got.numel(), "a row was claimed twice"


def make_logits(t, e, style, seed, dtype=torch.float32):
    """Seeded ``[t, e]`` router logits (CPU) of one adversarial style: normal, ties, nan_inf,
    overflow, zeros, one_hot, saturated."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, e, generator=g)
    if style == "ties":
        x = torch.randint(-2, 3, (t, e), generator=g).float()
    elif style == "nan_inf":
        mask = torch.rand(t, e, generator=g)
        x[mask < 0.05] = float("nan")
        x[(mask >= 0.05) & (mask < 0.1)] = float("inf")
        x[(mask >= 0.1) & (mask < 0.15)] = -float("inf")
        if t:
            x[0] = float("nan")  # a row with nothing but NaN
    elif style == "one_hot":
        x = torch.full((t, e), -5.0)
        x[:, 0] = 5.0
    elif style == "saturated":
        x = x * 30
    elif style == "overflow":
        # Experts 0..7 (mod 32) tie at the top: > 64 candidates above the lane-max bound, so the
        # exact path runs and must resolve the tie by id.
        x[:, (torch.arange(e) % 32) < 8] = 4.0
    elif style == "zeros":
        x = torch.zeros(t, e)
        x[:, ::2] = -0.0
    return x.to(dtype)


def routed_mask(map_out, kind, e):
    """bool [T, E] of a bytemap / bitmap / indices routing output."""
    map_out = map_out.cpu()
    if kind == "bytemap":
        return map_out
    if kind == "bitmap":
        return ref.unpack_bitmap(map_out, e)
    m = torch.zeros(map_out.shape[0], e, dtype=torch.bool)
    return m.scatter_(1, map_out.long(), True)
