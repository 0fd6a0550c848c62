"""Every docstring example in the package runs, so examples cannot drift from the code."""

import doctest
import importlib
import pkgutil

import pytest

import memupdate

MODULES = sorted(m.name for m in pkgutil.walk_packages(memupdate.__path__, "memupdate."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
