"""Run a tool call's Python code in a fresh, limited subprocess: the ``python`` tool of ``ToolEnvironment``.

Each call starts ``python -I`` (isolated mode: no user site, no ``PYTHON*`` variables) in its own process group with
a fresh scratch folder as its working directory, ``HOME`` and ``TMPDIR``, reads the code from stdin and runs it. In
the child, before the code runs:

* ``RLIMIT_AS`` caps its address space (``memory_mb``; an allocation past it raises ``MemoryError``), ``RLIMIT_CPU``
  backs up the wall-time limit and ``RLIMIT_FSIZE`` caps the size of any file it writes (kernel-enforced, Linux);
* ``socket.socket``, ``socket.create_connection``, ``socket.getaddrinfo`` and ``socket.socketpair`` raise
  ``PermissionError: network access is not allowed``;
* ``open`` / ``io.open`` in a writing mode and the ``os`` functions that create, change or remove files
  (``os.open`` with write flags, ``remove``, ``unlink``, ``rename``, ``replace``, ``mkdir``, ``makedirs``, ``rmdir``,
  ``truncate``, ``chmod``, ``symlink``, ``link``, ``utime``) raise ``PermissionError`` for a path outside the scratch
  folder;
* ``os.system``, ``os.popen``, ``os.fork``, the ``os.exec*`` / ``os.spawn*`` / ``posix_spawn`` family and
  ``subprocess``'s process creation raise ``PermissionError: starting processes is not allowed``.

The parent enforces the wall time (the whole process group is killed with SIGKILL after ``timeout_s``) and reads at
most ``max_output`` characters of stdout (stderr is merged into it), discarding the rest as it arrives.

This is a guard against a model's accidental or naive misuse, NOT a security sandbox: the network, file and process
guards are Python-level patches, and code can get around them (``_socket``, ``_io.open``, ``ctypes``, ``posix``,
reloading a module, reading the originals out of closures). Reads are not restricted at all (any file the user can
read, including the parent's environment through ``/proc``). There is no namespace, seccomp filter, chroot or
cgroup; only the rlimits and the process-group kill are enforced by the kernel. Run untrusted models' tools inside
a container with no network and a read-only root for real isolation. The layout follows NeMo-RL's code environment
(``nemo_rl/environments/code_environment.py``: a scratch dir per sample, stdout returned as the observation).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

TRUNCATED = "...[truncated]"
"""Appended to output cut at ``max_output`` characters."""

_ERROR_MARK = "\x00TOOL-ERROR:"

_RUNNER = r"""
import ast, builtins, io, json, os, resource, socket, sys

cfg = json.loads(sys.argv[1])
code = sys.stdin.read()
mark = cfg["mark"]


def report(text):
    os.write(2, (mark + text.replace("\n", " ") + "\n").encode("utf-8", "replace"))


def describe(e):
    msg = str(e)
    return type(e).__name__ + (": " + msg if msg else "")


limit = cfg["memory_mb"] * 1024 * 1024
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
cpu = int(cfg["timeout_s"]) + 2
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
fsize = cfg["max_file_mb"] * 1024 * 1024
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

NET = "network access is not allowed"
PROC = "starting processes is not allowed"


class _NoSocket(socket.socket):
    def __init__(self, *args, **kwargs):
        raise PermissionError(NET)


def _no_net(*args, **kwargs):
    raise PermissionError(NET)


socket.socket = _NoSocket
socket.SocketType = _NoSocket
socket.create_connection = _no_net
socket.getaddrinfo = _no_net
socket.socketpair = _no_net
socket.fromfd = _no_net


def _no_proc(*args, **kwargs):
    raise PermissionError(PROC)


for name in ("system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve", "execl",
             "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv",
             "spawnve", "spawnvp", "spawnvpe"):
    if hasattr(os, name):
        setattr(os, name, _no_proc)
import _posixsubprocess
_posixsubprocess.fork_exec = _no_proc
import subprocess
if hasattr(subprocess, "_fork_exec"):
    subprocess._fork_exec = _no_proc

scratch = os.path.realpath(cfg["scratch"])


def _inside(path):
    if isinstance(path, int):
        return True
    real = os.path.realpath(os.fsdecode(os.fspath(path)))
    return real == scratch or real.startswith(scratch + os.sep)


def _check(path, dir_fd=None):
    if dir_fd is not None or not _inside(path):
        raise PermissionError("writing outside the scratch folder is not allowed: " + repr(os.fspath(path)
                              if not isinstance(path, int) else path))


_open = builtins.open


def _guarded_open(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax+"):
        _check(file)
    return _open(file, mode, *args, **kwargs)


builtins.open = _guarded_open
io.open = _guarded_open

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_os_open = os.open


def _guarded_os_open(path, flags, mode=0o777, *, dir_fd=None):
    if flags & _WRITE_FLAGS:
        _check(path, dir_fd)
    return _os_open(path, flags, mode, dir_fd=dir_fd)


os.open = _guarded_os_open


def _guard(fn, npaths):
    def wrapper(*args, **kwargs):
        for p in args[:npaths]:
            _check(p, kwargs.get("dir_fd") or kwargs.get("src_dir_fd") or kwargs.get("dst_dir_fd"))
        return fn(*args, **kwargs)
    return wrapper


for name, n in (("remove", 1), ("unlink", 1), ("rmdir", 1), ("mkdir", 1), ("makedirs", 1), ("truncate", 1),
                ("chmod", 1), ("chown", 1), ("utime", 1), ("mkfifo", 1), ("mknod", 1), ("rename", 2),
                ("replace", 2), ("renames", 2), ("link", 2), ("symlink", 2), ("removedirs", 1)):
    if hasattr(os, name):
        setattr(os, name, _guard(getattr(os, name), n))

sys.stderr = sys.stdout
env = {"__name__": "__main__", "__builtins__": builtins}
try:
    tree = ast.parse(code, "<tool>", "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<tool>", "exec"), env)
    if last is not None:
        value = eval(compile(last, "<tool>", "eval"), env)
        if value is not None:
            print(repr(value))
