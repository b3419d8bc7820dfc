"""The tuner's compile-ahead step (tune/precompile.py).

- A candidate that fails while compiling comes back with a reason that says where: the
  innermost frame (often in a library, such as PyTorch's schema parser, whose message names
  no caller) and the innermost tilefuse frame that led there.
- Compiling a map-reduce candidate there never imports torch."""
from __future__ import annotations

import json
from types import SimpleNamespace

from tilefuse.tune.precompile import prepare


def _build_in_a_library(kernel, knobs, arch):
    return json.loads("{")  # raises inside the json package


def test_the_reason_names_the_raising_frame_and_the_first_line_of_the_message():
    fam = SimpleNamespace(build=_build_in_a_library, compile=None, portable=True)
    status, reason = prepare((fam, None, {}, "sm_90a"))
    assert status == "error"
    assert reason.startswith("JSONDecodeError: Expecting property name")
    assert "(raised at " in reason and "json" in reason.split("(raised at ", 1)[1]


def test_a_tilefuse_caller_is_named_when_the_error_comes_from_below_it():
    def compile_(kernel, schedule, arch):
        raise RuntimeError("expected ident but found ')' here:")  # a frame outside tilefuse

    fam = SimpleNamespace(build=lambda k, kn, a: None, compile=compile_, portable=True)
    status, reason = prepare((fam, None, {}, "sm_90a"))
    assert status == "error"
    where = reason.split("(raised at ", 1)[1]
    assert where.split(", called from ")[0].split(":")[0].endswith("test_precompile.py")
    assert "precompile.py" in where.split(", called from ", 1)[1] and "in prepare" in where


_COMPILE_AHEAD = '''
import sys
from tilefuse.codegen.mapreduce import default_schedule
from tilefuse.loop.ir import Buffer, Kernel, Load, Loop, Store, Var
from tilefuse.tune.families import get_family
from tilefuse.tune.precompile import prepare

k = Kernel("copy", (Buffer("x", (64, 64), "f32", "in"), Buffer("y", (64, 64), "f32", "out")),
           (Loop("r", 64, (Loop("c", 64, (Load("v", "x", (Var("r"), Var("c"))),
                                           Store("y", (Var("r"), Var("c")), "v"))),), parallel=True),))
mr = get_family("mapreduce")
print(prepare((mr, k, mr.knobs(default_schedule(k)), "sm_90a"))[0])
print("torch imported" if "torch" in sys.modules else "torch not imported")
'''


def test_compiling_a_map_reduce_candidate_ahead_never_imports_torch(tmp_path):
    """The compile-ahead processes only render and run NVRTC: importing torch there cost each
    process seconds, and an import of torch failing in such a process (seen on the GPU machine,
    in PyTorch's own custom-op registration at import) failed every candidate it compiled."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TILEFUSE_CACHE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", _COMPILE_AHEAD], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == "ok" and p.stdout.splitlines()[-1] == "torch not imported", p.stdout
