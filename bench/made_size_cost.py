"""What a decode step at a new cache length costs when its program is made with no compile
(runtime.resize.Family.at): the made program's first call (the thin path, uncaptured), timed
with the GPU synchronised, at 24 new lengths. Llama-7B-shaped step (d 4096, 32 heads of 128,
bf16): RMSNorm, QKV projection, append to the cache, attention, output projection + residual.

    python3 bench/made_size_cost.py [--start 1000] [--count 24]    # TILEFUSE_SRC=<tree>/src to compare

Prints the median first and second call's ms. Written to see whether cuDNN's plan per new shape
(bench/sdpa_new_shape.py: 33-400 ms with contiguous queries) reaches a model's decode step; on an
H200 (session 41) it did not: ~1 ms first calls, FlashAttention forced or not.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.environ.get("TILEFUSE_SRC", str(Path(__file__).resolve().parents[1] / "src")))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import tilefuse  # noqa: E402
from tilefuse.runtime import resize  # noqa: E402

D, HEADS, HD = 4096, 32, 128


class Decode(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.qkv, self.out = nn.RMSNorm(D), nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)

    def forward(self, x, k_cache, v_cache):
        q, k, v = self.qkv(self.norm(x)).view(1, 1, 3, HEADS, HD).permute(2, 0, 3, 1, 4)
        k, v = torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2)
        a = F.scaled_dot_product_attention(q, k, v)
        return x + self.out(a.transpose(1, 2).reshape(1, 1, D)), k, v


def _inputs(length):
    return tuple(torch.randn(*s, device="cuda", dtype=torch.bfloat16)
                 for s in ((1, 1, D), (1, HEADS, length, HD), (1, HEADS, length, HD)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", type=int, default=1000)
    ap.add_argument("--count", type=int, default=24)
    a = ap.parse_args()
    torch.manual_seed(0)
    m = Decode().to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        fam = resize.family(tilefuse.compile(m, _inputs(16)), tilefuse.compile(m, _inputs(17)))
        assert isinstance(fam, resize.Family), fam
        first, again = [], []
        for length in range(a.start, a.start + a.count):
            xs = _inputs(length)
            made = fam.at([tuple(x.shape) for x in xs])
            made.graphs = False  # the thin path each call: what a size's first call runs
            for times in (first, again):
                torch.cuda.synchronize()
                t = time.perf_counter()
                made(*xs)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t) * 1e3)
    print(f"{torch.cuda.get_device_name()} {os.environ.get('TILEFUSE_SRC', 'this tree')}: made step at "
          f"{a.count} new lengths from {a.start}: first call median {statistics.median(first):.2f} ms "
          f"(max {max(first):.1f}), second {statistics.median(again):.2f} ms")


if __name__ == "__main__":
    main()
