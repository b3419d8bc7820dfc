"""Would a map kernel that reads a transposed view in place (rotate-half RoPE on
q.transpose(1, 2), q laid out [B, S, H, D]) run faster with its CTAs ordered heads-fastest?
A probe, not a feature: the rendered CUDA is edited as text so that CTA b takes row block
b / H of head b % H (H = rows / S) instead of row block b % (S / 16) of head b / (S / 16):
CTAs in flight then cover all heads of a few positions, so the reads of q (each row 256
bytes, 8 KB apart) fill DRAM pages and the writes stay runs of 4 KB. Same launch, same
tensors, 9 rotated rounds (CUDA events, L2 flushed), torch.compile and eager beside them.

    python3 bench/row_order_probe.py 1x8192x32 1x8192x8 4x2048x32

Writes $OUT/row_order.json (or /tmp/row_order.json).
"""
import json
import os
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from program_schedules import program_launch, rotated_rounds, with_source  # noqa: E402
import tilefuse  # noqa: E402
from tilefuse.analyze.bench import fresh_compile  # noqa: E402


def rope(q, c, s):
    """Written [B, H, S, D] contiguous (the `.contiguous()`: returned as it is, eager's layout
    would be q's, and the kernel would read q in order; rules/permute_sink.py)."""
    t = q.transpose(1, 2)
    return (t * c + torch.cat((-t[..., 64:], t[..., :64]), -1) * s).contiguous()


def heads_fastest(src: str, S: int) -> str:
    """(S: the positions, where the source does not take them as its argument tf_s.)"""
    per = "tf_s" if "const int tf_s" in src else str(S)
    m = re.search(r"const long long r = slot \+ blockIdx\.x \* (\d+);", src)
    assert m, "no one-row-per-slot row index in the source"
    rpc = m.group(1)
    src = src.replace(m.group(0), f"const int tf_no = (tf_rows + {per} - 1) / {per};  // heads (rows / positions)\n"
                      f"  const int tf_ri = (blockIdx.x / tf_no) * {rpc} + slot;  // position\n"
                      f"  const long long r = (long long)(blockIdx.x % tf_no) * {per} + tf_ri;")
    assert "const bool row_ok = (int)r < tf_rows;" in src
    return src.replace("const bool row_ok = (int)r < tf_rows;", f"const bool row_ok = (int)r < tf_rows && tf_ri < {per};")


def main(cases):
    out = {"gpu": torch.cuda.get_device_name(), "cases": {}}
    for case in cases:
        B, S, H = (int(v) for v in case.split("x"))
        q = torch.randn(B, S, H, 128, device="cuda", dtype=torch.bfloat16)
        c = torch.randn(B, 1, S, 128, device="cuda", dtype=torch.bfloat16)
        s = torch.randn(B, 1, S, 128, device="cuda", dtype=torch.bfloat16)
        inputs = (q, c, s)
        prog = tilefuse.compile(rope, inputs)
        want = prog(*inputs)  # (the program rounds once, eager at every op: bits differ from eager's)
        lowered, op, ptrs, outs = program_launch(prog, inputs)
        ck = op.ck
        swz = with_source(ck, heads_fastest(ck.source.source, S))
        for label, k in (("rows", ck), ("heads", swz)):
            outs[-1].fill_(float("nan"))
            k.launch_ptrs(0, ptrs)
            torch.cuda.synchronize()
            err = (outs[-1].float() - want.float()).abs().max().item()
            print(f"{case} {label}: max |diff| vs the program {err:.3g}", flush=True)
            assert err == 0, err  # the same values, rows in another order
        comp = fresh_compile(rope)
        with torch.no_grad():
            for _ in range(3):
                comp(*inputs)
            per = rotated_rounds({"rows": lambda: ck.launch_ptrs(0, ptrs), "heads": lambda: swz.launch_ptrs(0, ptrs),
                                  "torch.compile": lambda: comp(*inputs), "eager": lambda: rope(*inputs)})
        med = {k: statistics.median(v) for k, v in per.items()}
        out["cases"][case] = {"us": med, "rounds": per}
        print(f"{case}: " + ", ".join(f"{k} {v:.1f} us" for k, v in med.items())
              + f"; heads/rows {med['heads'] / med['rows']:.3f}, t.c./heads {med['torch.compile'] / med['heads']:.3f}",
              flush=True)
    Path(os.environ.get("OUT", "/tmp"), "row_order.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:] or ["1x8192x32"])
