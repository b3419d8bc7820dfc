"""Steady GPU time of each of PyTorch's attention backends at the blocks' prefill shapes (bf16,
causal), with q, k, v contiguous [B, H, S, D] and as the strided views of one fused QKV
projection ([B, S, 3, H, D] transposed, as tilefuse's plan hands them to SDPA). Which backend
the default picks decides what tilefuse's extern attention and torch.compile's both cost.

    python3 bench/sdpa_backends.py [--json FILE]
"""
import argparse, json, sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from tilefuse.analyze.bench import median_ms  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--json")
args = ap.parse_args()
dev, dt = "cuda", torch.bfloat16
gpu = torch.cuda.get_device_name()
print(gpu, torch.__version__, "cudnn", torch.backends.cudnn.version(), flush=True)
backends = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def timed(fn):
    """us per call: the project's flushed per-call median (analyze.bench.median_ms)."""
    return median_ms(fn) * 1e3


rows = []
for case, (B, H, S, D) in {"layer7b": (1, 32, 8192, 128), "llama4": (2, 16, 4096, 128)}.items():
    torch.manual_seed(0)
    qkv = torch.randn(B, S, 3, H, D, device=dev, dtype=dt)
    layouts = {"contiguous": [t.contiguous() for t in qkv.permute(2, 0, 3, 1, 4).unbind(0)],
               "qkv views": list(qkv.permute(2, 0, 3, 1, 4).unbind(0))}
    flops = 4 * B * H * S * S * D / 2
    ref = None
    for lay, (q, k, v) in layouts.items():
        for name, be in backends.items():
            def run():
                with sdpa_kernel([be]) if be is not None else torch.no_grad(), torch.no_grad():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            try:
                out = run()
            except RuntimeError as e:
                print(f"{case:8} {lay:11} {name:9} refused: {str(e).splitlines()[0][:80]}")
                continue
            ref = out.float() if ref is None else ref
            err = (out.float() - ref).abs().max().item()
            us = timed(run)
            rows.append({"case": case, "shape": [B, H, S, D], "layout": lay, "backend": name, "us": us,
                         "tflops": flops / us / 1e6, "max_diff_vs_first": err})
            print(f"{case:8} {lay:11} {name:9} {us:9.1f} us {flops / us / 1e6:6.0f} TFLOP/s  diff {err:.2e}", flush=True)
if args.json:
    json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows}, open(args.json, "w"), indent=1)
