"""A vLLM/SGLang-style MoE forward built on amdqb, and per-batch-bucket CUDA/HIP graphs.

``moe_forward`` = ``biased_topk`` (sigmoid + expert bias, optional groups) -> ``moe_align_block_size``
-> expert SwiGLU over the aligned blocks -> weighted combine back to tokens. Everything runs on the
device with fixed buffer shapes for a given token count, so it can be captured in a graph; nothing
reads device values on the host.

The combine is deterministic: instead of a scatter-add with float atomics, every route finds its
row through an inverse map and the k expert outputs of a token are summed in a fixed order, so a
graph replay equals the eager forward bitwise.

Expert computation uses ``torch._grouped_mm`` when it is available for the device and dtype (bf16
on Hopper-class GPUs), and a per-block batched matmul otherwise (small configurations, the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .ops.layout import moe_align_block_size
from .ops.router import biased_topk


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    topk: int
    hidden: int
    intermediate: int  # expert width (per TP rank)
    block_size: int = 64
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    scaling_factor: Optional[float] = None

    def selection(self) -> dict:
        """Keyword arguments of the router selection shared by the layer and its reference."""
        return dict(
            num_groups=self.num_groups,
            group_topk=self.group_topk,
            scaling_factor=self.scaling_factor,
        )


KIMI_K3_TP8 = MoEConfig(num_experts=896, topk=16, hidden=7168, intermediate=384, block_size=64)
SMALL = MoEConfig(num_experts=16, topk=4, hidden=64, intermediate=32, block_size=16)


def init_weights(cfg: MoEConfig, device, dtype=torch.bfloat16, seed: int = 0):
    """Router, bias and expert weights: ``w13 [E, H, 2I]`` (gate | up) and ``w2 [E, I, H]``.

    Drawn on ``device`` directly in ``dtype`` (the Kimi TP8 experts are 15 GB in bf16: drawing them
    in fp32 on the host would take a minute); the values depend on the device's generator.
    """
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    e, h, i = cfg.num_experts, cfg.hidden, cfg.intermediate

    def draw(*shape, scale, out_dtype=dtype):
        return torch.randn(shape, generator=g, device=device, dtype=out_dtype).mul_(scale)

    return {
        "router": draw(h, e, scale=h**-0.5),
        "expert_bias": draw(e, scale=0.05, out_dtype=torch.float32),
        "w13": draw(e, h, 2 * i, scale=h**-0.5),
        "w2": draw(e, i, h, scale=i**-0.5),
    }


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm") or device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _expert_offsets(expert_ids, num_post_pad, cfg: MoEConfig):
    """int32 end row of each expert's blocks (for grouped GEMM), from device tensors only."""
    blocks = expert_ids.numel()
    used = torch.arange(blocks, device=expert_ids.device) * cfg.block_size < num_post_pad
    owner = torch.where(used, expert_ids.long(), cfg.num_experts)
    # scatter_add, not bincount: bincount sizes its output on the host (a sync, illegal in capture)
    per_expert = torch.zeros(cfg.num_experts + 1, dtype=torch.long, device=expert_ids.device)
    per_expert.scatter_add_(0, owner, torch.ones_like(owner))
    return (torch.cumsum(per_expert[: cfg.num_experts], 0) * cfg.block_size).to(torch.int32)


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def moe_forward(x: torch.Tensor, weights: dict, cfg: MoEConfig, backend: Optional[str] = None):
    """MoE layer forward for tokens ``x [M, H]``; returns ``[M, H]`` in ``x.dtype``."""
    m, h = x.shape
    logits = x @ weights["router"]
    topk_w, topk_ids = biased_topk(
        logits, cfg.topk, weights["expert_bias"], backend=backend, **cfg.selection()
    )
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(
        topk_ids, cfg.block_size, cfg.num_experts, pad_sorted_ids=True, backend=backend
    )
    numel = m * cfg.topk
    # Sentinel entries (== numel) read a zero row appended after the last token.
    token_of_row = torch.clamp(sorted_ids.long(), max=numel) // cfg.topk
    x_padded = torch.cat([x, x.new_zeros(1, h)])
    a = x_padded[token_of_row]  # [rows, H], expert-major blocks
    rows = a.shape[0]
    if grouped_mm_supported(x.device, x.dtype):
        offs = _expert_offsets(expert_ids, num_post_pad, cfg)
        inter = _swiglu(torch._grouped_mm(a, weights["w13"], offs=offs))
        out_rows = torch._grouped_mm(inter, weights["w2"], offs=offs)
    else:
        blocks = rows // cfg.block_size
        a3 = a.view(blocks, cfg.block_size, h)
        eid = expert_ids.long()
        inter = _swiglu(torch.bmm(a3, weights["w13"][eid]))
        out_rows = torch.bmm(inter, weights["w2"][eid]).view(rows, h)
    # Deterministic combine: route -> its row (inverse of sorted_ids), then a fixed-order sum.
    valid = sorted_ids < numel
    inverse = torch.zeros(numel + 1, dtype=torch.long, device=x.device)
    inverse.scatter_(
        0, torch.where(valid, sorted_ids.long(), numel), torch.arange(rows, device=x.device)
    )
    per_route = out_rows[inverse[:numel]].view(m, cfg.topk, h).float()
    return (per_route * topk_w.unsqueeze(-1)).sum(1).to(x.dtype)


