"""Transformer blocks through tilefuse.compile vs eager and torch.compile (issue 5's table).

    python3 bench/blocks.py [--cases mlp,layer7b,llama4] [--json bench/results/blocks_h100.json]

Cases (bf16, random normal inputs, PyTorch's default initialisation with the norms' weights
randomised so folding them is exercised):
  mlp      Llama MLP block, 8192 tokens, d=4096, ffn=11008: x + down(silu(gate(n)) * up(n)), n = RMSNorm(x)
  layer7b  a Llama-7B decoder layer in prefill (1 x 8192 tokens, d=4096, 32 heads), attention through SDPA
  llama4   a 4-layer Llama, d=2048, ffn=5632, 16 heads, vocab 32000, batch 2 x seq 4096, ids -> logits
  decode8  one token through an 8-layer Llama, d=4096, ffn=11008, 32 heads, vocab 32000 (--cases decode8;
           no KV cache: a decode step's GEMMs at M = 1 and its small kernels, GPU-bound under graph replay)
  decode8b4  the same for a batch of 4 sequences (--cases decode8b4: every GEMM at M = 4)
  lmhead_ce  LM head (d=4096, vocab 32000) + mean cross-entropy over 8192 tokens (--cases lmhead_ce)
  gpt2     a 4-layer transformers GPT-2, d=1024, 16 heads, vocab 32000, batch 4 x seq 1024, ids -> logits
           (--cases gpt2; needs transformers; no target in the issue: LayerNorm's partials measured here)
  hf_llama a 4-layer transformers LlamaForCausalLM shaped as llama4 (d=2048, ffn=5632, 16 heads,
           vocab 32000, batch 2 x seq 4096, ids -> logits; --cases hf_llama; needs transformers)
  hf_qwen2 the same shape as a transformers Qwen2ForCausalLM (q/k/v biases, 8 KV heads for 16 query
           heads; --cases hf_qwen2; needs transformers)
  hf_mixtral a 2-layer transformers MixtralForCausalLM, d=2048, 16 heads (4 KV), 8 experts of ffn 5632,
           top-2, vocab 32000, batch 2 x seq 4096 (--cases hf_mixtral; needs transformers; the experts'
           grouped matmul is torch._grouped_mm in every column)

Each tilefuse result is checked against a float64 reference under the 2x rule before it is
timed. All three are timed in the same run, in --rounds rounds (default 3) with the order rotated
from round to round, each one's time the median of its rounds (the JSON keeps every round's).
Each timing first runs that implementation back to back for --settle seconds (default 1), so it
is timed at its own steady clock under the GPU's power limit, not at the one its predecessor
left; then (--timing sustained, the default) CUDA events around ~0.5 s of back-to-back forwards
give its ms per forward, as a model runs in continuous use (analyze.bench.sustained_ms); or
(--timing per-call) the median of single forwards with L2 flushed before each
(analyze.bench.median_ms), which moved by +-5% from round to round here. Compile times are
wall time of the first call (torch.compile compiles lazily) or of tilefuse.compile plus its
first call; host us is the Python time of one call with the GPU idle (tilefuse replays a CUDA
graph). Prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

# TILEFUSE_SRC: another tree's src, to time it beside this one (bench/LOG_blocks.md)
sys.path.insert(0, os.environ.get("TILEFUSE_SRC", str(Path(__file__).resolve().parents[1] / "src")))

import tilefuse  # noqa: E402
from tilefuse import models  # noqa: E402
from tilefuse.analyze.bench import fresh_compile, host_us, median_ms, settle, sustained_ms  # noqa: E402
from tilefuse.check import compare, flatten, float64_reference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tuning  # noqa: E402


class MLPBlock(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-5)
        self.gate, self.up = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LMHeadLoss(nn.Module):
    """The LM head and the mean cross-entropy of its logits (a training step's last op)."""

    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x, target):
        return F.cross_entropy(self.head(x), target)


def _randomise_norms(m: nn.Module) -> nn.Module:
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, (nn.RMSNorm, nn.LayerNorm)):
                mod.weight.copy_(1 + 0.1 * torch.randn(mod.weight.shape))
            if isinstance(mod, nn.LayerNorm) and mod.bias is not None:
                mod.bias.copy_(0.1 * torch.randn(mod.bias.shape))
    return m


