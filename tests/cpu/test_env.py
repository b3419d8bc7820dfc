"""tilefuse.env, the one table of environment variables, against the code and the README.

- Every TILEFUSE_* name the package's source mentions is in env.VARS, and every one of those is
  in the README's table: a variable cannot be added, or documented, on one side only.
- Switches read 1/0, on/off, true/false, yes/no in any case and with spaces; unset or empty is
  the default; anything else is a ValueError naming the variable, where it is read (a compile)
  and in `tilefuse env`, whose exit status is then 1.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import tilefuse
from tilefuse import env
from tilefuse.cli import main

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"TILEFUSE_[A-Z0-9_]*[A-Z0-9]")


def test_every_variable_the_source_names_is_in_the_table():
    named = set()
    for path in (ROOT / "src" / "tilefuse").rglob("*.py"):
        named |= set(NAME.findall(path.read_text()))
    assert named == set(env.BY_NAME), (sorted(named - set(env.BY_NAME)), sorted(set(env.BY_NAME) - named))


def test_the_readme_lists_every_variable_in_its_table():
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `TILEFUSE_")]
    listed = [NAME.search(line).group(0) for line in rows]
    assert sorted(listed) == sorted(env.BY_NAME)
    for line in rows:  # the default shown is the one the code uses
        var = env.BY_NAME[NAME.search(line).group(0)]
        if var.default:
            assert f"`{var.default}`" in line, line


@pytest.mark.parametrize("value", ["1", "on", "TRUE", " yes ", "On"])
def test_a_switch_reads_the_spellings_of_on(value):
    assert env.switch("TILEFUSE_GEMM", {"TILEFUSE_GEMM": value})
    assert env.switch("TILEFUSE_GRID_REDUCE", {"TILEFUSE_GRID_REDUCE": value})


@pytest.mark.parametrize("value", ["0", "off", "False", " no", "OFF"])
def test_a_switch_reads_the_spellings_of_off(value):
    assert not env.switch("TILEFUSE_GEMM", {"TILEFUSE_GEMM": value})


def test_unset_or_empty_is_the_default():
    assert env.switch("TILEFUSE_GEMM", {}) and env.switch("TILEFUSE_GEMM", {"TILEFUSE_GEMM": " "})
    assert not env.switch("TILEFUSE_GRID_REDUCE", {}) and not env.switch("TILEFUSE_GRID_REDUCE", {"TILEFUSE_GRID_REDUCE": ""})


@pytest.mark.parametrize("value", ["of", "2", "enabled", "-1"])
def test_any_other_value_is_an_error_naming_the_variable(value):
    with pytest.raises(ValueError, match=f"TILEFUSE_SCANS={value!r}"):
        env.switch("TILEFUSE_SCANS", {"TILEFUSE_SCANS": value})


def test_rows_is_a_whole_number_or_unset():
    assert env.rows("TILEFUSE_COLUMN_MIN_ROWS", {}) is None
    assert env.rows("TILEFUSE_COLUMN_MIN_ROWS", {"TILEFUSE_COLUMN_MIN_ROWS": "64"}) == 64
    assert env.rows("TILEFUSE_COLUMN_MIN_ROWS", {"TILEFUSE_COLUMN_MIN_ROWS": "0"}) == 1
    for bad in ("-3", "1.5", "many"):
        with pytest.raises(ValueError, match="TILEFUSE_COLUMN_MIN_ROWS"):
            env.rows("TILEFUSE_COLUMN_MIN_ROWS", {"TILEFUSE_COLUMN_MIN_ROWS": bad})


def test_a_mistyped_switch_stops_a_compile_instead_of_meaning_on(monkeypatch):
    """Before tilefuse.env, TILEFUSE_SCANS=of left scans on without a word."""
    monkeypatch.setenv("TILEFUSE_SCANS", "of")
    with pytest.raises(ValueError, match="TILEFUSE_SCANS='of'"):
        tilefuse.compile(lambda x: x.cumsum(-1), (torch.randn(4, 8),))


def test_spelled_off_is_off_where_the_planner_reads_it(monkeypatch):
    monkeypatch.setenv("TILEFUSE_SCANS", "off")
    prog = tilefuse.compile(lambda x: x.cumsum(-1), (torch.randn(4, 8),))
    assert [s.family for s in prog.plan.steps] == ["extern"]


def test_env_command_lists_every_variable_with_its_value(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("TILEFUSE_PDL", "off")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for name in env.BY_NAME:
        assert name in out
    assert re.search(r"TILEFUSE_PDL\s*│\s*off \(set\)", out)


def test_env_command_marks_a_bad_value_and_exits_1(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("TILEFUSE_GEMV", "maybe")
    monkeypatch.setenv("TILEFUSE_GRAPH_MEMORY", "lots")
    assert main(["env"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"TILEFUSE_GEMV\s*│\s*maybe \(set\) invalid", out)
    assert re.search(r"TILEFUSE_GRAPH_MEMORY\s*│\s*lots \(set\) invalid", out)
