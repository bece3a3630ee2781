"""A vLLM/SGLang-style MoE layer on amdqb, eager and graph-captured per batch bucket.

    python examples/serving_moe.py                 # small config (CPU or GPU)
    python examples/serving_moe.py --config kimi   # E=896, k=16, hidden 7168, width 384 (GPU)

Checks the layer against a dense fp32 reference (every token through its k experts), then on a
GPU captures one graph per bucket (1, 2, 4, ..., 512 tokens), replays them with new inputs and
padded batches, and checks each replay equals the eager forward of the same padded batch bitwise.
"""

from __future__ import annotations

import argparse
import time

import torch

from amdqb import serving


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", choices=["small", "kimi"], default="small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-tokens", type=int, default=512)
    args = parser.parse_args()
    device = torch.device(args.device)
    cfg = serving.KIMI_K3_TP8 if args.config == "kimi" else serving.SMALL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weights = serving.init_weights(cfg, device, dtype)
    g = torch.Generator().manual_seed(0)

    x = torch.randn(48, cfg.hidden, generator=g).to(device, dtype)
    out = serving.moe_forward(x, weights, cfg)
    want = serving.dense_reference(x, weights, cfg)
    err = ((out.float() - want).abs().max() / want.abs().max()).item()
    print(f"eager layer vs dense fp32 reference: max rel error {err:.2e} ({dtype})")

    if device.type != "cuda":
        print("graph capture skipped: no GPU")
        return 0
    runner = serving.GraphedMoE(weights, cfg, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    runner.capture(device, dtype)
    print(f"captured {len(runner.buckets)} buckets in {time.perf_counter() - t0:.1f} s")
    for m in (1, 3, 17, 100, args.max_tokens):
        xm = torch.randn(m, cfg.hidden, generator=g).to(device, dtype)
        got = runner(xm).clone()
        b = runner.bucket_for(m)
        padded = torch.zeros(b, cfg.hidden, device=device, dtype=dtype)
        padded[:m] = xm
        eager = serving.moe_forward(padded, weights, cfg)[:m]
        print(f"M={m:4d} bucket={b:4d} graph == eager(padded): {torch.equal(got, eager)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