def build(case: str):
    """(module in bf16 on the GPU, inputs, tokens)"""
    torch.manual_seed(0)
    if case == "mlp":
        m, x = MLPBlock(4096, 11008), torch.randn(1, 8192, 4096)
        inputs, tokens = [x], 8192
    elif case == "layer7b":
        m, x = models.llama_block(4096, 11008, 32, max_seq=8192), torch.randn(1, 8192, 4096)
        inputs, tokens = [x], 8192
    elif case == "llama4":
        m = models.llama(32000, 4, 2048, 5632, 16, max_seq=4096)
        inputs, tokens = [torch.randint(0, 32000, (2, 4096))], 8192
    elif case == "decode8":  # one token through an 8-layer, 4096-wide Llama: every GEMM at M = 1
        m = models.llama(32000, 8, 4096, 11008, 32, max_seq=64)
        inputs, tokens = [torch.randint(0, 32000, (1, 1))], 1
    elif case == "decode8b4":  # the same for 4 sequences at once: every GEMM at M = 4
        m = models.llama(32000, 8, 4096, 11008, 32, max_seq=64)
        inputs, tokens = [torch.randint(0, 32000, (4, 1))], 4
    elif case == "lmhead_ce":
        m = LMHeadLoss(4096, 32000)
        inputs, tokens = [torch.randn(8192, 4096), torch.randint(0, 32000, (8192,))], 8192
    elif case == "gpt2":
        b = models.build("gpt2", 4, hidden=1024, seq=1024, batch=4, vocab=32000, heads=16, ffn=4096)
        m, inputs, tokens = b.model, list(b.inputs), 4096
    elif case == "hf_llama":
        b = models.build("llama", 4, hidden=2048, seq=4096, batch=2, vocab=32000, heads=16, ffn=5632)
        m, inputs, tokens = b.model, list(b.inputs), 8192
    elif case == "hf_qwen2":
        b = models.build("qwen2", 4, hidden=2048, seq=4096, batch=2, vocab=32000, heads=16, kv_heads=8, ffn=5632)
        m, inputs, tokens = b.model, list(b.inputs), 8192
    elif case == "hf_mixtral":  # 8 experts of 5632, top-2: the experts' grouped matmul runs in PyTorch
        b = models.build("mixtral", 2, hidden=2048, seq=4096, batch=2, vocab=32000, heads=16, ffn=5632)
        m, inputs, tokens = b.model, list(b.inputs), 8192
    else:
        raise SystemExit(f"unknown case {case!r}; known: mlp, layer7b, llama4, decode8, decode8b4, lmhead_ce, gpt2, "
                         "hf_llama, hf_qwen2, hf_mixtral")
    m = _randomise_norms(m).to("cuda", torch.bfloat16).eval()
    inputs = [t.cuda().to(torch.bfloat16) if t.is_floating_point() else t.cuda() for t in inputs]
    return m, inputs, tokens


PROFILE = False
ROUNDS = 1  # --rounds
SETTLE = 1.0  # --settle, seconds
TIMING = "sustained"  # --timing
TUNINGS: dict = {}  # --tune: case -> (what the tuner said, its seconds), all tuned before any timing


def tune_all(cases: list) -> None:
    """Every case's kernels tuned, and the tuner closed, before anything is timed: its
    compile-ahead jobs would otherwise share the CPU with the timed calls (bench/mapreduce.py's
    tune_all says what that did there)."""
    tuner = tuning.make_tuner()
    try:
        for case in cases:
            m, inputs, _ = build(case)
            t0 = time.perf_counter()
            with torch.no_grad():
                TUNINGS[case] = (tuning.tune(tuner, m, inputs), time.perf_counter() - t0)
            del m, inputs
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    finally:
        tuning.close(tuner)


def kernel_us(fn, inputs, calls: int = 5) -> dict:
    """GPU us per call of each kernel name (torch.profiler), largest first: where the time goes."""
    from mapreduce import kernel_times

    per_call = {k: v["us"] * v["count"] for k, v in kernel_times(fn, inputs, calls).items()}
    return dict(sorted(per_call.items(), key=lambda kv: -kv[1]))


