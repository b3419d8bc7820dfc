"""Compile-time probe of the graph rules on deep and diamond-shaped programs (CPU, no GPU).

    python3 bench/deep_rules_probe.py [--shape chain|diamond|both] [--alarm 40]

Each small program (a softmax, a matmul, a slice, a row gather, a leading reshape, ...) is
compiled for sm_90a through `compiler._stages` with, above its last op, either a chain of 1200
dependent maps (`x * 0.999 + 0.001`: deeper than Python's recursion limit) or 40 levels of
`tanh(x * x)` (2^40 paths from the result to x), in f32 and bf16, each under an alarm. A rule
that recurses down a chain fails with RecursionError; one that walks every path of a DAG, or
moves a view one map up a pass with no bound, runs past the alarm. Prints one line a program:
ok with the seconds and the plan's kernel families, or what failed and the last frames.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from tilefuse.compiler import _stages

SHAPE = "chain"


def above(x):
    """What each program puts above its last op: the deep chain or the diamond."""
    if SHAPE == "chain":
        for _ in range(1200):
            x = x * 0.999 + 0.001
        return x
    for _ in range(40):
        x = torch.tanh(x * x)
    return x


def _r(*s):
    return torch.randn(*s)


PROGRAMS = {
    "softmax": (lambda x: torch.softmax(above(x), -1), (_r(64, 128),)),
    "mm_after": (lambda x, w: above(x @ w), (_r(64, 128), _r(128, 64))),
    "mm_before": (lambda x, w: above(x) @ w, (_r(64, 128), _r(128, 64))),
    "mm_rms": (lambda x, w: F.rms_norm(above(x @ w), (64,)) @ w.T, (_r(64, 128), _r(128, 64))),
    "cat": (lambda x: torch.cat([above(x), x], -1).sum(-1), (_r(64, 128),)),
    "perm": (lambda x: above(x.transpose(0, 1)).reshape(-1).cumsum(0), (_r(64, 128),)),
    "layernorm": (lambda x: F.layer_norm(above(x), (128,)), (_r(64, 128),)),
    "gather": (lambda x, i: above(x)[i].sum(0), (_r(64, 128), torch.randint(0, 64, (10,)))),
    "var": (lambda x: above(x).var(0), (_r(64, 128),)),
    "slice": (lambda x: above(x)[:, :64] * above(x)[:, 64:], (_r(64, 128),)),
    "roll": (lambda x: torch.roll(above(x), 1, -1).amax(-1), (_r(64, 128),)),
    "ce": (lambda x, t: F.cross_entropy(above(x), t), (_r(64, 128), torch.randint(0, 128, (64,)))),
    "reshape": (lambda x: above(x).reshape(8, 8, 128).sum(-1), (_r(64, 128),)),
    "reshape2": (lambda x: torch.softmax(above(x.reshape(64, 128)).reshape(4, 16, 128), -1), (_r(4, 16, 128),)),
    "stack": (lambda x: torch.stack([above(x), x], -1).sum(-1), (_r(64, 128),)),
    "flip": (lambda x: above(x).flip(-1).amax(-1), (_r(64, 128),)),
    "mask": (lambda x: above(x).masked_fill(x > 0, 0).sum(-1), (_r(64, 128),)),
    "expand": (lambda x, y: (above(x)[:, None, :] * y).sum(-1), (_r(64, 128), _r(64, 4, 128))),
    "mean_dims": (lambda x: above(x).mean((0, 2)), (_r(16, 8, 32),)),
    "swiglu": (lambda x, w: (lambda h: F.silu(above(h[:, :64])) * h[:, 64:])(x @ w), (_r(64, 128), _r(128, 128))),
    "cumsum": (lambda x: above(x).cumsum(-1), (_r(64, 128),)),
    "argmax": (lambda x: above(x).argmax(-1), (_r(64, 128),)),
    "where": (lambda x: torch.where(above(x) > 0.5, x, -x).sum(), (_r(64, 128),)),
}


class _Alarm(Exception):
    pass


def _alarm(*_):
    raise _Alarm


def main() -> int:
    global SHAPE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=("chain", "diamond", "both"), default="both")
    ap.add_argument("--alarm", type=int, default=40, help="seconds a compile may take before it counts as stuck")
    args = ap.parse_args()
    torch.manual_seed(0)
    signal.signal(signal.SIGALRM, _alarm)
    failed = 0
    for SHAPE in (("chain", "diamond") if args.shape == "both" else (args.shape,)):
        for name, (fn, inputs) in PROGRAMS.items():
            for dt in (torch.float32, torch.bfloat16):
                ins = tuple(t.to(dt) if t.is_floating_point() else t for t in inputs)
                signal.alarm(args.alarm)
                t0 = time.perf_counter()
                try:
                    c = _stages(fn, ins, None, "sm_90a")
                    print(f"{SHAPE:8} {name:10} {str(dt)[6:]:9} ok {time.perf_counter() - t0:5.1f} s "
                          f"{[s.family for s in c.plan.steps]}", flush=True)
                except Exception as e:  # (_Alarm and RecursionError among them)
                    failed += 1
                    frames = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}:{f.name}"
                              for f in traceback.extract_tb(sys.exc_info()[2])[-3:]]
                    print(f"{SHAPE:8} {name:10} {str(dt)[6:]:9} {type(e).__name__} {frames}", flush=True)
                finally:
                    signal.alarm(0)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
