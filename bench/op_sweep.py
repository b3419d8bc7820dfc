"""Common model glue, one `-c` program each, timed as tilefuse, eager and torch.compile run it.

    python3 bench/op_sweep.py [--only NAME,...] [--rounds 3] [--dtype bf16] [--json FILE]
    python3 bench/op_sweep.py --plan-only          # no GPU: each case's plan (kernels, externs)

The issues' tables time a few norms, GEMMs and blocks; a user's program is mostly other glue:
activations, masks, concatenations, head permutes, RoPE, pads, pools, statistics over other
dims. This sweep finds where tilefuse is slower than torch.compile on such ops, so the worst
can be fixed first. Each case is one expression at a model-like size (8192 x 4096 bf16 = 64 MB
unless said). Per case: the program's outputs are checked with DESIGN.md's 2x rule against a
float64 reference first (a case that fails is reported, not timed), then `analyze.bench.compare`
times the three (median of single calls with the L2 flushed, `--rounds` interleaved rounds,
torch.compile compiled fresh for the case). The table says kernels and externs in tilefuse's
plan, each time in us, and torch.compile's time over tilefuse's (> 1: tilefuse is faster).
"""
from __future__ import annotations

import argparse
import json
import sys

CASES = {
    # per-element maps
    "silu": "F.silu(torch.randn(8192, 4096))",
    "gelu": "F.gelu(torch.randn(8192, 4096))",
    "gelu_tanh": "F.gelu(torch.randn(8192, 4096), approximate='tanh')",
    "leaky_where": "(lambda x: torch.where(x > 0, x, 0.1 * x))(torch.randn(8192, 4096))",
    "add": "torch.randn(8192, 4096) + torch.randn(8192, 4096)",
    "bias_add": "torch.randn(8192, 4096) + torch.randn(4096)",
    "mish": "F.mish(torch.randn(8192, 4096))",
    "masked_fill": "torch.randn(8192, 4096).masked_fill(torch.rand(8192, 4096) > 0.5, -1e4)",
    "swiglu_halves": "(lambda x: F.silu(x[:, :4096]) * x[:, 4096:])(torch.randn(8192, 8192))",
    "glu": "F.glu(torch.randn(8192, 8192), -1)",
    # layout
    "transpose2d": "torch.randn(4096, 8192).t().contiguous()",
    "heads_permute": "torch.randn(8, 1024, 32, 128).transpose(1, 2).contiguous()",
    "heads_merge": "torch.randn(8, 32, 1024, 128).transpose(1, 2).reshape(8, 1024, 4096)",
    "cat_last": "torch.cat([torch.randn(8192, 2048), torch.randn(8192, 2048)], -1)",
    "cat_first": "torch.cat([torch.randn(4096, 4096), torch.randn(4096, 4096)], 0)",
    "repeat_kv": "torch.randn(8, 8, 1024, 128)[:, :, None].expand(8, 8, 4, 1024, 128).reshape(8, 32, 1024, 128)",
    "slice_cols": "torch.randn(8192, 8192)[:, 2048:6144].contiguous()",
    "flip": "torch.randn(8192, 4096).flip(-1) * 2",
    "pad": "F.pad(torch.randn(8192, 4000), (0, 96))",
    "pad_slice": "(lambda x: F.pad(x[:, 8:], (0, 8)))(torch.randn(8192, 4096))",
    "rope_rotate_half": "(lambda q, c, s: q * c + torch.cat([-q[..., 64:], q[..., :64]], -1) * s)"
                        "(torch.randn(8, 32, 1024, 128), torch.randn(1, 1, 1024, 128), torch.randn(1, 1, 1024, 128))",
    "upsample_nearest": "F.interpolate(torch.randn(16, 64, 128, 128), scale_factor=2, mode='nearest')",
    # row reductions and norms
    "softmax": "torch.softmax(torch.randn(8192, 4096), -1)",
    "softmax_masked": "torch.softmax(torch.randn(8, 32, 512, 512) + torch.randn(8, 1, 512, 512), -1)",
    "log_softmax": "F.log_softmax(torch.randn(8192, 4096), -1)",
    "rmsnorm": "F.rms_norm(torch.randn(8192, 4096), (4096,), torch.randn(4096))",
    "layernorm": "F.layer_norm(torch.randn(8192, 4096), (4096,), torch.randn(4096), torch.randn(4096))",
    "l2_normalize": "F.normalize(torch.randn(8192, 4096), dim=-1)",
    "var_row": "torch.randn(8192, 4096).var(-1)",
    "argmax_row": "torch.randn(8192, 4096).argmax(-1)",
    "cross_entropy": "F.cross_entropy(torch.randn(8192, 4096), torch.randint(0, 4096, (8192,)))",
    "logsumexp": "torch.logsumexp(torch.randn(8192, 4096), -1)",
    "sum_row": "torch.randn(8192, 4096).sum(-1)",
    # reductions over other dims
    "sum_col": "torch.randn(8192, 4096).sum(0)",
    "mean_tokens": "torch.randn(16, 512, 4096).mean(1)",
    "global_avg_pool": "torch.randn(32, 256, 56, 56).mean((2, 3))",
    "group_norm": "F.group_norm(torch.randn(32, 256, 56, 56), 32, torch.randn(256), torch.randn(256))",
    "batch_norm_eval": "nn.BatchNorm2d(256).eval()(torch.randn(32, 256, 56, 56))",
    # statistics over dims apart (rules/apart_reductions.py): BatchNorm's, a variance's
    "mean_channels": "torch.randn(64, 256, 56, 56).mean((0, 2, 3))",
    "var_channels": "torch.randn(64, 256, 56, 56).var((0, 2, 3))",
    "bn_batch_stats": "F.relu(F.batch_norm(torch.randn(64, 256, 56, 56), None, None, torch.randn(256), "
                      "torch.randn(256), training=True))",
    "var_columns": "torch.randn(8192, 4096).var(0)",
    "zscore_columns": "(lambda x: (x - x.mean(0)) / x.std(0))(torch.randn(8192, 4096))",
    "bn_batch_stats_small": "F.relu(F.batch_norm(torch.randn(32, 64, 56, 56), None, None, torch.randn(64), "
                            "torch.randn(64), training=True))",
    "layernorm_channels_last": "F.layer_norm(torch.randn(32, 96, 56, 56).permute(0, 2, 3, 1), (96,))",
    "amax_mid": "torch.randn(64, 1024, 512).amax(1)",
    # gathers
    "embedding": "F.embedding(torch.randint(0, 32000, (8192,)), torch.randn(32000, 4096))",
    "embedding_scaled": "F.embedding(torch.randint(0, 32000, (8192,)), torch.randn(32000, 4096)) * torch.randn(4096)",
    "index_select_rows": "torch.randn(8192, 4096).index_select(0, torch.randint(0, 8192, (8192,)))",
    # scans
    "cumsum_row": "torch.randn(8192, 4096).cumsum(-1)",
    "cumsum_short": "torch.randn(262144, 128).cumsum(-1)",
    "cumsum_long": "torch.randn(64, 524288).cumsum(-1)",
    "cumsum_seq": "torch.randn(8, 1024, 4096).cumsum(1)",
    "cumsum_vocab_1": "torch.randn(1, 128256).softmax(-1).cumsum(-1)",
    "cumsum_vocab_32": "torch.randn(32, 128256).softmax(-1).cumsum(-1)",
    "cumsum_exp_norm": "(lambda x: x.exp().cumsum(-1) * 0.01)(torch.randn(8192, 4096))",
    "position_ids": "(torch.rand(64, 8192) > 0.1).long().cumsum(-1) - 1",
    "cummax_row": "torch.cummax(torch.randn(8192, 4096), -1)[0]",
    "cumprod_row": "(1 + 0.01 * torch.randn(8192, 4096)).cumprod(-1)",
    "cumprod_long": "(1 + 1e-4 * torch.randn(64, 524288)).cumprod(-1)",
    "cumsum_long_scaled": "torch.randn(64, 524288).cumsum(-1) * 0.5",
    "prod_row": "(1 + 0.01 * torch.randn(8192, 4096)).prod(-1)",
}


