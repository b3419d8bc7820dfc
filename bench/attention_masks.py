"""What a masked attention costs each way tilefuse can run it, against the causal floor, at the
sweep's and larger prefill shapes (bf16, [B, H, S, D] views of one fused QKV projection):

  window   a sliding window of W keys: flash attention's own window (runtime.program's path,
           `Attention.window`) against SDPA with the band as a bool [B, 1, S, S] mask (what the
           mask path and torch.compile run: PyTorch's default backend, and each backend alone);
  alibi    BLOOM's ALiBi plus its causal mask as one [B, H, S, S] bf16 mask (rules/eager_attention:
           the masks summed once a forward), against flash attention's causal with `alibi_slopes`;
  causal   is_causal, the floor either is measured against.

Each variant's output is compared with the masked SDPA's (max abs difference), so a faster path
that computes something else shows (ALiBi's differences include the summed mask's bf16 rounding
of slope · j, up to 4 at j ~ 2000, which BLOOM's own bf16 ALiBi has too; flash's slopes are exact). Decides whether `TILEFUSE_FLASH_WINDOW` should stay on and
whether ALiBi as slopes is worth a rule.

    python3 bench/attention_masks.py [--json FILE]
"""
import argparse, json, sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from tilefuse.analyze.bench import median_ms  # noqa: E402
from tilefuse.runtime import program  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--json")
args = ap.parse_args()
dev, dt = "cuda", torch.bfloat16
gpu = torch.cuda.get_device_name()
print(gpu, torch.__version__, "cudnn", torch.backends.cudnn.version(), flush=True)
BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
# (B, H, S, D, W): the sweep's Mistral / Gemma 3 (d 2048, 2 x 2048 tokens, window 1024), a
# Mistral-7B-shaped prefill (window 4096 at 8192 tokens), a short window at 4096 tokens
SHAPES = {"sweep": (2, 32, 2048, 64, 1024), "mistral7b": (1, 32, 8192, 128, 4096), "short": (2, 16, 4096, 128, 512)}


def sdpa(q, k, v, backend=None, **kw):
    with sdpa_kernel([backend]) if backend is not None else torch.no_grad(), torch.no_grad():
        return F.scaled_dot_product_attention(q, k, v, **kw)


def band_keys(S, W):
    return W * (W + 1) // 2 + (S - W) * W if S > W else S * (S + 1) // 2


rows = []


def record(case, kind, name, fn, ref, flops):
    try:
        out = fn()
    except RuntimeError as e:
        print(f"{case:9} {kind:6} {name:22} refused: {str(e).splitlines()[0][:80]}", flush=True)
        return
    diff = (out.float() - ref.float()).abs().max().item()
    us = median_ms(fn) * 1e3
    rows.append({"case": case, "kind": kind, "variant": name, "us": us, "tflops_useful": flops / us / 1e6,
                 "max_diff_vs_masked": diff})
    print(f"{case:9} {kind:6} {name:22} {us:9.1f} us {flops / us / 1e6:6.0f} TFLOP/s useful  diff {diff:.2e}", flush=True)


for case, (B, H, S, D, W) in SHAPES.items():
    torch.manual_seed(0)
    qkv = torch.randn(B, S, 3, H, D, device=dev, dtype=dt)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    per_key = 4 * B * H * D
    i, j = torch.arange(S, device=dev)[:, None], torch.arange(S, device=dev)
    band = ((j <= i) & (j > i - W))[None, None].expand(B, 1, S, S).contiguous()
    ref = sdpa(q, k, v, attn_mask=band)
    flops = per_key * band_keys(S, W)
    for name, be in BACKENDS.items():
        record(case, "window", f"mask, {name}", lambda be=be: sdpa(q, k, v, be, attn_mask=band), ref, flops)
    record(case, "window", "flash window", lambda: program._flash_window(q, k, v, None, W), ref, flops)
    causal_flops = per_key * band_keys(S, S)
    record(case, "causal", "is_causal, default", lambda: sdpa(q, k, v, is_causal=True), sdpa(q, k, v, is_causal=True),
           causal_flops)
    # BLOOM: slope_h = 2^(-8 (h + 1) / H), bias slope_h * j, plus the causal mask, summed in bf16
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, device=dev) / H)
    lowest = torch.finfo(dt).min
    summed = (slopes[None, :, None, None] * j.float() + torch.where(j <= i, 0.0, lowest)).clamp_min(lowest).to(dt)
    summed = summed.expand(B, H, S, S).contiguous()
    aref = sdpa(q, k, v, attn_mask=summed)
    for name, be in BACKENDS.items():
        record(case, "alibi", f"summed mask, {name}", lambda be=be: sdpa(q, k, v, be, attn_mask=summed), aref,
               causal_flops)

    # BLOOM's own layout: q, k, v views of one [B, S, H, 3, D] projection (head-major)
    qb, kb, vb = torch.randn(B, S, H, 3, D, device=dev, dtype=dt).permute(3, 0, 2, 1, 4).unbind(0)
    bref = sdpa(qb, kb, vb, attn_mask=summed)
    record(case, "alibi", "summed mask, BLOOM qkv", lambda: sdpa(qb, kb, vb, attn_mask=summed), bref, causal_flops)

    def alibi_flash():
        out = torch.ops.aten._flash_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, S, S, 0.0, True, False,
            alibi_slopes=slopes.float().expand(B, H).contiguous())[0]
        return out.transpose(1, 2)

    record(case, "alibi", "flash causal + slopes", alibi_flash, aref, causal_flops)
    del band, summed
    torch.cuda.empty_cache()

print("\ncase      kind    variant                        us   vs masked default (causal: vs the window's)")
base = {(r["case"], r["kind"]): r["us"] for r in rows if r["variant"] in ("mask, default", "summed mask, default")}
for r in rows:
    b = base.get((r["case"], "window" if r["kind"] == "causal" else r["kind"]))
    print(f"{r['case']:9} {r['kind']:6} {r['variant']:22} {r['us']:9.1f}  {b / r['us'] if b else float('nan'):6.3f}x")
if args.json:
    json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows}, open(args.json, "w"), indent=1)
