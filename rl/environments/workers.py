"""Reward code in worker processes: load a reward function by reference, run it on a batch split across a persistent
pool of processes with a deadline, and turn every failure into one ``RewardError`` naming the function, the first
offending sample and the fix.

A reward function is referenced as ``"package.module:function"`` or ``"path/to/file.py:function"`` (a path relative to
the current directory). The pool is a ``concurrent.futures.ProcessPoolExecutor`` with the ``forkserver`` start method
(``spawn`` where there is none): workers never inherit the trainer's threads, CUDA state or torch; this module and
``interfaces`` import no torch, so a worker imports only what the reward code imports.

Failures (all raise ``RewardError``):

- the function runs past ``timeout_s`` on a batch: the workers are killed (never waited for) and the samples that did
  not finish are named;
- a worker process dies (``os._exit``, a signal, a crash in C code): the samples in flight are rerun one at a time in a
  fresh pool, within another ``timeout_s``, to find the first that kills its worker;
- the function raises: the exception type, message and the last frame of its traceback; the worker reruns the chunk's
  samples one at a time to name the first that raises;
- it returns something other than a sequence of one number (or None) per sample, or a NaN or infinite number.

After a failure the pool rebuilds itself on its next use; ``close`` always works and is idempotent. The rerun of a
failing chunk assumes, as TRL does, that reward functions have no side effects.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import importlib.util
import math
import multiprocessing
import multiprocessing.context
import numbers
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from functools import lru_cache
from hashlib import sha256
from pathlib import Path
from typing import Any, NoReturn

from rl.environments.interfaces import RewardError

FIX_RETURN = "return a list with one float (or None where the reward does not apply) per completion"


def split_ref(ref: str) -> tuple[str, str, bool]:
    """``"a.b:fn"`` -> ``("a.b", "fn", False)``; ``"dir/f.py:fn"`` -> ``("dir/f.py", "fn", True)``.

    A reference is a file path when its left part ends in ``.py`` or contains a path separator.

    Raises:
        ValueError: not of the form ``<module or file>:<function>``.
    """
    left, sep, name = ref.rpartition(":")
    if not sep or not left or not name.isidentifier():
        msg = (
            f"reward function reference {ref!r} is not of the form 'package.module:function' or "
            "'path/to/file.py:function'"
        )
        raise ValueError(msg)
    is_file = left.endswith(".py") or "/" in left or os.sep in left
    return left, name, is_file


def absolute_ref(ref: str) -> str:
    """The reference with a file path made absolute against the current directory (module references unchanged)."""
    left, name, is_file = split_ref(ref)
    return f"{Path(left).resolve()}:{name}" if is_file else ref


def module_source(ref: str) -> Path:
    """The source file of the module or file a reference names, without importing it.

    Raises:
        FileNotFoundError: the file does not exist, or the module is not found or has no source file.
    """
    left, _, is_file = split_ref(ref)
    if is_file:
        path = Path(left).resolve()
        if not path.is_file():
            raise FileNotFoundError(
                f"no file {path} (the path is taken relative to the current directory {Path.cwd()})"
            )
        return path
    try:
        spec = importlib.util.find_spec(left)
    except ModuleNotFoundError as err:  # a parent package is missing
        raise FileNotFoundError(f"no module {left!r} on sys.path ({err})") from None
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        raise FileNotFoundError(f"no module {left!r} with a source file on sys.path")
    return Path(spec.origin)


def load_function(ref: str) -> Callable[..., Any]:
    """Import the module or execute the file a reference names and return the attribute.

    A file is loaded once per process as a module named after the hash of its absolute path.

    Raises:
        ValueError: a malformed reference. FileNotFoundError / ImportError: no such file or module (any exception of
        the module's own code propagates). AttributeError: no such attribute. TypeError: the attribute is not callable.
    """
    left, name, is_file = split_ref(ref)
    if is_file:
        path = module_source(ref)
        mod_name = "grpoflow_reward_" + sha256(str(path).encode()).hexdigest()[:16]
        module = sys.modules.get(mod_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(mod_name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path} as a Python module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[mod_name]
                raise
    else:
        module = importlib.import_module(left)
    if not hasattr(module, name):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"{left} has no attribute {name!r} (its public callables: {', '.join(public) or 'none'})")
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{left}:{name} is a {type(fn).__name__}, not a function")
    return fn


_cached_function = lru_cache(maxsize=None)(load_function)


# ---------------------------------------------------------------------------------------------------------- worker side


_LOAD_ERRORS: dict[str, tuple[str, str, str]] = {}
"""In a worker: the preloaded references that failed to load -> (type, message, last frame)."""


def _init_worker(cwd: str, path: list[str], preload: list[str], owner: int = 0) -> None:
    """Run in each worker at start: the parent's current directory and import path (``""`` made absolute), then
    import the preloaded functions (``module:function``) and modules (their errors kept for ``_noop`` to report: an
    initializer that raises would break the pool). With ``owner`` (the pid of the process that owns the pool), a
    daemon thread ends the worker once that process is gone: a worker blocked on its call queue would otherwise
    outlive a trainer killed with SIGKILL."""
    if owner:
        threading.Thread(target=_exit_without, args=(owner,), daemon=True, name="grpoflow-owner-watch").start()
    os.chdir(cwd)
    sys.path[:] = [p or cwd for p in path]
    for ref in preload:
        err = load_only(ref) if ":" in ref else _import_only(ref)
        if err is not None:
            _LOAD_ERRORS[ref] = err


def _exit_without(owner: int, period_s: float = 1.0) -> None:
    """Poll every ``period_s`` seconds whether process ``owner`` exists; exit this process at once when it does not."""
    while True:
        time.sleep(period_s)
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:  # it exists, owned by another user
            pass


def _import_only(module: str) -> tuple[str, str, str] | None:
    try:
        importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - reported to the parent with its type and frame
        return (type(err).__name__, str(err), _last_frame(err))
    return None


def _last_frame(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else "")


def _check_output(out: Any, n: int) -> tuple | list[float | None]:
    """The rewards as floats/None, or an error record ``("length", got)`` / ``("value", j, repr)`` / ``("type", t)``."""
    if isinstance(out, (str, bytes, Mapping)) or not isinstance(out, Sequence):
        return ("type", type(out).__name__)
    if len(out) != n:
        return ("length", len(out))
    values: list[float | None] = []
    for j, v in enumerate(out):
        if v is None:
            values.append(None)
            continue
        if not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
            return ("value", j, f"{v!r} ({type(v).__name__})")
        values.append(float(v))
    return values


def _slice(columns: Mapping[str, list], lo: int, hi: int) -> dict[str, list]:
    return {k: v[lo:hi] for k, v in columns.items()}


def run_chunk(ref: str, columns: dict[str, list], shared: dict[str, Any], n: int) -> tuple:
    """Worker side: call the function on ``n`` samples, ``fn(**columns, **shared)``; never raises.

    Returns ``("ok", [float | None] * n)``, ``("load", type, message, last_frame)`` when the function does not load,
    ``("raised", type, message, last_frame, j | None)`` with ``j`` the first sample (index in the chunk) that raises
    alone, or ``("bad", record)`` with a record of ``_check_output``.
    """
    err = load_only(ref)
    if err is not None:
        return ("load", *err)
    fn = _cached_function(ref)
    try:
        out = fn(**columns, **shared)
    except (Exception, SystemExit) as err:
        first = None
        for j in range(n):  # which sample alone makes it raise
            try:
                fn(**_slice(columns, j, j + 1), **shared)
            except (Exception, SystemExit):
                first = j
                break
        return ("raised", type(err).__name__, str(err), _last_frame(err), first)
    checked = _check_output(out, n)
    return ("ok", checked) if isinstance(checked, list) else ("bad", checked)


def load_only(ref: str) -> tuple | None:
    """Worker side: import the function (cached for later calls); None, or ``(type, message, last_frame)``."""
    try:
        _cached_function(ref)
    except Exception as err:  # noqa: BLE001 - reported to the parent with its type and frame
        return (type(err).__name__, str(err), _last_frame(err))
    return None


def discard_log(*args: Any, **kwargs: Any) -> None:
    """Stands in for TRL's ``log_extra`` / ``log_metric`` callables: accepts anything and keeps nothing."""


def _noop() -> dict[str, tuple[str, str, str]]:
    """The worker's preload errors (after the initializer ran)."""
    return dict(_LOAD_ERRORS)


# ---------------------------------------------------------------------------------------------------------- parent side


@contextmanager
def _main_hidden() -> Iterator[None]:
    """Hide ``__main__``'s ``__file__`` and ``__spec__``, the two things ``multiprocessing.spawn`` reads to make a child
    re-run the main script."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class _NoMainStart:
    """Mixin for a ``spawn`` / ``forkserver`` process class: the child does not import the parent's ``__main__``.

    Such children normally re-run the main script (as ``__mp_main__``) to find functions defined there; reward
    functions are always named by module or file, so a worker needs none of it, and skipping it keeps the worker free
    of what the script imports (flytekit, torch) and safe with scripts that lack an ``if __name__ == "__main__":``
    guard.
    """

    def start(self) -> None:
        with _main_hidden():
            super().start()  # type: ignore[misc]


class _SpawnProcess(_NoMainStart, multiprocessing.context.SpawnProcess):
    pass


class _NoMainContext:
    """A multiprocessing context (delegating to ``ctx``) whose ``Process`` is ``_NoMainStart``'s."""

    def __init__(self, ctx: Any, process: type) -> None:
        self._ctx = ctx
        self.Process = process

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


if sys.platform != "win32":

    class _ForkServerProcess(_NoMainStart, multiprocessing.context.ForkServerProcess):
        pass

    _PROCESS = {"spawn": _SpawnProcess, "forkserver": _ForkServerProcess}
else:
    _PROCESS = {"spawn": _SpawnProcess}


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "it died"
    if code < 0:
        try:
            return f"it was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"it was killed by signal {-code}"
    return f"it exited with code {code}"


def _where(i: int, row_ids: Sequence[str | None] | None) -> str:
    row = row_ids[i] if row_ids is not None and i < len(row_ids) else None
    return f"sample {i} of the batch" + (f" (row_id {row!r})" if row is not None else "")


def _short_temp_dir() -> bool:
    """Whether the forkserver's socket fits in this process's temporary folder: an ``AF_UNIX`` path has at most 107
    bytes, and the server binds ``{temp}/pymp-XXXXXXXX/listener-XXXXXXXX`` (a pod with a deep ``TMPDIR`` gets
    ``spawn`` workers instead of ``OSError: AF_UNIX path too long``)."""
    from multiprocessing import util

    return len(os.fsencode(util.get_temp_dir())) + len("/listener-12345678") < 107


class RewardWorkerPool:
    """A persistent pool of ``num_workers`` processes that run reward functions on batches.

    A batch of ``n`` samples is split into ``min(num_workers, n)`` contiguous chunks, one call of the function per
    chunk (so a function sees part of the batch, as TRL's does per data-parallel rank). Several environments may share
    one pool: each ``attach``es and ``close``s it once; it stops when the last one closes (or at ``shutdown``).

    Args:
        num_workers: processes, >= 1.
        timeout_s: default seconds a function may take on one batch (all its chunks, in parallel), > 0.
        start_method: ``"forkserver"`` (default where available) or ``"spawn"``.

    Raises:
        ValueError: ``num_workers < 1``, ``timeout_s <= 0`` or an unknown start method.
    """

    def __init__(self, num_workers: int, timeout_s: float, *, start_method: str | None = None) -> None:
        if int(num_workers) < 1 or not timeout_s > 0:
            msg = f"RewardWorkerPool needs num_workers >= 1 and timeout_s > 0, got {num_workers} and {timeout_s}"
            raise ValueError(msg)
        methods = multiprocessing.get_all_start_methods()
        method = start_method or ("forkserver" if "forkserver" in methods and _short_temp_dir() else "spawn")
        if method not in ("forkserver", "spawn") or method not in methods:
            raise ValueError(f"start_method must be 'forkserver' or 'spawn' (available: {methods}), got {method!r}")
        self.num_workers = int(num_workers)
        self.timeout_s = float(timeout_s)
        self._ctx = _NoMainContext(multiprocessing.get_context(method), _PROCESS[method])
        self._executor: cf.ProcessPoolExecutor | None = None
        self._users = 0
        self._closed = False
        self._preload: list[str] = []

    # lifecycle
    def attach(self) -> RewardWorkerPool:
        """Count one more user (an environment); returns the pool."""
        if self._closed:
            raise RuntimeError("this RewardWorkerPool is shut down; build a new one")
        self._users += 1
        return self

    def close(self) -> None:
        """One user is done; the pool stops when none is left. Idempotent per user; safe after a failure."""
        self._users = max(0, self._users - 1)
        if self._users == 0:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop the workers now, whatever the users; idempotent."""
        self._closed = True
        self._drop(kill=False)

    def _start(self) -> cf.ProcessPoolExecutor:
        if self._closed:
            raise RuntimeError("this RewardWorkerPool is shut down; build a new one")
        if self._executor is None:
            self._executor = cf.ProcessPoolExecutor(
                max_workers=self.num_workers,
                mp_context=self._ctx,
                initializer=_init_worker,
                initargs=(os.getcwd(), list(sys.path), list(self._preload), os.getpid()),
            )
        return self._executor

    def _drop(self, *, kill: bool) -> dict[int, int | None]:
        """Shut the executor down (killing its workers first when asked); the exit codes of its workers by pid."""
        ex, self._executor = self._executor, None
        if ex is None:
            return {}
        procs = dict(getattr(ex, "_processes", None) or {})  # best effort: to report exit codes and to kill
        if kill:
            for p in procs.values():
                if p.is_alive():
                    p.kill()
        ex.shutdown(wait=not kill, cancel_futures=True)
        for p in procs.values():
            p.join(timeout=2.0)
        return {pid: p.exitcode for pid, p in procs.items()}

    def warm_up(self, refs: Sequence[str] = (), *, modules: Sequence[str] = ()) -> None:
        """Start every worker with the given functions and modules imported, so that the first batch pays no start-up.

        Every worker (also those of a pool rebuilt after a failure) imports all the functions and modules any
        ``warm_up`` named, in its initializer; a running pool that lacks some of them is restarted.

        Raises:
            RewardError: a function fails to load in a worker, or the workers do not start within
                ``max(timeout_s, 60)`` seconds.
        """
        wanted = [absolute_ref(r) for r in refs] + list(modules)
        new = [r for r in wanted if r not in self._preload]
        self._preload += list(dict.fromkeys(new))
        if new and self._executor is not None:
            self._drop(kill=False)
        ex = self._start()
        wait_s = max(self.timeout_s, 60.0)
        # Submitted together, faster than a worker starts: each finds no idle worker and starts one.
        started = [ex.submit(_noop) for _ in range(self.num_workers)]
        _, not_done = cf.wait(started, timeout=wait_s)
        failed = [] if not_done else [f.exception() for f in started if f.exception() is not None]
        if not_done or failed:
            self._drop(kill=True)
            why = "did not start" if not_done else f"failed to start ({failed[0]!r})"
            raise RewardError(f"the reward worker processes {why} within {wait_s:g} s; check the machine's load")
        errors = {k: v for f in started for k, v in f.result().items()}
        for ref, key in zip([*refs, *modules], wanted, strict=True):
            err = errors.get(key)
            if err is not None:
                self._preload.remove(key)
                self._drop(kill=False)
                what = "reward function" if ":" in key else "module"
                at = f" (at {err[2]})" if err[2] else ""
                msg = f"{what} {ref!r} could not be loaded in a worker process: {err[0]}: {err[1]}{at}"
                raise RewardError(msg + "; check the reference and the module it names.")

    # running
    def run(
        self,
        ref: str,
        columns: Mapping[str, list],
        n: int,
        *,
        shared: Mapping[str, Any] | None = None,
        row_ids: Sequence[str | None] | None = None,
        timeout_s: float | None = None,
    ) -> list[float | None]:
        """``fn(**columns, **shared)`` over a batch of ``n`` samples, chunked across the workers.

        Args:
            ref: the function's reference (a relative file path is taken against the current directory).
            columns: keyword name -> ``[n]`` values, split into chunks.
            n: the batch size.
            shared: keyword arguments passed whole to every chunk.
            row_ids: ``[n]`` optional, to name failing samples.
            timeout_s: seconds for the whole batch; the pool's default if None.

        Returns:
            ``[n]`` floats, None where the function returned None.

        Raises:
            RewardError: any failure listed in the module docstring.
        """
        shared = dict(shared or {})
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        wref = absolute_ref(ref)
        if n == 0:
            return []
        k = min(self.num_workers, n)
        bounds = [(i * n // k, (i + 1) * n // k) for i in range(k)]
        ex = self._start()
        futures = [ex.submit(run_chunk, wref, _slice(columns, lo, hi), shared, hi - lo) for lo, hi in bounds]
        cf.wait(futures, timeout=timeout, return_when=cf.FIRST_EXCEPTION)
        errors = [f.exception() if f.done() and not f.cancelled() else None for f in futures]
        broken = [i for i, e in enumerate(errors) if isinstance(e, BrokenProcessPool)]
        if broken:
            return self._crashed(ref, wref, columns, shared, [bounds[i] for i in broken], n, row_ids, timeout)
        failed = [i for i, e in enumerate(errors) if e is not None]
        if failed:  # not the function's doing: its arguments or results did not cross the process boundary
            self._drop(kill=True)
            (lo, hi), err = bounds[failed[0]], errors[failed[0]]
            msg = (
                f"reward function {ref!r} could not be run on samples {lo}-{hi - 1} of the batch "
                f"(the first: {_where(lo, row_ids)}): {type(err).__name__}: {err}. Every column value passed to "
                "a reward function must be picklable, and so must its results."
            )
            raise RewardError(msg)
        not_done = [i for i, f in enumerate(futures) if not f.done()]
        if not_done:
            self._drop(kill=True)
            lo, hi = bounds[not_done[0]]
            msg = (
                f"reward function {ref!r} did not finish within timeout_s={timeout:g} s on samples {lo}-{hi - 1} of "
                f"the batch of {n} (the first: {_where(lo, row_ids)}); its worker processes were killed. Make the "
                "function faster or bound its own run time, or raise env.timeout_s."
            )
            raise RewardError(msg)
        out: list[float | None] = []
        for f, (lo, hi) in zip(futures, bounds, strict=True):
            rec = f.result()
            if rec[0] != "ok":
                raise RewardError(self._message(ref, rec, lo, hi, row_ids))
            out.extend(rec[1])
        return out

    def _message(self, ref: str, rec: tuple, lo: int, hi: int, row_ids: Sequence[str | None] | None) -> str:
        if rec[0] == "load":
            at = f" (at {rec[3]})" if rec[3] else ""
            return (
                f"reward function {ref!r} could not be loaded in a worker process: {rec[1]}: {rec[2]}{at}. The workers "
                f"import it with the trainer's sys.path ({sys.path[:3]}...) and current directory ({os.getcwd()}); "
                "check the reference and that its module imports there."
            )
        if rec[0] == "raised":
            _, etype, emsg, frame, j = rec
            where = (
                _where(lo + j, row_ids)
                if j is not None
                else f"samples {lo}-{hi - 1} of the batch together (none alone; the first: {_where(lo, row_ids)})"
            )
            at = f" (at {frame})" if frame else ""
            return (
                f"reward function {ref!r} raised {etype}: {emsg}{at} on {where}. Fix the function so that it does "
                f"not raise: {FIX_RETURN}."
            )
        kind = rec[1]
        if kind[0] == "type":
            what = f"returned a {kind[1]} for samples {lo}-{hi - 1} (the first: {_where(lo, row_ids)})"
        elif kind[0] == "length":
            what = (
                f"returned {kind[1]} rewards for the {hi - lo} samples {lo}-{hi - 1} of the batch (the first: "
                f"{_where(lo, row_ids)})"
            )
        else:
            what = f"returned {kind[2]} for {_where(lo + kind[1], row_ids)}, which is not a finite number or None"
        return f"reward function {ref!r} {what}. Fix the function: {FIX_RETURN}."

    def _crashed(
        self,
        ref: str,
        wref: str,
        columns: Mapping[str, list],
        shared: dict[str, Any],
        in_flight: list[tuple[int, int]],
        n: int,
        row_ids: Sequence[str | None] | None,
        timeout: float,
    ) -> NoReturn:
        """A worker died: rerun the samples in flight one at a time in a fresh pool to find the first that kills it."""
        codes = self._drop(kill=True)
        how = next((_describe_exit(c) for c in codes.values() if c not in (None, 0, -signal.SIGTERM)), "it died")
        deadline = time.monotonic() + timeout
        culprit = None
        for lo, hi in in_flight:
            for i in range(lo, hi):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                f = self._start().submit(run_chunk, wref, _slice(columns, i, i + 1), shared, 1)
                done, _ = cf.wait([f], timeout=left)
                if not done:
                    self._drop(kill=True)
                    break
                if isinstance(f.exception(), BrokenProcessPool):
                    culprit = i
                    codes = self._drop(kill=True)
                    how = next((_describe_exit(c) for c in codes.values() if c not in (None, 0)), how)
                    break
            if culprit is not None or deadline <= time.monotonic():
                break
        lo, hi = in_flight[0]
        where = (
            _where(culprit, row_ids)
            if culprit is not None
            else f"samples {lo}-{hi - 1} of the batch of {n} (the first: {_where(lo, row_ids)}; no single sample "
            "reproduced it)"
        )
        msg = (
            f"the worker process running reward function {ref!r} died on {where}: {how} without raising a Python "
            "exception (os._exit, sys.exit in a thread, a signal such as SIGKILL or SIGSEGV, a crash in C code, or "
            f"running out of memory). Fix the function so that it returns normally: {FIX_RETURN}."
        )
        raise RewardError(msg)
