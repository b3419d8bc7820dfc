"""RoPE's angle tables read packed (gemm_sm90.packed_tables) against read in place, in the Q
projection of the 4-layer Llama (8192 x 2048 x 2048, row scale + RoPE from [4096, 64] bf16
tables), with its V projection (row scale only) as the floor.

    python3 bench/rope_tables_ab.py [--json bench/results/s21/rope_tables_ab.json]

Both Q kernels are rendered by this tree, the second with packed_tables switched off; they
must agree within one bf16 unit (their FMA contractions may differ) before they are timed.
CUDA events around single launches, L2 flushed by a read before each, 7 interleaved rounds of
15, medians.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tilefuse import dtypes, models  # noqa: E402
from tilefuse.analyze.bench import _read_flush  # noqa: E402
from tilefuse.codegen import epilogue as epi, gemm_sm90 as g  # noqa: E402
from tilefuse.compiler import compile_stages  # noqa: E402
from tilefuse.runtime.gemm import compile_gemm  # noqa: E402


def llama_problems():
    """The Q (RoPE) and V (row scale) projections' problems of the 4-layer Llama's first layer."""
    torch.manual_seed(0)
    m = models.llama(32000, 1, 2048, 5632, 16, max_seq=4096).to(torch.bfloat16).eval()
    st = compile_stages(m, [torch.randint(0, 32000, (2, 4096))])
    probs = [lg.problem() for lg in st.gemms.values()]
    q = next(p for p in probs if epi.is_pairwise(p.out_epilogue) and p.n == 2048)
    v = next(p for p in probs if not epi.is_pairwise(p.out_epilogue) and p.n == 2048 and p.k == 2048
             and len(epi.operands(p.out_epilogue)) == 1 and epi.operands(p.out_epilogue)[0].shape == (p.m,))
    return q, v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    pq, pv = llama_problems()
    packed = compile_gemm(pq, g.default_schedule(pq))
    if not packed.source.packed_tables:
        raise SystemExit("the Q kernel does not read its tables packed")
    real = g.packed_tables
    g.packed_tables = lambda *a: ()
    try:
        inplace = compile_gemm(pq, g.default_schedule(pq))
    finally:
        g.packed_tables = real
    plain = compile_gemm(pv, g.default_schedule(pv))
    x = torch.randn(pq.m, pq.k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(pq.n, pq.k, device="cuda", dtype=torch.bfloat16) / pq.k ** 0.5
    ops = {b.name: (torch.rand(b.shape, device="cuda") * 2 - 1).to(dtypes.to_torch(b.dtype))
           for b in epi.operands(pq.out_epilogue)}
    tables = {n: g.pack_table(ops[n], wd) for n, wd in packed.source.packed_tables}
    opsv = {b.name: torch.rand(b.shape, device="cuda") for b in epi.operands(pv.out_epilogue)}
    cases = {"q_tables_packed": (packed, {**ops, **tables, "prepacked": set(tables)}),
             "q_tables_in_place": (inplace, ops), "v_row_scale": (plain, opsv)}
    outs = {n: k(x, w, **o) for n, (k, o) in cases.items()}
    torch.cuda.synchronize()
    a, b = outs["q_tables_packed"].float(), outs["q_tables_in_place"].float()
    # one bf16 unit of the result, or of the products a rotation subtracts (where they cancel)
    bad = (a - b).abs() > 2 ** -7 * torch.maximum(a.abs(), b.abs()) + 2 ** -16 * float(a.abs().max())
    if bad.any():
        raise SystemExit(f"packed and in-place kernels disagree at {int(bad.sum())} outputs")
    differ = int((a != b).sum())
    flush = _read_flush()
    t = {n: [] for n in cases}
    for _ in range(7):
        for n, (k, o) in cases.items():
            for _ in range(15):
                flush()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                k(x, w, **o, out=outs[n])
                e.record()
                torch.cuda.synchronize()
                t[n].append(s.elapsed_time(e) * 1e3)
    us = {n: statistics.median(v) for n, v in t.items()}
    result = {"gpu": torch.cuda.get_device_name(), "shape": [pq.m, pq.n, pq.k], "schedule": str(packed.schedule),
              "us": us, "elements_differing_by_one_unit": differ, "elements": a.numel()}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    print(f"{result['gpu']}, Q projection {pq.m}x{pq.n}x{pq.k} with RoPE; {differ} of {a.numel()} outputs "
          "differ (by at most one bf16 unit) between the two Q kernels")
    for n, v in us.items():
        print(f"  {n:18s} {v:7.1f} us  {v / us['v_row_scale']:.3f}x the V projection")
    return 0


if __name__ == "__main__":
    sys.exit(main())
