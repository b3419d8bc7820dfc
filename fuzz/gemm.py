"""GEMM + epilogue fuzz on the GPU: random x @ W (bf16/f16, odd sizes, both weight layouts,
batched) followed by random epilogue chains (bias, row scale, residual, activations, SwiGLU,
RMSNorm, softmax, a row's mean square), judged by the project's own rule (tilefuse.check.compare:
2x eager's error against float64), outputs poisoned first.

usage: python fuzz/gemm.py START COUNT OUTDIR   (FUZZ_SECONDS stops it after that long)"""
import os
import random
import sys
import time
import traceback

import torch, torch.nn.functional as F
import tilefuse
from tilefuse.check import compare, float64_reference, flatten
from tilefuse.frontend.capture import CaptureError

def build(r):
    dt = r.choice(["torch.bfloat16", "torch.float16"])
    M = r.choice([1, 7, 64, 129, 512, 1000, 2048, 4096])
    N = r.choice([8, 64, 136, 256, 1000, 2048, 4104])
    K = r.choice([8, 72, 256, 1000, 2048, 4104])
    batch = r.choice([(), (), (2,), (3, 2)]) if M <= 1024 else ()
    lin = r.random() < 0.6
    args = {"x": (batch + (M, K), dt), "w": ((N, K) if lin else (K, N), dt)}
    lines = ["y = F.linear(x, w)" if lin else "y = x @ w"]
    cur = "y"
    n = r.randint(1, 4)
    for i in range(n):
        v = f"t{i}"
        ops = ["bias", "rowscale", "residual", "gelu", "gelut", "silu", "relu", "sigmoid", "tanh", "scal", "float", "swiglu",
               "rms", "softmax", "rowsum", "addscal", "sq"]
        op = r.choice(ops)
        if op == "bias":
            args[f"b{i}"] = ((N,), dt); e = f"{cur} + b{i}"
        elif op == "rowscale":
            args[f"s{i}"] = (batch + (M, 1), dt); e = f"{cur} * s{i}"
        elif op == "residual":
            args[f"h{i}"] = (batch + (M, N), dt); e = f"{cur} + h{i}"
        elif op == "gelu": e = f"F.gelu({cur})"
        elif op == "gelut": e = f"F.gelu({cur}, approximate='tanh')"
        elif op == "silu": e = f"F.silu({cur})"
        elif op == "relu": e = f"torch.relu({cur})"
        elif op == "sigmoid": e = f"torch.sigmoid({cur})"
        elif op == "tanh": e = f"torch.tanh({cur})"
        elif op == "scal": e = f"{cur} * {r.choice([0.5, 3.0, 0.125, -2.0])}"
        elif op == "addscal": e = f"{cur} + {r.choice([1.0, -0.5, 1e-3])}"
        elif op == "sq": e = f"{cur} * {cur}"
        elif op == "float": e = f"{cur}.float()"
        elif op == "swiglu":
            if N % 2: continue
            e = f"F.silu({cur}[..., ::2]) * {cur}[..., 1::2]" if r.random() < 0.5 else f"(lambda a, b: F.silu(a) * b)(*{cur}.chunk(2, -1))"
            N //= 2
        elif op == "rms": e = f"F.rms_norm({cur}, ({N},))"
        elif op == "softmax": e = f"torch.softmax({cur}, -1)"
        elif op == "rowsum": e = f"{cur}.float().pow(2).mean(-1, keepdim=True)"
        lines.append(f"{v} = {e}")
        cur = v
        if op == "rowsum": break
    ret = cur if r.random() < 0.8 else f"{cur}, y"
    names = list(args)
    src = f"def f({', '.join(names)}):\n" + "".join(f"    {l}\n" for l in lines) + f"    return {ret}\n"
    return src, args

def main():
    start, count, outdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    os.makedirs(outdir, exist_ok=True)
    t_end = time.time() + float(os.environ.get("FUZZ_SECONDS", "1e9"))
    stats = {}
    for seed in range(start, start + count):
        if time.time() > t_end: break
        r = random.Random(seed)
        src, args = build(r)
        ns = {"torch": torch, "F": F}
        exec(src, ns); fn = ns["f"]
        g = torch.Generator(device="cuda").manual_seed(seed)
        def mk(shape, dt, scale=1.0):
            return (torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * scale).to(eval(dt))
        ex = [mk(*args[k]) for k in args]
        fresh = [mk(*args[k]) for k in args]
        st, msg = "ok", ""
        try:
            with torch.no_grad():
                eager = flatten(fn(*fresh))
            prog = tilefuse.compile(fn, tuple(ex))
            prog.poison = True
            out = flatten(prog(*fresh))
            ref = flatten(float64_reference(fn, fresh))
            for i, (o, e, rf) in enumerate(zip(out, eager, ref)):
                if o.dtype != e.dtype:
                    st, msg = "bad", f"out{i} dtype {o.dtype} vs {e.dtype}"; break
                c = compare(f"out{i}", o, rf, e)
                if not c.ok:
                    st, msg = "bad", repr(c); break
        except CaptureError as ex_:
            st, msg = "skip", str(ex_)[:200]
        except Exception as ex_:
            st, msg = "crash", "".join(traceback.format_exception(ex_)[-5:])
        stats[st] = stats.get(st, 0) + 1
        if st in ("bad", "crash"):
            with open(f"{outdir}/{st}_{seed}.txt", "w") as fh:
                fh.write(src + "# args: " + repr(args) + "\n# " + msg.replace("\n", "\n# ") + "\n")
    print(start, stats, flush=True)

main()