def first_call_s(fn, inputs) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(*inputs)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_case(case: str) -> dict:
    m, inputs, tokens = build(case)
    row: dict = {"case": case, "tokens": tokens}
    with torch.no_grad():
        if case in TUNINGS:
            row["tuning"], row["tuning_s"] = TUNINGS[case]
        t0 = time.perf_counter()
        prog = tilefuse.compile(m, inputs)
        row["tilefuse_compile_s"] = time.perf_counter() - t0 + first_call_s(prog, inputs)
        steps = prog.plan.steps
        row["plan"] = {f: sum(s.family == f for s in steps) for f in ("gemm", "mapreduce", "extern", "alias")}
        out = flatten(prog(*inputs))
        eager = flatten(m(*inputs))
        ref = flatten(float64_reference(m, inputs))
        checks = [compare(f"out{i}", o, r, e) for i, (o, r, e) in enumerate(zip(out, ref, eager))]
        row["check"] = [{"ok": c.ok, "error": c.error, "bound": c.bound} for c in checks]
        del ref
        torch.cuda.empty_cache()
        if not all(c.ok for c in checks):
            row["error"] = "tilefuse output failed the 2x rule; not timed"
            return row
        tc = fresh_compile(m)
        row["torch_compile_s"] = first_call_s(tc, inputs)
        runs = {"eager": lambda: m(*inputs), "torch_compile": lambda: tc(*inputs), "tilefuse": lambda: prog(*inputs)}
        names = list(runs)
        per: dict = {k: [] for k in names}
        for i in range(ROUNDS):  # each once per round, the order rotated; the median of the rounds
            for k in names[i % len(names):] + names[:i % len(names)]:
                if TIMING == "sustained":
                    per[k].append(sustained_ms(runs[k], seconds=0.5, settle_s=SETTLE))
                else:
                    settle(runs[k], SETTLE)
                    per[k].append(median_ms(runs[k]))
        for k in names:
            row[f"{k}_ms"] = float(statistics.median(per[k]))
            row[f"{k}_rounds_ms"] = per[k]
        row["tilefuse_host_us"] = host_us(lambda: prog(*inputs), reps=20)  # Python time of one call, GPU idle
        row["torch_compile_host_us"] = host_us(lambda: tc(*inputs), reps=20)
        row["graph_replay"] = [i["graphs"] for i in prog.graph_info()]
        if PROFILE:
            row["kernels_us"] = {"tilefuse": kernel_us(prog, inputs), "torch.compile": kernel_us(tc, inputs)}
            for who, ks in row["kernels_us"].items():
                print(f"  {case} {who}: " + ", ".join(f"{k[:60]} {v:.0f}" for k, v in list(ks.items())[:12]), flush=True)
    row["vs_torch_compile"] = row["torch_compile_ms"] / row["tilefuse_ms"]
    row["vs_eager"] = row["eager_ms"] / row["tilefuse_ms"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="mlp,layer7b,llama4")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--profile", action="store_true", help="also record each implementation's GPU time per kernel "
                    "(with TILEFUSE_PDL=0: else a kernel's time includes its wait for the one before)")
    ap.add_argument("--tune", action="store_true", help="tune each block's kernels first (as `tilefuse tune` does; "
                    "picks cached in TILEFUSE_CACHE_DIR), so tilefuse runs with the tuned schedules")
    ap.add_argument("--rounds", type=int, default=3,
                    help="time eager, torch.compile and tilefuse once per round, the order rotated, and report "
                         "each one's median over the rounds (default 3)")
    ap.add_argument("--timing", choices=("sustained", "per-call"), default="sustained",
                    help="sustained (default): ms per forward over ~0.5 s of back-to-back forwards; per-call: the "
                         "median of single forwards, L2 flushed before each (with --settle 0: the method before "
                         "session 23)")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds each implementation runs back to back before each of its timings, so it is "
                         "timed at its own steady (power-limited) clock, not its predecessor's (default 1.0; "
                         "0: none)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.settle < 0:
        ap.error(f"--settle must be 0 or more seconds, not {args.settle}")
    global PROFILE, ROUNDS, SETTLE, TIMING
    PROFILE, ROUNDS, SETTLE, TIMING = args.profile, args.rounds, args.settle, args.timing
    if args.tune:
        tune_all(args.cases.split(","))
    rows = []
    for case in args.cases.split(","):
        try:
            rows.append(run_case(case))
        except Exception as e:  # noqa: BLE001 - record the failure and go on with the next case
            rows.append({"case": case, "error": f"{type(e).__name__}: {e}"})
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
    try:
        import transformers
        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": hf_version,
              "tuned": bool(args.tune), "timing": TIMING, "settle_s": SETTLE, "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    print(f"\n{result['gpu']}, bf16; ratios are speedups of tilefuse (>1: tilefuse faster)")
    print(f"{'case':9} {'eager ms':>9} {'t.c ms':>9} {'tf ms':>9} {'vs t.c':>7} {'vs eager':>8} "
          f"{'tf compile s':>12} {'t.c compile s':>13} {'tf host us':>10}  plan")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:9} ERROR {r['error'][:150]}")
            continue
        print(f"{r['case']:9} {r['eager_ms']:9.3f} {r['torch_compile_ms']:9.3f} {r['tilefuse_ms']:9.3f} "
              f"{r['vs_torch_compile']:7.3f} {r['vs_eager']:8.3f} {r['tilefuse_compile_s']:12.1f} "
              f"{r['torch_compile_s']:13.1f} {r['tilefuse_host_us']:10.1f}  {r['plan']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
