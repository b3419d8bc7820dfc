"""A candidate that fails while compiling comes back with a reason that says where: the
innermost frame (often in a library, such as PyTorch's schema parser, whose message names no
caller) and the innermost tilefuse frame that led there."""
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
    assert where.split(", called from ")[0].split(":")[0].endswith("test_precompile_reasons.py")
    assert "precompile.py" in where.split(", called from ", 1)[1] and "in prepare" in where
