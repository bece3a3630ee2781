"""QB inside a real training loop: a small MoE layer trained with QuantileBalancer, captured whole
(forward, backward, optimizer step, balancer step) in one CUDA/HIP graph and replayed with new data;
torch.compile(fullgraph=True) over the router and the balancer update; NCCL pooling on 2 GPUs.

The replays must equal an eager run of the same steps bitwise (routes and biases): the experts are
dense (every expert computes every token, weighted by the routing probabilities), so nothing in the
step depends on float atomics, and the QB histogram is integer.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import amdqb

from conftest import DEVICE, HAS_GPU

E, K, D, H = 16, 4, 32, 64


class TinyMoE(torch.nn.Module):
    def __init__(self, seed: int, device):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.router = torch.nn.Parameter(torch.randn(D, E, generator=g).to(device) * 0.3)
        self.w1 = torch.nn.Parameter(torch.randn(E, D, H, generator=g).to(device) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(E, H, D, generator=g).to(device) * 0.1)
        self.balancer = amdqb.QuantileBalancer(E, K, num_bins=256, device=device)
        self.skew = torch.linspace(-1.5, 1.5, E, device=device)

    def forward(self, x):
        logits = x @ self.router + self.skew
        probs, rmap = self.balancer.route(logits)
        hidden = torch.relu(torch.einsum("td,edh->teh", x, self.w1))
        expert_out = torch.einsum("teh,ehd->ted", hidden, self.w2)
        return (probs.unsqueeze(-1) * expert_out).sum(1), rmap


def make_batches(n, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(tokens, D, generator=g), torch.randn(tokens, D, generator=g)) for _ in range(n)
    ]


def train_step(model, opt, x, y):
    out, rmap = model(x)
    loss = torch.nn.functional.mse_loss(out, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    model.balancer.step()
    return rmap


def eager_run(batches, device):
    model = TinyMoE(0, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    routes, biases, bounds = [], [], []
    for x, y in batches:
        routes.append(train_step(model, opt, x.to(device), y.to(device)).clone())
        biases.append(model.balancer.bias.clone())
        bounds.append(model.balancer.bin_bounds.clone())
    return routes, biases, bounds


@pytest.mark.skipif(not HAS_GPU, reason="CUDA/HIP graph capture needs a GPU")
def test_full_iteration_graph_replays_equal_eager_run():
    device = torch.device("cuda")
    batches = make_batches(10, 128, seed=1)
    want_routes, want_bias, want_bounds = eager_run(batches, device)

    model = TinyMoE(0, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    static_x = torch.empty(128, D, device=device)
    static_y = torch.empty(128, D, device=device)
    warmup = 3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up steps on a side stream, as capture requires
        for i in range(warmup):
            static_x.copy_(batches[i][0])
            static_y.copy_(batches[i][1])
            rmap = train_step(model, opt, static_x, static_y)
            assert torch.equal(rmap, want_routes[i])
    torch.cuda.current_stream().wait_stream(side)
    bal = model.balancer
    ptrs = (bal.bias.data_ptr(), bal.bin_bounds.data_ptr(), bal.histogram.data_ptr())

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_rmap = train_step(model, opt, static_x, static_y)

    seen_bounds = []
    for i in range(warmup, len(batches)):
        static_x.copy_(batches[i][0])
        static_y.copy_(batches[i][1])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_rmap, want_routes[i]), f"routes differ at step {i}"
        assert torch.equal(bal.bias, want_bias[i]), f"bias differs at step {i}"
        assert torch.equal(bal.bin_bounds, want_bounds[i])
        # log_margin: one inverse scale per expert, each finite and positive
        assert torch.isfinite(bal.bin_bounds).all() and (bal.bin_bounds > 0).all()
        seen_bounds.append(tuple(bal.bin_bounds.tolist()))
    assert len(set(seen_bounds)) == len(seen_bounds)  # bounds change on every replay
    assert ptrs == (bal.bias.data_ptr(), bal.bin_bounds.data_ptr(), bal.histogram.data_ptr())


@pytest.mark.skipif(not HAS_GPU, reason="CUDA/HIP graph capture needs a GPU")
@pytest.mark.parametrize("state", ["never_validated", "stale"])
def test_capture_rejects_unvalidated_bounds_and_context_stays_usable(state):
    device = torch.device("cuda")
    logits = torch.randn(64, E, device=device)
    hist = torch.zeros(E, 32, dtype=torch.int32, device=device)
    bias = torch.zeros(E, device=device)
    bounds = torch.tensor([-1.0, 1.0], device=device)
    if state == "stale":
        amdqb.fused_topk_with_score_function(
            logits,
            K,
            expert_bias=bias,
            qb_histogram=hist,
            qb_bin_bounds=bounds,
            qb_histogram_mode="fused_atomic",
        )
        bounds.mul_(2.0)  # an untrusted in-place update: the version moves on
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="validated"):
        with torch.cuda.graph(graph):
            amdqb.fused_topk_with_score_function(
                logits,
                K,
                expert_bias=bias,
                qb_histogram=hist,
                qb_bin_bounds=bounds,
                qb_histogram_mode="two_kernel",
            )
    hist.zero_()
    amdqb.fused_topk_with_score_function(  # eager again: validates and runs
        logits,
        K,
        expert_bias=bias,
        qb_histogram=hist,
        qb_bin_bounds=bounds,
        qb_histogram_mode="two_kernel",
    )
    torch.cuda.synchronize()
    assert hist.sum(1).tolist() == [64] * E


def test_compile_fullgraph_over_router_and_balancer_update():
    torch._dynamo.reset()
    bal = amdqb.QuantileBalancer(E, K, num_bins=64, device=DEVICE)
    logits = torch.randn(96, E, device=DEVICE) + torch.linspace(-1, 1, E, device=DEVICE)

    def route_and_update(x):
        probs, rmap = bal.route(x, accumulate=True)
        bal.step()
        return probs, rmap

    eager = amdqb.QuantileBalancer(E, K, num_bins=64, device=DEVICE)
    want_probs, want_rmap = eager.route(logits, accumulate=True)
    eager.step()
    backend = "inductor" if HAS_GPU else "aot_eager"
    compiled = torch.compile(route_and_update, fullgraph=True, backend=backend)
    probs, rmap = compiled(logits)
    assert torch.equal(rmap, want_rmap)
    torch.testing.assert_close(probs, want_probs)
    assert torch.equal(bal.bias, eager.bias) and torch.equal(bal.bin_bounds, eager.bin_bounds)
    assert int(bal.histogram.sum()) == 0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (binning, selection) of the NCCL pooling test: both binnings, both selections
NCCL_VARIANTS = [("uniform", "te"), ("log_margin", "te"), ("log_margin", "tie_free")]
GRAPH_REPLAYS = 5


def _nccl_balancer(e, binning, selection, device):
    return amdqb.QuantileBalancer(e, K, binning=binning, selection=selection, device=device)


def _nccl_rank(rank, world, port, logits, binning, selection, result_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        device = f"cuda:{rank}"
        shard = logits.chunk(world)[rank].cuda(rank)
        bal = _nccl_balancer(logits.shape[1], binning, selection, device)
        bal.route(shard, accumulate=True)
        pooled = bal.histogram.clone()
        dist.all_reduce(pooled)
        bal.step()
        result = {"pooled": pooled.cpu(), "bias": bal.bias.cpu(), "bounds": bal.bin_bounds.cpu()}
        # route + step (its all-reduce included) captured in one CUDA graph, replayed, against
        # the same sequence run eagerly by a second balancer
        eager = _nccl_balancer(logits.shape[1], binning, selection, device)
        graphed = _nccl_balancer(logits.shape[1], binning, selection, device)
        static = shard.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, then restore the state
            graphed.route(static, accumulate=True)
            graphed.step()
        torch.cuda.current_stream().wait_stream(side)
        graphed.load_state_dict(eager.state_dict())
        graphed.histogram.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed.route(static, accumulate=True)
            graphed.step()
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(GRAPH_REPLAYS):
            step_logits = shard + 0.1 * torch.randn(shard.shape, generator=g).cuda(rank)
            static.copy_(step_logits)
            graph.replay()
            eager.route(step_logits, accumulate=True)
            eager.step()
        torch.cuda.synchronize()
        result.update(
            graph_bias=graphed.bias.cpu(),
            graph_bounds=graphed.bin_bounds.cpu(),
            eager_bias=eager.bias.cpu(),
            eager_bounds=eager.bin_bounds.cpu(),
        )
        torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL test needs 2 GPUs")
@pytest.mark.parametrize("binning,selection", NCCL_VARIANTS)
def test_two_gpu_nccl_pooling_equals_one_process(tmp_path, binning, selection):
    """Over NCCL: the pooled histogram equals one process over the whole batch bitwise, bias and
    bounds are that process's on both ranks, and a captured route + step (collective included)
    replayed 5 times equals the eager sequence on both ranks."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4096, 64, generator=g) + torch.linspace(-1, 1, 64)
    args = (2, _free_port(), logits, binning, selection, str(tmp_path))
    mp.spawn(_nccl_rank, args=args, nprocs=2, join=True)
    single = _nccl_balancer(64, binning, selection, "cuda:0")
    single.route(logits.cuda(0), accumulate=True)
    hist = single.histogram.cpu()
    single.step()
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for res in results:
        assert torch.equal(res["pooled"], hist)
        assert torch.equal(res["bias"], single.bias.cpu())
        assert torch.equal(res["bounds"], single.bin_bounds.cpu())
        assert torch.equal(res["graph_bias"], res["eager_bias"])
        assert torch.equal(res["graph_bounds"], res["eager_bounds"])
    assert torch.equal(results[0]["graph_bias"], results[1]["graph_bias"])
