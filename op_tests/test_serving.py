"""Serving integration: the MoE layer (biased_topk -> align -> experts -> combine) against a dense
fp32 reference, on the oracles and on every kernel backend (on the CPU: Triton's interpreter and
hip's emulator), and per-bucket graph replays equal to the eager forward bitwise."""

import pytest
import torch

from amdqb import serving

from conftest import DEVICE, HAS_GPU, backends


@pytest.mark.parametrize("backend", ["torch", *backends("biased_topk")], indirect=True)
@pytest.mark.parametrize("groups", [None, (4, 2)])
@pytest.mark.parametrize("m", [1, 5, 37])
def test_small_layer_matches_dense_reference(backend, m, groups):
    cfg = serving.SMALL
    if groups:
        cfg = serving.MoEConfig(
            **{**cfg.__dict__, "num_groups": groups[0], "group_topk": groups[1]}
        )
    weights = serving.init_weights(cfg, DEVICE, torch.float32, seed=m)
    x = torch.randn(m, cfg.hidden, device=DEVICE)
    out = serving.moe_forward(x, weights, cfg, backend=backend)
    want = serving.dense_reference(x, weights, cfg)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)


def test_bf16_layer_within_bf16_tolerance():
    cfg = serving.SMALL
    weights = serving.init_weights(cfg, DEVICE, torch.bfloat16)
    x = torch.randn(33, cfg.hidden, device=DEVICE).bfloat16()
    out = serving.moe_forward(x, weights, cfg).float()
    want = serving.dense_reference(x, weights, cfg)
    assert ((out - want).abs().max() / want.abs().max()) < 2e-2


@pytest.mark.skipif(not HAS_GPU, reason="the Kimi-K3 shaped layer runs on a GPU")
def test_kimi_layer_matches_dense_reference_on_gpu():
    cfg = serving.KIMI_K3_TP8
    weights = serving.init_weights(cfg, "cuda", torch.bfloat16)
    x = torch.randn(24, cfg.hidden, device="cuda").bfloat16()
    out = serving.moe_forward(x, weights, cfg).float()
    want = serving.dense_reference(x, weights, cfg)
    assert ((out - want).abs().max() / want.abs().max()) < 2e-2


@pytest.mark.skipif(not HAS_GPU, reason="CUDA/HIP graphs need a GPU")
@pytest.mark.parametrize("config", ["small", "kimi"])
def test_bucket_graph_replays_equal_eager_forward(config):
    cfg = serving.SMALL if config == "small" else serving.KIMI_K3_TP8
    weights = serving.init_weights(cfg, "cuda", torch.bfloat16)
    max_tokens = 64 if config == "small" else 512
    runner = serving.GraphedMoE(weights, cfg, max_tokens=max_tokens)
    runner.capture(torch.device("cuda"), torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    for m in (1, 3, 17, max_tokens):
        x = torch.randn(m, cfg.hidden, generator=g).cuda().bfloat16()
        got = runner(x).clone()
        b = runner.bucket_for(m)
        padded = torch.zeros(b, cfg.hidden, device="cuda", dtype=torch.bfloat16)
        padded[:m] = x
        assert torch.equal(got, serving.moe_forward(padded, weights, cfg)[:m]), (config, m)


def test_bucket_selection():
    runner = serving.GraphedMoE({}, serving.SMALL, max_tokens=512)
    assert runner.buckets == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert runner.bucket_for(3) == 4 and runner.bucket_for(512) == 512
    with pytest.raises(ValueError, match="bucket"):
        runner.bucket_for(513)
