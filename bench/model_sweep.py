"""Transformers architectures under torch.compile(backend="tilefuse"), timed beside torch.compile and eager.

    python3 bench/model_sweep.py [--only phi3,gptneox,...] [--rounds 2] [--json FILE]
    python3 bench/model_sweep.py --plan-only [--only ...]   # no GPU: each model's plan at tiny sizes

Issue 5's table times Llama, Qwen2, GPT-2 and Mixtral; a user brings other models. This sweep
runs Llama, Qwen2 and GPT-2 and every architecture of tests/cpu/hf_arch_fixtures.py (Mistral, Phi-3, Gemma 1-3, GPT-NeoX,
OPT, BERT, Qwen3, OLMo, StableLM, Falcon, GPT-J, BLOOM, Cohere, Granite; Mixtral and Qwen2-MoE
with --only) the way a user does: the transformers model built from its config with random
weights (1-D parameters perturbed, as the fixtures do), bf16, `torch.compile(model,
backend="tilefuse")` against `torch.compile(model)` and eager, at one model-like size (2 layers,
d 2048, 128-wide heads where the architecture takes them, MLP 6144, vocab 32000, batch 2 x seq
2048; --hidden/--seq/--batch change it). Causal models return logits and the loss, BERT its last
hidden state and pooler output.

Per model: tilefuse's outputs are checked against a float64 reference under DESIGN.md's 2x
rule (a scalar loss over 16 input draws, `check.check_outputs`; a model that fails is reported, not timed), then the three are timed in --rounds rounds
(order rotated), each as ms per forward over ~0.5 s of back-to-back forwards after a settle
(`analyze.bench.sustained_ms`, as bench/blocks.py). The row also says what the backend ran
(graphs compiled, kernels, externs by op) so a loss can be traced to a plan. Prints a table last.
"""
from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("TILEFUSE_SRC", str(ROOT / "src")))
sys.path.insert(0, str(ROOT / "tests" / "cpu"))

import hf_arch_fixtures as fixtures  # noqa: E402
from hf_arch_fixtures import TINY, Arch, Sizes, Wrap, _llama_like, draw_inputs, perturb  # noqa: E402

# the three issue 5 names (tests/cpu/test_models.py covers them), then the fixtures' architectures
ARCHS = {
    "llama": Arch("causal", "LlamaForCausalLM", "LlamaConfig", lambda s: _llama_like(s), note="GQA 2:1"),
    "qwen2": Arch("causal", "Qwen2ForCausalLM", "Qwen2Config", lambda s: _llama_like(s), note="q/k/v biases, GQA 2:1"),
    "gpt2": Arch("causal", "GPT2LMHeadModel", "GPT2Config",
                 lambda s: dict(n_embd=s.hidden, n_layer=s.layers, n_head=s.heads, n_positions=s.positions),
                 note="LayerNorm, GELU-tanh, learned positions, Conv1D projections"),
    **fixtures.ARCHS,
}
DEFAULT = [n for n, a in ARCHS.items() if not a.experts_in_pytorch]  # MoE: bench/blocks.py hf_mixtral


def sizes_for(name: str, s: Sizes) -> Sizes:
    return fixtures.sizes_for(name, s, ARCHS)


def _model(name: str, s: Sizes, device: str, seed: int = 0):
    torch.manual_seed(seed)
    hf = fixtures.build(name, s, ARCHS)
    gen = torch.Generator().manual_seed(seed + 1)
    perturb(hf, gen)
    names, x, outs = draw_inputs(ARCHS[name].kind, s, hf.config.vocab_size, hf.config.pad_token_id, gen, device)
    model = Wrap(hf, names, outs).to(device=device, dtype=torch.bfloat16).eval()
    return model, x


