"""Where a compiled generate's peak GPU memory goes: the tensors alive at the peak, by who made them.

    python3 bench/memory_peak.py [--layers 8 --hidden 4096 --prompt 128 --new 16] [--json out.json]

Builds the random bf16 Llama of bench/generate.py, compiles `forward` with tilefuse, records the
CUDA caching allocator's history (torch.cuda.memory._record_memory_history) over a first
generate (every size compiled) and a second (CUDA graphs captured), then replays the recorded
allocations to find the moment of the peak and groups the blocks alive then by the innermost
frame inside tilefuse (or transformers, or torch) that allocated them. Also the bytes allocated
after each generate: what the compiled model keeps, beside its weights.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
GiB = 2**30


def owner(frames, depth: int = 3) -> str:
    """The innermost `depth` frames of tilefuse (else transformers, else any .py) that led to an
    allocation, innermost first."""
    for part in ("/tilefuse/", "/transformers/", "bench/"):
        mine = [f"{f['filename'].split(part)[-1]}:{f['line']} {f['name']}" for f in frames if part in f["filename"]]
        if mine:
            return " < ".join(mine[:depth])
    return next((f"{f['filename']}:{f['line']} {f['name']}" for f in frames if f["filename"].endswith(".py")), "?")


def at_peak(snapshot) -> tuple[int, Counter, int, Counter]:
    """(peak bytes, bytes by owner alive at the peak, blocks alive then, bytes by owner alive at
    the end) from the allocator's trace."""
    live, total, peak, at = {}, 0, 0, {}
    for trace in snapshot["device_traces"]:
        for e in trace:
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], e.get("frames", []))
                total += e["size"]
                if total > peak:
                    peak, at = total, dict(live)
            elif e["action"] == "free_completed" and e["addr"] in live:
                total -= live.pop(e["addr"])[0]
    by, end = Counter(), Counter()
    for size, frames in at.values():
        by[owner(frames)] += size
    for size, frames in live.values():
        end[owner(frames)] += size
    return peak, by, len(at), end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sys.path.insert(0, os.environ.get("TILEFUSE_SRC", str(HERE.parent / "src")))
    import torch

    from tilefuse.frontend.backend import tilefuse_backend
    from tilefuse.models import hf

    torch.manual_seed(0)
    cfg = hf.config("llama", args.layers, args.hidden, seq=args.prompt + args.new + 8)
    cfg.use_cache = True
    model = hf.causal_lm(cfg).to("cuda", torch.bfloat16).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt), device="cuda")
    gen = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
    model.forward = torch.compile(model.forward, backend=tilefuse_backend)
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    kept = []
    with torch.no_grad():
        for _ in range(2):
            t0 = time.perf_counter()
            model.generate(ids, **gen)
            torch.cuda.synchronize()
            kept.append({"s": time.perf_counter() - t0, "allocated_gib": torch.cuda.memory_allocated() / GiB,
                         "peak_gib": torch.cuda.max_memory_allocated() / GiB})
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, by, blocks, end = at_peak(snap)
    out = {"gpu": torch.cuda.get_device_name(), "args": vars(args), "weights_gib": weights / GiB,
           "before_gib": base / GiB,
           "generates": kept, "trace_peak_gib": peak / GiB, "blocks_at_peak": blocks,
           "at_peak": [{"owner": k, "gib": v / GiB} for k, v in by.most_common()],
           "at_end": [{"owner": k, "gib": v / GiB} for k, v in end.most_common()]}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"{torch.cuda.get_device_name()}: {args.layers} layers, hidden {args.hidden}; weights {weights / GiB:.2f} GiB")
    for i, k in enumerate(kept):
        print(f"generate {i + 1}: {k['s']:.1f} s, allocated after {k['allocated_gib']:.2f} GiB, peak so far {k['peak_gib']:.2f} GiB")
    print(f"allocated before the first generate {base / GiB:.2f} GiB; the peak of what the generates allocated "
          f"{peak / GiB:.2f} GiB over {blocks} blocks; alive then, by owner:")
    for k, v in by.most_common(args.top):
        print(f"  {v / GiB:7.3f} GiB  {k}")
    print(f"alive after the last generate ({sum(end.values()) / GiB:.2f} GiB of what the generates allocated), by owner:")
    for k, v in end.most_common(args.top):
        print(f"  {v / GiB:7.3f} GiB  {k}")


if __name__ == "__main__":
    main()
