"""The ``Example:`` blocks of the modules a newcomer meets first run as written (doctest)."""

from __future__ import annotations

import doctest

import pytest


@pytest.mark.parametrize("module", ["rl.advantages", "rl.loss"])
def test_examples_run_as_written(module):
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result