except SystemExit as e:
    if e.code not in (None, 0):
        sys.stdout.flush()
        report(describe(e))
except BaseException as e:
    sys.stdout.flush()
    report(describe(e))
sys.stdout.flush()
"""


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one tool call.

    Attributes:
        ok: the code ran to the end without an exception, within its limits.
        output: its stdout and stderr (merged), at most ``max_output`` characters plus ``TRUNCATED``, without the
            trailing newline; a trailing expression's ``repr`` is printed like a calculator / REPL.
        error: None when ``ok``; else one line: ``"timed out after 5.0 s"``, the exception's last traceback line
            (``"MemoryError"``, ``"PermissionError: network access is not allowed"``, ``"ZeroDivisionError:
            division by zero"``) or how the process ended (``"the tool process was killed by signal SIGXCPU"``).
    """

    ok: bool
    output: str
    error: str | None

    def text(self) -> str:
        """What a model sees: the output, then ``Error: <error>`` on its own line when the call failed."""
        if self.ok:
            return self.output if self.output else "(no output)"
        return (self.output + "\n" if self.output else "") + f"Error: {self.error}"


class _CappedReader(threading.Thread):
    """Reads a pipe to EOF, keeping the first ``limit`` bytes and discarding the rest."""

    def __init__(self, pipe, limit: int) -> None:
        super().__init__(daemon=True)
        self.pipe, self.limit, self.data, self.dropped = pipe, limit, bytearray(), False

    def run(self) -> None:
        while chunk := self.pipe.read1(65536):
            room = self.limit - len(self.data)
            if room > 0:
                self.data += chunk[:room]
            if len(chunk) > max(room, 0):
                self.dropped = True
        self.pipe.close()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group has already exited: nothing left to kill


def evaluate(
    code: str, *, timeout_s: float = 5.0, memory_mb: int = 256, max_output: int = 2000, max_file_mb: int = 16
) -> ToolResult:
    """Run ``code`` in a fresh limited subprocess (see the module docstring for the limits and what they do not stop).

    If the last statement is an expression its value's ``repr`` is printed (unless None), so ``"12345*6789"`` gives
    output ``"83810205"``.

    Args:
        code: Python source.
        timeout_s: wall-clock seconds before the process group is killed (> 0).
        memory_mb: the child's address-space limit in MiB (``RLIMIT_AS``; the interpreter itself needs ~30 MiB).
        max_output: characters of output kept.
        max_file_mb: the largest file the child may write, MiB (``RLIMIT_FSIZE``).

    Returns:
        A ``ToolResult``; errors of the code are in it, never raised.

    Raises:
        ValueError: a limit is not positive.
    """
    if timeout_s <= 0 or memory_mb <= 0 or max_output <= 0 or max_file_mb <= 0:
        msg = (
            f"evaluate: timeout_s={timeout_s}, memory_mb={memory_mb}, max_output={max_output}, "
            f"max_file_mb={max_file_mb}; every limit must be positive (defaults 5.0 s, 256 MiB, 2000 chars, 16 MiB)."
        )
        raise ValueError(msg)
    with tempfile.TemporaryDirectory(prefix="grpoflow-tool-") as scratch:
        cfg = {
            "scratch": scratch,
            "memory_mb": int(memory_mb),
            "timeout_s": float(timeout_s),
            "max_file_mb": int(max_file_mb),
            "mark": _ERROR_MARK,
        }
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": scratch, "TMPDIR": scratch}
        env["LANG"] = "C.UTF-8"
        env["PYTHONIOENCODING"] = "utf-8"  # ignored under -I; LANG sets the encoding
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _RUNNER, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=scratch,
            env=env,
            start_new_session=True,
        )
        out = _CappedReader(proc.stdout, 4 * max_output + 4)
        err = _CappedReader(proc.stderr, 64 * 1024)
        out.start()
        err.start()
        timed_out = False
        try:
            try:
                proc.stdin.write(code.encode("utf-8", "surrogatepass"))
                proc.stdin.close()
            except BrokenPipeError:
                pass  # the child died before reading its code; its exit status says why
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc)  # also ends grandchildren that outlive a finished child
            proc.wait()
        out.join(timeout=2.0)
        err.join(timeout=2.0)
    text = out.data.decode("utf-8", "replace")
    output = text[:max_output] + TRUNCATED if out.dropped or len(text) > max_output else text.rstrip("\n")
    if timed_out:
        return ToolResult(ok=False, output=output, error=f"timed out after {float(timeout_s)} s")
    stderr = err.data.decode("utf-8", "replace")
    reported = [line[len(_ERROR_MARK) :] for line in stderr.splitlines() if line.startswith(_ERROR_MARK)]
    if reported:
        return ToolResult(ok=False, output=output, error=reported[-1])
    if proc.returncode != 0:
        if proc.returncode < 0:
            error = f"the tool process was killed by signal {signal.Signals(-proc.returncode).name}"
        else:
            last = [line for line in stderr.splitlines() if line.strip()]
            error = last[-1] if last else f"the tool process exited with code {proc.returncode}"
        return ToolResult(ok=False, output=output, error=error)
    return ToolResult(ok=True, output=output, error=None)