def _plan(reports) -> dict:
    """What the backend ran: graphs (compiled / eager), kernels by family, externs by op."""

    fam, ext, eager = collections.Counter(), collections.Counter(), []
    for r in reports:
        if r.stages is None:
            eager.append(r.reason)
            continue
        plan = r.stages.plan
        for st in plan.steps:
            if st.family in ("gemm", "mapreduce"):
                fam[st.family] += 1
            elif st.family == "extern" and not st.view:
                n = plan.graph[st.nodes[0]]
                ext[getattr(n, "target", None) or type(n).__name__] += 1
    return {"graphs": len(reports), "eager_graphs": eager, "kernels": dict(fam), "externs": dict(ext)}


def plan_only(names, s: Sizes) -> None:
    from tilefuse.frontend import backend as tb

    tb.register()
    for name in names:
        torch._dynamo.reset()
        tb.reset()
        try:
            model, x = _model(name, sizes_for(name, s), "cpu")
            with torch.no_grad():
                torch.compile(model, backend="tilefuse")(*x)
            p = _plan(tb.reports())
            print(f"{name:10s} graphs {p['graphs']} (eager {len(p['eager_graphs'])})  kernels {p['kernels']}  "
                  f"externs {p['externs']}", flush=True)
        except Exception as e:  # noqa: BLE001 - a model that does not compile is a finding, not a crash
            print(f"{name:10s} FAILS: {type(e).__name__}: {str(e)[:200]}", flush=True)