def dense_reference(x: torch.Tensor, weights: dict, cfg: MoEConfig) -> torch.Tensor:
    """Every token through its k experts in fp32 (oracle routing), for tests."""
    from . import ref

    logits = (x @ weights["router"]).float()
    w, ids = ref.biased_topk(logits, cfg.topk, weights["expert_bias"], **cfg.selection())
    xf = x.float()
    out = torch.zeros_like(xf)
    for j in range(cfg.topk):
        e = ids[:, j].long()
        inter = _swiglu(torch.bmm(xf.unsqueeze(1), weights["w13"][e].float())).squeeze(1)
        y = torch.bmm(inter.unsqueeze(1), weights["w2"][e].float()).squeeze(1)
        out += w[:, j : j + 1] * y
    return out


class GraphedMoE:
    """CUDA/HIP graphs of :func:`moe_forward` per batch-size bucket (1, 2, 4, ..., max_tokens).

    A call pads its batch to the smallest bucket that holds it (zero rows), copies it into that
    bucket's static input, replays the bucket's graph and returns the first ``M`` output rows.
    Buffers are sized once at capture; a replay allocates nothing and never syncs.
    """

    def __init__(self, weights: dict, cfg: MoEConfig, max_tokens: int = 512, backend=None):
        self.weights, self.cfg, self.backend = weights, cfg, backend
        self.buckets = []
        b = 1
        while b < max_tokens:
            self.buckets.append(b)
            b *= 2
        self.buckets.append(max_tokens)
        self.graphs: dict[int, tuple] = {}

    def capture(self, device, dtype) -> None:
        hidden = self.cfg.hidden
        pool = None
        for b in self.buckets:
            static_x = torch.zeros(b, hidden, device=device, dtype=dtype)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    moe_forward(static_x, self.weights, self.cfg, self.backend)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                static_out = moe_forward(static_x, self.weights, self.cfg, self.backend)
            pool = graph.pool()
            self.graphs[b] = (graph, static_x, static_out)

    def bucket_for(self, m: int) -> int:
        for b in self.buckets:
            if m <= b:
                return b
        raise ValueError(f"batch of {m} tokens exceeds the largest bucket {self.buckets[-1]}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        graph, static_x, static_out = self.graphs[self.bucket_for(m)]
        static_x[:m].copy_(x)
        static_x[m:].zero_()
        graph.replay()
        return static_out[:m]