def _plan_counts(prog) -> tuple[int, int, list[str]]:
    steps = prog.plan.steps
    kernels = [s for s in steps if s.family in ("mapreduce", "gemm")]
    externs = [s for s in steps if s.family == "extern" and not s.view]
    return len(kernels), len(externs), [s.note or s.nodes[0] for s in externs]


def plan_only(names) -> None:
    """Each case's plan on the CPU (no GPU): whether it compiles, its kernels and externs."""
    import torch

    from tilefuse.compiler import compile_stages
    from tilefuse.frontend.expr import parse

    for name in names:
        try:
            module, inputs, _ = parse(CASES[name], torch.bfloat16)
            st = compile_stages(module, tuple(inputs), expr=CASES[name], arch="sm_90a")
            steps = st.plan.steps
            k = sum(s.family in ("mapreduce", "gemm") for s in steps)
            ext = [s.nodes[0] for s in steps if s.family == "extern" and not s.view]
            print(f"{name:26s} kernels {k}  externs {len(ext)} {ext if ext else ''}")
        except Exception as e:  # a case that does not compile is a finding, not a crash
            print(f"{name:26s} FAILS: {type(e).__name__}: {str(e)[:200]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated case names (default: all)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--json")
    ap.add_argument("--plan-only", action="store_true", help="print each case's plan counts; no GPU")
    a = ap.parse_args()
    names = a.only.split(",") if a.only else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        sys.exit(f"op_sweep: no case named {', '.join(unknown)} (cases: {', '.join(CASES)})")
    if a.plan_only:
        return plan_only(names)

    import torch

    import tilefuse
    from tilefuse.analyze.bench import compare, copy_bandwidth, program_bytes
    from tilefuse.check import compare as check, flatten, float64_reference
    from tilefuse.cli import DTYPES
    from tilefuse.frontend.expr import parse

    if not torch.cuda.is_available():
        sys.exit("op_sweep: needs a CUDA GPU (--plan-only does not)")
    dtype = getattr(torch, DTYPES[a.dtype])
    gpu = torch.cuda.get_device_name()
    copy_bps = copy_bandwidth()
    rows = []
    for name in names:
        expr = CASES[name]
        row = {"case": name, "expr": expr}
        try:
            module, inputs, _ = parse(expr, dtype)
            torch.manual_seed(0)
            module, inputs = module.cuda(), [x.cuda() for x in inputs]
            prog = tilefuse.compile(module, tuple(inputs))
            with torch.no_grad():
                outs, eager = flatten(prog(*inputs)), flatten(module(*inputs))
                refs = flatten(float64_reference(module, inputs))
            bad = [c for c in (check(f"out{i}", o, r, t) for i, (o, r, t) in enumerate(zip(outs, refs, eager)))
                   if not c.ok]
            k, e, ext = _plan_counts(prog)
            row.update(kernels=k, externs=e, extern_ops=ext)
            if bad:
                row["error"] = f"fails the 2x rule: {bad[0]}"
            else:
                nbytes = program_bytes(prog.stages.graph) if hasattr(prog, "stages") else 0
                times = {r.name: r.ms * 1e3 for r in compare(prog, module, inputs, nbytes or 1, copy_bps,
                                                             rounds=a.rounds)}
                row.update(us=times, vs_compile=times["torch.compile"] / times["tilefuse"],
                           vs_eager=times["eager"] / times["tilefuse"])
        except Exception as ex:  # noqa: BLE001 - one case's failure is reported, the sweep goes on
            row["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
        rows.append(row)
        if a.json:  # after every case: a sweep cut short keeps what it measured
            with open(a.json, "w") as f:
                json.dump({"gpu": gpu, "dtype": a.dtype, "rounds": a.rounds, "rows": rows}, f, indent=1)
        if "us" in row:
            t = row["us"]
            print(f"{name:26s} k{row['kernels']} x{row['externs']}  tf {t['tilefuse']:8.1f}  eager {t['eager']:8.1f}"
                  f"  t.c {t['torch.compile']:8.1f}  vs t.c {row['vs_compile']:.2f}x", flush=True)
        else:
            print(f"{name:26s} {row['error']}", flush=True)
    timed = [r for r in rows if "us" in r]
    print(f"\n{gpu}, {a.dtype}; torch.compile time / tilefuse time, worst first:")
    for r in sorted(timed, key=lambda r: r["vs_compile"]):
        print(f"  {r['vs_compile']:5.2f}x  {r['case']}")


if __name__ == "__main__":
    main()
