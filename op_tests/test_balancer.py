"""QuantileBalancer: buffers, accumulation rules, the in-place step, state dicts, and pooling over
ranks with torch.distributed (2 gloo processes)."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import amdqb
from amdqb import ref
from conftest import DEVICE


def test_buffers_initial_state_and_addresses_stable():
    bal = amdqb.QuantileBalancer(16, 4, num_bins=100, device=DEVICE)
    assert bal.bias.tolist() == [0.0] * 16
    assert bal.bin_bounds.tolist() == [-1.0, 1.0]
    assert bal.histogram.shape == (16, 100) and bal.histogram.dtype == torch.int32
    ptrs = (bal.bias.data_ptr(), bal.bin_bounds.data_ptr(), bal.histogram.data_ptr())
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        bal.route(
            torch.randn(64, 16, generator=g).to(DEVICE) + torch.linspace(-1, 1, 16, device=DEVICE)
        )
        bal.step()
    assert ptrs == (bal.bias.data_ptr(), bal.bin_bounds.data_ptr(), bal.histogram.data_ptr())
    assert int(bal.histogram.sum()) == 0
    lo, hi = bal.bin_bounds.tolist()
    assert lo == pytest.approx(float(bal.bias.min()) - 1) and hi == pytest.approx(
        float(bal.bias.max()) + 1
    )
    assert abs(float(bal.bias.double().mean())) < 1e-6


def test_step_equals_oracle_update():
    g = torch.Generator().manual_seed(1)
    bal = amdqb.QuantileBalancer(12, 3, num_bins=200, ema=0.25, device=DEVICE)
    bal.bias.copy_(torch.randn(12, generator=g) * 0.1)
    bal.bias.sub_(bal.bias.mean())
    bal.bin_bounds.copy_(torch.stack([bal.bias.min() - 1, bal.bias.max() + 1]))
    logits = torch.randn(300, 12, generator=g).to(DEVICE)
    old_bias = bal.bias.clone()
    bounds_before = bal.bin_bounds.clone()
    bal.route(logits, backend="torch")
    expected_hist = bal.histogram.clone()
    want_bias, want_bounds = ref.qb_step_update(old_bias, expected_hist, bounds_before, 3, 0.25)
    bal.step()
    torch.testing.assert_close(bal.bias, want_bias, atol=1e-6, rtol=0)
    torch.testing.assert_close(bal.bin_bounds, want_bounds, atol=1e-6, rtol=0)


def test_no_grad_and_eval_do_not_accumulate_unless_asked():
    bal = amdqb.QuantileBalancer(8, 2, num_bins=10, device=DEVICE)
    logits = torch.randn(5, 8, device=DEVICE)
    with torch.no_grad():
        bal.route(logits)
    assert int(bal.histogram.sum()) == 0
    with torch.no_grad():
        bal.route(logits, accumulate=True)
    assert bal.histogram.sum(1).tolist() == [5] * 8
    bal.route(logits)  # grad enabled: training-mode default accumulates
    assert bal.histogram.sum(1).tolist() == [10] * 8


def test_microbatches_of_different_sizes_accumulate_like_one_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(320, 64, generator=g).to(DEVICE)
    one = amdqb.QuantileBalancer(64, 8, device=DEVICE)
    one.route(logits, accumulate=True)
    split = amdqb.QuantileBalancer(64, 8, device=DEVICE)
    split.route(logits[:127], accumulate=True)
    split.route(logits[127:], accumulate=True)
    assert torch.equal(one.histogram, split.histogram)


def test_state_dict_roundtrip_keeps_addresses():
    a = amdqb.QuantileBalancer(8, 2, num_bins=10, ema=0.5, device=DEVICE)
    a.bias.copy_(torch.linspace(-0.1, 0.1, 8))
    a.bin_bounds.copy_(torch.tensor([-1.1, 1.1]))
    b = amdqb.QuantileBalancer(8, 2, num_bins=10, device=DEVICE)
    ptr = b.bias.data_ptr()
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.bias, b.bias) and torch.equal(a.bin_bounds, b.bin_bounds)
    assert b.ema == 0.5 and b.bias.data_ptr() == ptr
    with pytest.raises(ValueError, match="num_bins"):
        amdqb.QuantileBalancer(8, 2, num_bins=11).load_state_dict(a.state_dict())


def test_balancing_reduces_maxvio_on_a_skewed_stream():
    g = torch.Generator().manual_seed(3)
    e, k = 32, 4
    skew = torch.linspace(-2, 2, e)
    bal = amdqb.QuantileBalancer(e, k, device=DEVICE)
    first = last = None
    for step in range(12):
        logits = (torch.randn(2048, e, generator=g) + skew).to(DEVICE)
        _, rmap = bal.route(logits)
        vio = float(amdqb.maxvio(rmap.sum(0)))
        first = vio if step == 0 else first
        last = vio
        bal.step()
    assert first > 1.0 and last < 0.25 * first


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, logits, result_dir):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        bal = amdqb.QuantileBalancer(logits.shape[1], 4, num_bins=500)
        shard = logits.chunk(world)[rank]
        bal.route(shard, accumulate=True)
        pooled = bal.histogram.clone()
        dist.all_reduce(pooled)
        bal.step()
        torch.save(
            {"pooled": pooled, "bias": bal.bias, "bounds": bal.bin_bounds},
            os.path.join(result_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_two_process_gloo_pooled_histogram_equals_single_process(tmp_path):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(400, 24, generator=g) + torch.linspace(-1, 1, 24)
    mp.spawn(_rank_main, args=(2, _free_port(), logits, str(tmp_path)), nprocs=2, join=True)
    single = amdqb.QuantileBalancer(24, 4, num_bins=500)
    single.route(logits, accumulate=True)
    hist = single.histogram.clone()
    single.step()
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for res in results:
        assert torch.equal(res["pooled"], hist)
        assert torch.equal(res["bias"], single.bias)
        assert torch.equal(res["bounds"], single.bin_bounds)
