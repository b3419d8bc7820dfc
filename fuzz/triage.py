"""Judge saved findings again by the project's own rule (tilefuse.check.compare: within 2x
PyTorch's low-precision error against float64, integers equal to the reference's or PyTorch's)
instead of judge.py's stricter element-wise one. A finding this still calls bad is one to look
at; the others are the kinds fuzz/README.md lists. Outputs with no float64 reference (a
program float64 cannot run) keep judge.py's judgement.

usage: python fuzz/triage.py cuda|cpu OUTDIR/bad_*.txt     (prints one line per finding)
"""
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch  # noqa: E402

import judge  # noqa: E402
from tilefuse.check import compare as by_rule  # noqa: E402

strict = judge.compare


def compare(e, t, r, name="", coarse=None):
    """judge.compare's contract (a problem string, or None) with the 2x rule's verdict."""
    if (r is None or not isinstance(t, torch.Tensor) or t.dtype != e.dtype or tuple(t.shape) != tuple(e.shape)
            or tuple(r.shape) != tuple(e.shape)):
        return strict(e, t, r, name, coarse)
    c = by_rule(name, t, r, e)
    return None if c.ok else (f"{name} fails the 2x rule ({t.dtype}): error {c.error:.3g}, PyTorch's "
                              f"{c.torch_error:.3g}, bound {c.bound:.3g}; {c.note}")


judge.compare = compare  # judge._judge looks it up at each call
runpy.run_path(os.path.join(HERE, "rerun.py"), run_name="__main__")
