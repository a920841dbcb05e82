"""The tool sandbox: results, limits and guards of ``rl.environments.tools.sandbox.evaluate`` (real subprocesses)."""

from __future__ import annotations

import pytest

from rl.environments.tools.sandbox import TRUNCATED, ToolResult, evaluate


def test_a_single_expression_prints_its_value_like_a_calculator():
    r = evaluate("12345*6789")
    assert r == ToolResult(ok=True, output="83810205", error=None)
    assert r.text() == "83810205"


def test_statements_then_a_last_expression_print_both_and_none_prints_nothing():
    assert evaluate("print('a')\nx = 7\nx * 6").output == "a\n42"
    assert evaluate("None").output == ""
    assert evaluate("x = 1").text() == "(no output)"


def test_an_exception_gives_its_last_traceback_line_and_keeps_earlier_output():
    r = evaluate("print('before')\n1/0")
    assert not r.ok
    assert r.output == "before"
    assert r.error == "ZeroDivisionError: division by zero"
    assert r.text() == "before\nError: ZeroDivisionError: division by zero"
    assert evaluate("def f(:").error.startswith("SyntaxError: ")
    assert evaluate("raise SystemExit(3)").error == "SystemExit: 3"
    assert evaluate("raise SystemExit(0)").ok


def test_a_busy_loop_is_killed_at_the_wall_time_limit():
    r = evaluate("while True: pass", timeout_s=1.0)
    assert r == ToolResult(ok=False, output="", error="timed out after 1.0 s")


def test_allocating_past_the_memory_limit_raises_memory_error():
    r = evaluate("b = bytearray(1024 ** 3)\nlen(b)", memory_mb=256)
    assert (r.ok, r.error) == (False, "MemoryError")
    assert evaluate("len(bytearray(10 * 1024 ** 2))", memory_mb=256).output == str(10 * 1024**2)


@pytest.mark.parametrize(
    "code",
    [
        "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)",
        "import socket\nsocket.create_connection(('127.0.0.1', 9))",
        "import socket\nsocket.getaddrinfo('localhost', 80)",
    ],
)
def test_network_access_is_refused(code):
    assert evaluate(code).error == "PermissionError: network access is not allowed"


def test_a_library_that_opens_a_socket_fails_too():
    r = evaluate("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9/')")
    assert not r.ok and "network access is not allowed" in r.error


def test_writes_outside_the_scratch_folder_are_refused_and_inside_allowed(tmp_path):
    target = tmp_path / "escape.txt"
    for code in (
        f"open({str(target)!r}, 'w').write('x')",
        f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
        f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
        f"import os\nos.mkdir({str(tmp_path / 'd')!r})",
        "open('../escape.txt', 'w')",
    ):
        r = evaluate(code)
        assert not r.ok, code
        assert r.error.startswith("PermissionError: writing outside the scratch folder is not allowed"), code
    assert list(tmp_path.iterdir()) == []
    inside = evaluate("open('notes.txt', 'w').write('hi')\nimport os\nos.mkdir('d')\nprint(open('notes.txt').read())")
    assert inside == ToolResult(ok=True, output="hi", error=None)
    assert evaluate(f"open({__file__!r}).read(10)").ok  # reads are not restricted


def test_starting_processes_is_refused():
    for code in ("import os\nos.system('true')", "import subprocess\nsubprocess.run(['true'])"):
        assert evaluate(code).error == "PermissionError: starting processes is not allowed"


def test_output_is_truncated_at_max_output_and_marked():
    r = evaluate("print('x' * 5000)", max_output=2000)
    assert r.ok
    assert r.output == "x" * 2000 + TRUNCATED
    flood = evaluate("while True: print('y' * 1000)", timeout_s=1.0, max_output=100)
    assert flood.output == "y" * 100 + TRUNCATED
    assert flood.error == "timed out after 1.0 s"


def test_non_positive_limits_are_refused():
    with pytest.raises(ValueError, match="every limit must be positive"):
        evaluate("1", timeout_s=0)
