"""Shared pieces of the vLLM and SGLang compat tests: the backends each op runs on, the peers'
tie order, logits and the check of a ``(weights, ids)`` router output."""

import torch

from conftest import DEVICE, kernel_backends

ROUTER_BACKENDS = ["torch"] + [b for b in kernel_backends("biased_topk") if isinstance(b, str)]
ALIGN_BACKENDS = ["torch"] + [b for b in kernel_backends("align_block_size") if isinstance(b, str)]


def top(values, k):
    """Indices of the k largest, ties to the smaller index (the peers' kernels, amdqb's contract)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def logits_for(t, e, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, e, generator=g) * 2).to(dtype).to(DEVICE)


def check_route(got, want, atol=1e-6):
    """fp32 weights within ``atol`` + 1e-5 relative, int32 ids equal in selection order (score
    descending, id ascending)."""
    w, ids = got
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids.cpu(), want[1].cpu())
    torch.testing.assert_close(w.cpu(), want[0].cpu(), atol=atol, rtol=1e-5)
