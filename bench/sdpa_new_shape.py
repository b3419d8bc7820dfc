"""What a new shape costs torch's scaled_dot_product_attention on its first call, by backend:
the prefill of a new prompt length (q = k = L tokens, causal) and a decode step (one query
against a cache of L keys; also with 8 key/value heads, with an all-true boolean mask, and 16
queries), Llama-7B-shaped heads (32 x 128, bf16). cuDNN's attention builds an execution plan
per shape; the first call at each shape pays for it. Each backend's error against float32 is
printed too. The queries here are contiguous; `bench/made_size_cost.py` times a decode step as a
model makes it (queries a transposed view of a projection).

    python3 bench/sdpa_new_shape.py [--lengths 1000,1001,2250,3000] [--json out.json]

Each backend in its own process (no plan cache shared); times on the host around a
synchronised call: first call at each length, then the median of 5 more.
"""
import argparse
import json
import os
import subprocess
import sys
import time

BACKENDS = ("default", "CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
KINDS = ("prefill", "decode", "decode_gqa", "decode_mask", "queries16")


def _inputs(kind, L):
    import torch

    lq = {"prefill": L, "queries16": 16}.get(kind, 1)
    hk = 8 if kind == "decode_gqa" else 32
    q = torch.randn(1, 32, lq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, hk, L, 128, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(1, 1, lq, L, device="cuda", dtype=torch.bool) if kind == "decode_mask" else None
    return q, k, torch.randn_like(k), mask, kind == "prefill"


def one(backend: str, lengths: list) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ctx = sdpa_kernel([getattr(SDPBackend, backend)]) if backend != "default" else torch.no_grad()
    out = {"backend": backend, "rows": []}
    torch.manual_seed(0)

    def call(q, k, v, mask, causal):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              enable_gqa=k.shape[1] != q.shape[1])

    with ctx, torch.no_grad():
        warm = torch.randn(1, 32, 64, 128, device="cuda", dtype=torch.bfloat16)
        F.scaled_dot_product_attention(warm, warm, warm, is_causal=True)  # the library's own first-use cost
        torch.cuda.synchronize()
        for L in lengths:
            for kind in KINDS:
                args = _inputs(kind, L)
                ts = []
                try:
                    for _ in range(6):
                        torch.cuda.synchronize()
                        t = time.perf_counter()
                        y = call(*args)
                        torch.cuda.synchronize()
                        ts.append((time.perf_counter() - t) * 1e3)
                except RuntimeError as e:  # this backend cannot take these inputs
                    out["rows"].append({"L": L, "kind": kind, "error": str(e).splitlines()[0][:120]})
                    continue
                q, k, v, mask, causal = args
                with sdpa_kernel([SDPBackend.MATH]):  # (the float32 reference, whatever backend is timed)
                    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                         is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
                rest = sorted(ts[1:])
                out["rows"].append({"L": L, "kind": kind, "first_ms": ts[0], "steady_ms": rest[len(rest) // 2],
                                    "max_err": (y.float() - ref).abs().max().item()})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1000,1001,2250,3000,3001")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    if a.one:
        print(json.dumps(one(a.one, lengths)))
        return
    import torch

    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "backends": []}
    for b in BACKENDS:
        p = subprocess.run([sys.executable, __file__, "--one", b, "--lengths", a.lengths], capture_output=True,
                           text=True, env=os.environ)
        if p.returncode:
            print(f"{b}: failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
            continue
        res["backends"].append(json.loads(p.stdout.strip().splitlines()[-1]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"{res['gpu']}, torch {res['torch']}: ms, first call at a new shape / steady")
    print(f"{'L':>6} {'kind':11} " + " ".join(f"{b['backend'][:9]:>16}" for b in res["backends"]))
    for i, r in enumerate(res["backends"][0]["rows"] if res["backends"] else []):
        cells = [f"{b['rows'][i]['first_ms']:7.2f}/{b['rows'][i]['steady_ms']:<7.3f}" if "first_ms" in b["rows"][i]
                 else "refused" for b in res["backends"]]
        print(f"{r['L']:>6} {r['kind']:11} " + " ".join(f"{c:>16}" for c in cells))
    errs = {b["backend"]: max((x.get("max_err", 0) for x in b["rows"]), default=0) for b in res["backends"]}
    print("largest error against float32: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))


if __name__ == "__main__":
    main()
