"""The ``Example:`` blocks of the modules a newcomer meets first run as written (doctest): the advantage estimators,
the loss and its mask, the micro-batch planner and the data plane's codec."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["rl.advantages", "rl.loss", "rl.backends.micro_batch", "dataplane.codec"]
"""Modules whose docstring examples are run; each must hold at least one."""


@pytest.mark.parametrize("module", MODULES)
def test_examples_run_as_written(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, result
    assert result.attempted > 0, f"{module} has no example"