def run_model(name: str, s: Sizes, rounds: int, settle_s: float, profile: bool = False) -> dict:
    from tilefuse.analyze.bench import fresh_compile, sustained_ms
    from tilefuse.check import VALUES, Results, check_outputs, flatten, float64_reference
    from tilefuse.frontend import backend as tb
    from tilefuse.models import hf

    s = sizes_for(name, s)
    row: dict = {"model": name, "sizes": vars(s) if hasattr(s, "__dict__") else str(s), "note": ARCHS[name].note}
    torch._dynamo.reset()
    tb.register()
    tb.reset()
    model, x = _model(name, s, "cuda")
    with torch.no_grad():
        tf = torch.compile(model, backend="tilefuse")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = flatten(tf(*x))
        torch.cuda.synchronize()
        row["tilefuse_compile_s"] = time.perf_counter() - t0
        row["plan"] = _plan(tb.reports())

        def results(inputs, outs=None):
            return Results(outs or flatten(tf(*inputs)), flatten(float64_reference(copy.deepcopy(model), inputs)),
                           flatten(model(*inputs)))

        def draw(k: int):  # fresh inputs of the same shapes: a scalar loss is judged over several
            gen = torch.Generator().manual_seed(1000 + k)
            return results(draw_inputs(ARCHS[name].kind, s, model.hf.config.vocab_size,
                                       model.hf.config.pad_token_id, gen, "cuda")[1])

        routed = hf.routes(model.hf.config)  # check.py: judged over draws
        checks = check_outputs([f"{name}.{i}" for i in range(len(got))], results(x, got), draw,
                               draws=VALUES if routed else 1)
        row["check"] = [{"ok": c.ok, "error": c.error, "bound": c.bound, "draws": c.draws} for c in checks]
        del got
        torch.cuda.empty_cache()
        if not all(c.ok for c in checks):
            row["error"] = "tilefuse output failed the 2x rule; not timed"
            return row
        tc = fresh_compile(model)
        t0 = time.perf_counter()
        tc(*x)
        torch.cuda.synchronize()
        row["torch_compile_s"] = time.perf_counter() - t0
        runs = {"eager": lambda: model(*x), "torch_compile": lambda: tc(*x), "tilefuse": lambda: tf(*x)}
        keys = list(runs)
        per: dict = {k: [] for k in keys}
        for i in range(rounds):
            for k in keys[i % 3:] + keys[:i % 3]:
                per[k].append(sustained_ms(runs[k], seconds=0.5, settle_s=settle_s))
        if profile:
            sys.path.insert(0, str(ROOT / "bench"))
            from blocks import kernel_us as _kernel_us

            row["kernels_us"] = {"tilefuse": _kernel_us(tf, x), "torch.compile": _kernel_us(tc, x)}
            for who, ks in row["kernels_us"].items():
                print(f"  {name} {who}: {sum(ks.values()):.0f} us in kernels; "
                      + ", ".join(f"{k[:70]} {v:.0f}" for k, v in list(ks.items())[:14]), flush=True)
    for k in keys:
        row[f"{k}_ms"] = float(statistics.median(per[k]))
        row[f"{k}_rounds_ms"] = per[k]
    row["vs_torch_compile"] = row["torch_compile_ms"] / row["tilefuse_ms"]
    row["vs_eager"] = row["eager_ms"] / row["tilefuse_ms"]
    row["calls_eager"] = sum(r.calls_eager for r in tb.reports())
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help=f"comma-separated models (default: {','.join(DEFAULT)}; also "
                    f"{','.join(n for n in ARCHS if n not in DEFAULT)})")
    ap.add_argument("--plan-only", action="store_true", help="no GPU: print each model's plan at tiny sizes")
    ap.add_argument("--rounds", type=int, default=2, help="timing rounds, the order rotated (default 2)")
    ap.add_argument("--settle", type=float, default=0.5, help="seconds back to back before each timing (default 0.5)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="also record each one's GPU time per kernel")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    names = a.only.split(",") if a.only else DEFAULT
    unknown = [n for n in names if n not in ARCHS]
    if unknown:
        ap.error(f"no model named {', '.join(unknown)} (models: {', '.join(ARCHS)})")
    if a.rounds < 1:
        ap.error(f"--rounds must be at least 1, not {a.rounds}")
    if a.plan_only:
        plan_only(names, TINY)
        return 0
    if not torch.cuda.is_available():
        sys.exit("model_sweep: timing needs a GPU (--plan-only runs without one)")
    import transformers

    s = Sizes(hidden=a.hidden, layers=2, seq=a.seq, batch=a.batch, vocab=32000, head_dim=64, window=a.seq // 2)
    rows = []
    for name in names:
        t0 = time.perf_counter()
        try:
            rows.append(run_model(name, s, a.rounds, a.settle, a.profile))
        except Exception as e:  # noqa: BLE001 - record the failure and go on with the next model
            rows.append({"model": name, "error": f"{type(e).__name__}: {str(e)[:400]}"})
        rows[-1]["wall_s"] = time.perf_counter() - t0
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
        result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "transformers": transformers.__version__, "rows": rows}
        if a.json:  # after each model: a long sweep cut short keeps what it measured
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(result, indent=1))
    print(f"\n{result['gpu']}, bf16, transformers {result['transformers']}; speedups of tilefuse (>1: faster)")
    print(f"{'model':10} {'eager ms':>9} {'t.c ms':>9} {'tf ms':>9} {'vs t.c':>7} {'vs eager':>8} "
          f"{'tf compile s':>12} {'t.c compile s':>13}  externs")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:10} ERROR {r['error'][:150]}")
            continue
        ext = {k.replace("aten.", "").replace(".default", ""): v for k, v in r["plan"]["externs"].items()}
        fell = r["plan"]["eager_graphs"]  # (graphs the backend ran in eager: their time is eager's)
        print(f"{r['model']:10} {r['eager_ms']:9.3f} {r['torch_compile_ms']:9.3f} {r['tilefuse_ms']:9.3f} "
              f"{r['vs_torch_compile']:7.3f} {r['vs_eager']:8.3f} {r['tilefuse_compile_s']:12.1f} "
              f"{r['torch_compile_s']:13.1f}  {ext}" + (f"  EAGER {len(fell)} of {r['plan']['graphs']} graphs" if fell else ""))
    for r in rows:
        for why in r.get("plan", {}).get("eager_graphs", []):
            print(f"{r['model']}: a graph ran in eager: {why[:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
