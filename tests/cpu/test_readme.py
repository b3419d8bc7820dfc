"""The README's quick tour runs as written on a machine without a GPU.

Each `tilefuse ...` line of the tour's code block (with `$E` put in) exits 0 through the CLI's
`main`, and `run` lines (at a fixed seed) print a passing check: what a new user types first
must work. `--bench`
needs a GPU and says so; it must still exit 0 here.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tilefuse.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"


def tour_commands() -> list[str]:
    text = README.read_text()
    block = re.search(r"## A quick tour\s+```bash\n(.*?)```", text, re.S)
    assert block, "the README has a quick tour in a bash block"
    lines = block.group(1).splitlines()
    expr = re.fullmatch(r'E="(.*)"', lines[0])
    assert expr, lines[0]
    out = []
    for line in lines[1:]:
        line = re.split(r"\s#\s", line)[0].strip()
        if line.startswith("tilefuse "):
            out.append(line.replace('"$E"', shlex.quote(expr.group(1))))
    return out


def test_the_tour_has_the_commands_the_issue_promises():
    cmds = " ".join(tour_commands())
    for stage in ("--ir graph", "--ir loop", "--ir cuda", "-vv", "run -c", "--bench", "--model llama", "env"):
        assert stage in cmds, stage


@pytest.mark.parametrize("command", tour_commands())
def test_a_tour_command_runs_on_a_cpu(command, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TILEFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "120")
    argv = shlex.split(command)[1:]
    if argv[0] == "run":  # one seed for CI; `run` draws a fresh one each time otherwise
        argv += ["--seed", "1"]
    if argv[0] == "layout" and "--text" not in argv:
        pytest.skip("draws a picture (matplotlib)")
    rc = main(argv)
    out = capsys.readouterr().out
    assert rc == 0, f"{command}\n{out[-3000:]}"
    assert out.strip(), command
    if argv[0] == "run":
        assert "FAIL" not in out and "pass" in out, out[-2000:]
