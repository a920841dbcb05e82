"""`rl` is the Flyte-free core: none of its modules imports flytekit or the layers that place and run tasks
(``tasks``, ``workflows``, ``images``), at import time or lazily inside a function."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ABOVE = ("flytekit", "tasks", "workflows", "images")
"""Top-level packages rl must not import."""

IMPORT_ALL = f"""
import importlib, json, pkgutil, sys
import rl
failed = {{}}
for m in pkgutil.walk_packages(rl.__path__, "rl."):
    try:
        importlib.import_module(m.name)
    except ImportError as err:  # none expected: an optional back-end's package is imported lazily
        failed[m.name] = repr(err)
print(json.dumps({{"imported": sorted(m for m in sys.modules if m.split(".")[0] in {ABOVE!r}), "failed": failed,
                  "rl": sum(m == "rl" or m.startswith("rl.") for m in sys.modules)}}))
"""


def test_importing_every_rl_module_imports_no_flyte_layer():
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, check=True, cwd=ROOT)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["imported"] == [], result
    assert result["failed"] == {}, result
    assert result["rl"] > 30  # the walk reached the whole package


def test_no_rl_source_imports_a_flyte_layer():
    found = []
    for path in sorted((ROOT / "rl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in ABOVE]
    assert found == [], found
