"""The examples in docs/layout.md and in the package docstring run as written."""
import doctest
from pathlib import Path

import tilefuse.layout

DOC = Path(__file__).resolve().parents[2] / "docs" / "layout.md"


def test_user_doc_examples_run():
    result = doctest.testfile(str(DOC), module_relative=False)
    assert result.attempted > 5 and result.failed == 0


def test_package_docstring_examples_run():
    result = doctest.testmod(tilefuse.layout)
    assert result.attempted > 0 and result.failed == 0
