"""bench/blocks.py's per-call timing with and without settling each implementation first.

    python3 bench/settle_ab.py llama4,mlp,layer7b      (JSON to $OUT/settle_ab_s23.json)

Each case is compiled and timed twice (--timing per-call as blocks.py runs it, 3 rounds),
with --settle 0 (the method before session 23) and 1 s: whether the order of implementations
biased the ratio (bench/LOG_blocks.md, session 23).
"""
import json, os, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import blocks
blocks.ROUNDS = 3
blocks.TIMING = "per-call"
rows = []
for case in sys.argv[1].split(","):
    for settle in (0.0, 1.0):
        blocks.SETTLE = settle
        r = blocks.run_case(case)
        r["settle"] = settle
        rows.append(r)
        print(case, settle, {k: r.get(k) for k in ("eager_rounds_ms", "torch_compile_rounds_ms", "tilefuse_rounds_ms", "vs_torch_compile")}, flush=True)
        torch._dynamo.reset()
        torch.cuda.empty_cache()
json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, open(os.environ.get("OUT", "/tmp") + "/settle_ab_s23.json", "w"), indent=1)
for r in rows:
    if "error" in r:
        print(f"{r['case']:8} settle {r['settle']:.0f}  {r['error']}")
        continue
    print(f"{r['case']:8} settle {r['settle']:.0f}  eager {r['eager_ms']:.3f}  t.c {r['torch_compile_ms']:.3f}  tf {r['tilefuse_ms']:.3f}  vs t.c {r['vs_torch_compile']:.3f}")
