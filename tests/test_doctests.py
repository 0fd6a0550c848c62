"""Every docstring example in the package runs, so examples cannot drift from the code."""

import doctest
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import memupdate


def _has_examples(name: str) -> bool:
    return ">>> " in Path(importlib.util.find_spec(name).origin).read_text(encoding="utf-8")


#: The modules with docstring examples, found in their source (a module without any has nothing to test here).
MODULES = sorted(m.name for m in pkgutil.walk_packages(memupdate.__path__, "memupdate.") if _has_examples(m.name))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    # None attempted means doctest did not find the examples the source holds (one outside a docstring, say).
    assert result.attempted > 0, f"{name} has '>>> ' in its source but doctest found no example"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
