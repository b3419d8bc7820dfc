"""Would rotate-half RoPE computed in q's order ([B, S, H, D] rows: all heads of a position
read one row of the cos and sin tables) run faster with the tables' loads kept in L1? A
probe, not a feature: the rendered CUDA is edited as text so that each stream whose row base
is `r / k` (a table row shared by k consecutive rows) loads with `ld.global.nc` (L1 allocating)
instead of the streamed rows' `L1::no_allocate`; a second variant loads q (read twice, the
second time rolled) that way too. Same launch, same tensors, 9 rotated rounds (CUDA events, L2
flushed), torch.compile beside them.

    python3 bench/l1_tables_probe.py 1x8192x32 4x2048x32 1x8192x8

Writes $OUT/l1_tables.json (or /tmp/l1_tables.json).
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
    """Transposed back to q's order and made contiguous: one kernel, rows in q's order."""
    t = q.transpose(1, 2)
    return (t * c + torch.cat((-t[..., 64:], t[..., :64]), -1) * s).transpose(1, 2).contiguous()


def l1(src: str, every: bool) -> str:
    shared = set(re.findall(r"const long long b_(\w+) = \(\(r / \d+\)\)", src))
    assert shared, "no stream with a row base r / k"
    for name in re.findall(r"tf_ld16_stream\((\w+)_s\[j\]", src):
        if name in shared or every:
            src = src.replace(f"tf_ld16_stream({name}_s[j]", f"tf_ld16({name}_s[j]")
    return src


def main(cases):
    out = {"gpu": torch.cuda.get_device_name(), "cases": {}}
    for case in cases:
        B, S, H = (int(v) for v in case.split("x"))
        ins = (torch.randn(B, S, H, 128, device="cuda", dtype=torch.bfloat16),
               torch.randn(B, 1, S, 128, device="cuda", dtype=torch.bfloat16),
               torch.randn(B, 1, S, 128, device="cuda", dtype=torch.bfloat16))
        prog = tilefuse.compile(rope, ins)
        want = prog(*ins)
        _, op, ptrs, outs = program_launch(prog, ins)
        ks = {"stream": op.ck, "l1_tables": with_source(op.ck, l1(op.ck.source.source, False)),
              "l1_all": with_source(op.ck, l1(op.ck.source.source, True))}
        for label, k in ks.items():
            outs[-1].fill_(float("nan"))
            k.launch_ptrs(0, ptrs)
            torch.cuda.synchronize()
            assert torch.equal(outs[-1], want), label  # the same values: only cache hints differ
        comp = fresh_compile(rope)
        with torch.no_grad():
            for _ in range(3):
                comp(*ins)
            calls = {k: (lambda k=k: ks[k].launch_ptrs(0, ptrs)) for k in ks}
            calls["torch.compile"] = lambda: comp(*ins)
            per = rotated_rounds(calls)
        med = {k: statistics.median(v) for k, v in per.items()}
        out["cases"][case] = {"us": med, "rounds": per}
        print(f"{case}: " + ", ".join(f"{k} {v:.1f} us" for k, v in med.items()), flush=True)
    Path(os.environ.get("OUT", "/tmp"), "l1_tables.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:] or ["1x8192x32"])
