"""The fuzz generator's size check on meta tensors (fuzz/programs.py `too_big`): a candidate line
that would make a value past the caps is refused before it runs on real tensors, so one that
broadcasts two large values cannot take the machine's memory (session 79's fuzz process reached
100 GB that way); a line meta tensors cannot run is left to the real run."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "fuzz"))
import programs


@pytest.fixture
def env():
    return {"a": torch.randn(50_000), "b": torch.randn(3, 4)}


def test_a_broadcast_past_the_temporary_cap_is_refused_without_allocating(env, monkeypatch):
    monkeypatch.setattr(programs, "MAXN", 2_000_000)
    # 50,000 x 50,000 floats (10 GB) summed to one value: the result is small, the temporary not
    assert programs.too_big("(a[:, None] * a[None, :]).sum()", env)


def test_a_result_past_maxn_is_refused(env, monkeypatch):
    monkeypatch.setattr(programs, "MAXN", 20_000)
    assert programs.too_big("a * 2", env)          # 50,000 elements
    assert not programs.too_big("b * 2", env)      # 12 elements


def test_a_tuple_result_is_left_to_the_real_size_check(env, monkeypatch):
    """run.py picks one element of a tuple with the generator's random stream before its size
    check; refusing the tuple here would change every later draw of that seed."""
    monkeypatch.setattr(programs, "MAXN", 20_000)
    assert not programs.too_big("torch.split(a, 25_000)", env)


def test_a_line_meta_tensors_cannot_run_is_left_to_the_real_run(env):
    assert not programs.too_big("a.nonzero()", env)          # a data-dependent size
    assert not programs.too_big("a[int(b.sum().item()) % 3]", env)


def test_the_generator_keeps_drawing_the_same_programs():
    """Seeds drawn before the meta check must give the programs they gave then; a fixed seed's
    source is pinned here (a change to the generator that moves it changes every saved finding)."""
    programs.BIG, programs.MAXN = False, 20000
    g = programs.Gen(10500105)
    src = g.build()
    assert src is not None and src.startswith("def f(a):\n    v0 = torch.tanh(a)\n")
