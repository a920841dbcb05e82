"""Checkpoints on any fsspec filesystem: HF weights (safetensors) plus trainer state (optimizer, scheduler,
RNG, data position: `rl.trainer_state`) with no pickle, made visible by a ``_COMPLETE`` marker written last.

The marker is a JSON manifest of every other file of the checkpoint (`rl.manifest`), ``{"format": ...,
"algorithm": "sha256", "files": {relative_path: {"size": int, "sha256": hex}}}``, computed from the local staging
folder before the upload; loaders verify the files against it (:func:`verify`, :func:`local_copy`). A folder
without the marker is absent (its writer died, it is being re-saved, or it is being pruned). Checkpoints written
before manifests (an empty marker) are not supported: reading one raises a clear
:class:`~dataplane.errors.IntegrityError`.

A save over an earlier attempt of the same folder (a retry, or an attempt that died mid-upload) ends with exactly
the files of a clean save. On a local filesystem the folder is staged in a hidden sibling folder (marker
included) and swapped in with renames; on an object store the old marker goes first, then the old objects, then
each new file is uploaded to its own path, then the marker. Every remote operation is retried on transient
failures (:func:`dataplane.errors.retry_transient`); each retried operation is idempotent.

Owns the on-disk layout of a checkpoint (its folders, the marker, the serving copies, which checkpoints are kept);
the manifest's format is `rl.manifest`'s, the trainer state's files `rl.trainer_state`'s; where checkpoints live is
`dataplane.paths`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from dataplane.errors import IntegrityError, retry_transient
from rl.manifest import (
    COMPLETE,
    filesystem,
    folder_manifest,
    mismatch,
    parse,
    read_marker,
    verify_folder,
    verify_remote,
)
from rl.trainer_state import TRAINER_STATE, TrainerState, write_trainer_state

# re-exported (the redundant aliases): code that saves and resumes through this module names them here
from rl.trainer_state import ShardedOptimizerState as ShardedOptimizerState
from rl.trainer_state import load_trainer_state as load_trainer_state
from rl.trainer_state import trainer_state_doc as trainer_state_doc

SERVING_DTYPES = ("bfloat16",)
"""Dtypes a checkpoint can also carry its weights in, each in a subfolder of that name (a whole HF folder: config,
tokenizer, safetensors): the copy that generation pods load where they compute in that dtype (half the bytes of the
float32 master; the same values, since they cast the master to it anyway). The trainer reads only the root."""
_STEP = re.compile(r"step_(\d+)")
_COPIES: set[str] = set()
"""The temporary folders :func:`local_copy` made in this process that are not removed yet (:func:`remove_copy`)."""
_COPIES_LOCK = threading.Lock()


# ------------------------------------------------------------------------------------------------ helpers
def _read_manifest(fs: Any, path: str, url: str) -> dict[str, Any] | None:
    """The checkpoint's manifest, or None when it has no marker (not complete)."""
    raw = read_marker(fs, path, f"checkpoint {url}")
    return None if raw is None else parse(raw, f"checkpoint {url}")


def _not_complete(url: str) -> IntegrityError:
    return IntegrityError(
        f"checkpoint {url} is not complete: it has no {COMPLETE} marker (its writer died before finishing, or it is "
        "being re-saved or pruned); weights are loaded only from complete checkpoints"
    )


def _rm(fs: Any, path: str, what: str, *, recursive: bool = False) -> None:
    """Remove ``path`` (retried; already absent is fine, so a retry after a partial removal succeeds)."""

    def rm() -> None:
        try:
            fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            pass

    retry_transient(rm, what=what)


def _remove_checkpoint(fs: Any, path: str, url: str) -> None:
    """Delete a checkpoint folder: the marker first, so that no reader takes a half-deleted folder as complete."""
    _rm(fs, f"{path}/{COMPLETE}", f"checkpoint {url}: remove {COMPLETE}")
    _rm(fs, path, f"checkpoint {url}: remove its files", recursive=True)


def _write_serving_copy(staging: Path, dtype: str) -> None:
    """``staging/{dtype}/``: the staged HF folder (config, tokenizer files) with every floating-point tensor of its
    ``*.safetensors`` cast to ``dtype`` (round to nearest even, as ``Tensor.to`` casts), read back from the staged
    files so that any back-end's ``save_pretrained`` output gets the same copy."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    target = staging / dtype
    target.mkdir()
    torch_dtype = getattr(torch, dtype)
    for p in sorted(staging.iterdir()):
        if not p.is_file():
            continue
        if p.suffix == ".safetensors":
            with safe_open(str(p), framework="pt") as f:
                metadata = f.metadata()
                tensors = {
                    k: (t.to(torch_dtype) if t.is_floating_point() else t) for k in f.keys() for t in [f.get_tensor(k)]
                }
            save_file(tensors, str(target / p.name), metadata=metadata)
        elif p.name == "config.json":
            config = json.loads(p.read_text())
            config["torch_dtype" if "torch_dtype" in config else "dtype"] = dtype
            (target / p.name).write_text(json.dumps(config, indent=2, sort_keys=True))
        else:  # tokenizer files; a sharded model's index (its names stay; its total size is informative)
            shutil.copyfile(p, target / p.name)


def _write_staging(
    staging: Path,
    model: Any,
    tokenizer: Any,
    optimizer: Any,
    scheduler: Any,
    state: TrainerState | None,
    serving_dtype: str | None = None,
) -> None:
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if serving_dtype is not None:
        _write_serving_copy(staging, serving_dtype)
    if optimizer is not None and state is not None:
        write_trainer_state(staging, optimizer, scheduler, state)


def _swap_in(staging: Path, target: Path, manifest: bytes) -> None:
    """Make the staged folder the checkpoint at ``target`` (same local filesystem) without a reader ever seeing a
    marker next to files other than the ones it lists."""
    (staging / COMPLETE).write_bytes(manifest)  # the staging folder is hidden: complete only once renamed
    trash = None
    if target.exists():
        (target / COMPLETE).unlink(missing_ok=True)  # from here on no reader takes the old folder as complete
        trash = target.with_name(f".{target.name}.old-{uuid.uuid4().hex}")
        target.rename(trash)
    staging.rename(target)  # atomic: the folder appears whole, its marker included
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _upload(fs: Any, path: str, url: str, staging: Path, manifest: bytes) -> None:
    """Replace whatever is at ``path`` on an object store by the staged files, the marker last."""
    _remove_checkpoint(fs, path, url)  # an earlier attempt's marker, then its files: a re-save starts clean
    for rel in json.loads(manifest)["files"]:  # each file to its explicit destination: no directory nesting
        retry_transient(
            lambda r=rel: fs.put_file(str(staging / r), f"{path}/{r}"), what=f"checkpoint {url}: upload {rel}"
        )
    retry_transient(lambda: fs.pipe_file(f"{path}/{COMPLETE}", manifest), what=f"checkpoint {url}: write {COMPLETE}")


# ------------------------------------------------------------------------------------------------ public API
def save(
    url: str,
    *,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    state: TrainerState | None = None,
    storage_options: dict[str, Any] | None = None,
    serving_dtype: str | None = None,
) -> str:
    """Write an HF folder at ``url`` (and the trainer state when ``optimizer`` and ``state`` are given, and a copy of
    the weights in ``serving_dtype`` when given), then its ``_COMPLETE`` manifest.

    The files are staged in a local folder and hashed there. Whatever was at ``url`` before (a complete
    checkpoint, or an earlier attempt that died half-way) is replaced: afterwards ``url`` holds exactly the files
    of a clean save. A reader never sees a marker beside files it does not list: locally the staged folder
    (marker included) is renamed into place after the old folder's marker is removed and the old folder is moved
    aside; on an object store the old marker and objects are deleted, each file is uploaded to its own path and
    the marker is written last. Remote operations are retried on transient failures.

    Args:
        url: the checkpoint folder (fsspec URL or local path).
        model: has ``save_pretrained(folder)`` (safetensors weights and config).
        tokenizer: has ``save_pretrained(folder)``.
        optimizer: saved (as safetensors, no pickle) with ``state``; without both, a weights-only folder.
        scheduler: its ``state_dict()`` is saved with the trainer state, if given.
        state: the :class:`TrainerState` to save.
        storage_options: fsspec options of ``url``'s filesystem.
        serving_dtype: one of :data:`SERVING_DTYPES`: also write the weights in that dtype under ``{serving_dtype}/``
            (what generation pods load: ``local_copy(..., dtype=serving_dtype)``); None writes none.

    Returns:
        ``url``.

    Raises:
        ValueError: ``serving_dtype`` is not one of :data:`SERVING_DTYPES`.
        OSError and storage errors: a permanent failure, or a transient one that outlasted the retry deadline; the
        folder is then left without a marker (absent to readers) and a later save replaces it.
    """
    if serving_dtype is not None and serving_dtype not in SERVING_DTYPES:
        msg = (
            f"serving_dtype={serving_dtype!r}: a checkpoint carries copies in {', '.join(SERVING_DTYPES)} only "
            "(None: no copy)"
        )
        raise ValueError(msg)
    fs, path, local = filesystem(url, storage_options)
    if local:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex}"  # same filesystem: renames are atomic
        staging.mkdir()
    else:
        staging = Path(tempfile.mkdtemp(prefix="grpoflow-save-"))
    try:
        _write_staging(staging, model, tokenizer, optimizer, scheduler, state, serving_dtype)
        manifest = folder_manifest(staging)
        if local:
            _swap_in(staging, Path(path), manifest)
        else:
            _upload(fs, path, url, staging, manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return url


def is_complete(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether the checkpoint at ``url`` has its ``_COMPLETE`` marker (cheap: the marker's contents and the files
    are not checked; :func:`verify` does that).

    Raises:
        storage errors: permanent, or transient past the retry deadline.
    """
    fs, path, _ = filesystem(url, storage_options)
    return retry_transient(lambda: fs.exists(f"{path}/{COMPLETE}"), what=f"checkpoint {url}: look for {COMPLETE}")


def has_trainer_state(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``url`` is complete (:func:`is_complete`) and holds trainer state (not a weights-only folder).

    Raises:
        storage errors: permanent, or transient past the retry deadline.
    """
    fs, path, _ = filesystem(url, storage_options)
    return is_complete(url, storage_options) and retry_transient(
        lambda: fs.exists(f"{path}/{TRAINER_STATE}/state.json"), what=f"checkpoint {url}: look for its trainer state"
    )


def require_trainer_state(url: str, step: int, storage_options: dict[str, Any] | None = None) -> None:
    """Check that the checkpoint of ``step`` at ``url`` can resume training (step 0, the base model, needs nothing).

    Raises:
        RuntimeError: it holds weights only; the message says which setting keeps the trainer state.
        storage errors: permanent, or transient past the retry deadline.
    """
    if step != 0 and not has_trainer_state(url, storage_options):
        msg = (
            f"no optimizer state for step {step} at {url}: it holds weights only. Tasks that run "
            "in separate processes (a remote cluster) need checkpointing.checkpoint_period: 1"
        )
        raise RuntimeError(msg)


def verify(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check every file of the checkpoint at ``url`` (a URL or a local folder) against its ``_COMPLETE`` manifest:
    present, of the recorded size, of the recorded SHA-256. Remote files are hashed as they stream (nothing is
    written to disk); local ones are read in place (~0.5-0.7 s per 540 MB here; a local file this process already
    verified and that has not changed since, by size, mtime, ctime and inode, is not hashed again).

    Returns:
        the manifest (``{"format", "algorithm", "files": {relative_path: {"size", "sha256"}}}``).

    Raises:
        dataplane.errors.IntegrityError: no marker (not complete); an empty or malformed marker; a file missing,
            of another size, or of another hash (the message names the file, the expected and the actual size and
            digest).
        storage errors: permanent, or transient past the retry deadline.
    """
    fs, path, local = filesystem(url, storage_options)
    manifest = _read_manifest(fs, path, url)
    if manifest is None:
        raise _not_complete(url)
    if local:
        verify_folder(Path(path), manifest, f"checkpoint {url}")
    else:
        verify_remote(fs, path, manifest, f"checkpoint {url}")
    return manifest


def _part(manifest: dict[str, Any], weights_only: bool, dtype: str | None) -> tuple[str, dict[str, Any]]:
    """``(subfolder, its manifest)``: the files of a checkpoint a loader needs, relative to the folder it loads.

    The root's files, without the serving copies, and without the trainer state when ``weights_only``; or, when
    ``dtype`` names a serving copy the checkpoint has, that subfolder's files (trainer state never included)."""
    files = manifest["files"]
    if dtype is not None and any(rel.startswith(f"{dtype}/") for rel in files):
        sub = {rel[len(dtype) + 1 :]: entry for rel, entry in files.items() if rel.startswith(f"{dtype}/")}
        return dtype, {**manifest, "files": sub}
    skip = {f"{d}/" for d in SERVING_DTYPES} | ({f"{TRAINER_STATE}/"} if weights_only or dtype is not None else set())
    kept = {rel: entry for rel, entry in files.items() if not any(rel.startswith(s) for s in skip)}
    return "", {**manifest, "files": kept}


def local_copy(
    url: str,
    storage_options: dict[str, Any] | None = None,
    *,
    require_complete: bool = False,
    verify: bool = True,
    weights_only: bool = False,
    dtype: str | None = None,
) -> str:
    """A local folder holding the checkpoint, or the part of it a loader needs (the folder itself, or its serving
    subfolder, when it is already local; else a new temporary folder with a copy).

    A folder with a ``_COMPLETE`` marker is copied file by file as its manifest lists them and, with ``verify``,
    checked against it; the copy's own marker lists what was copied. A folder without one (a base model folder) is
    copied as it is, unless ``require_complete``.

    Args:
        url: the checkpoint or model folder.
        storage_options: fsspec options of ``url``'s filesystem.
        require_complete: refuse a folder without a marker. Loaders pass ``version.step > 0``: every policy after
            step 0 comes from a checkpoint; step 0 is the base model folder, which has no marker.
        verify: check sizes and SHA-256 digests of a folder with a marker (~0.5-0.7 s per 540 MB; see :func:`verify`).
        weights_only: leave the trainer state (optimizer moments: twice the float32 weights' bytes) behind: what
            every loader but the trainer asks for.
        dtype: a loader that computes in this dtype (``"bfloat16"``) takes the checkpoint's copy in it where the
            checkpoint has one (see :func:`save`'s ``serving_dtype``), else the float32 root without trainer state.

    Returns:
        the local folder's path. A temporary copy is the caller's to remove (:func:`remove_copy`, or use
        :func:`local_folder`); one still there when the process exits is removed then.

    Raises:
        dataplane.errors.IntegrityError: ``require_complete`` and no marker; an empty or malformed marker; a listed
            file missing, or (with ``verify``) of another size or hash.
        FileNotFoundError: no marker, not ``require_complete``, and nothing at a remote ``url``.
        storage errors: permanent, or transient past the retry deadline.
    """
    fs, path, local = filesystem(url, storage_options)
    manifest = _read_manifest(fs, path, url)
    if manifest is None:
        if require_complete:
            raise _not_complete(url)
        if local:
            return path
        found = retry_transient(lambda: fs.find(path), what=f"{url}: list")
        rels = [f.rstrip("/")[len(path) + 1 :] for f in found if f.startswith(path + "/")]
        if not rels:
            msg = f"{url}: no files there"
            raise FileNotFoundError(msg)
        sub = ""
    else:
        sub, manifest = _part(manifest, weights_only, dtype)
        if local:
            folder = Path(path, sub) if sub else Path(path)
            if verify:
                verify_folder(folder, manifest, f"checkpoint {url}")
            return str(folder)
        rels = list(manifest["files"])
    source = f"{path}/{sub}" if sub else path
    target = _temporary_copy()
    try:
        for rel in rels:
            dest = target / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                retry_transient(
                    lambda r=rel, d=dest: fs.get_file(f"{source}/{r}", str(d)),
                    what=f"{url}: download {sub}/{rel}" if sub else f"{url}: download {rel}",
                )
            except FileNotFoundError:
                if manifest is None:
                    raise
                raise mismatch(f"checkpoint {url}", rel, manifest["files"][rel], None, None) from None
        if manifest is not None:
            if verify:
                verify_folder(target, manifest, f"checkpoint {url}")
            (target / COMPLETE).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    except BaseException:
        remove_copy(str(target))
        raise
    return str(target)


def _temporary_copy() -> Path:
    """A new folder ``$TMPDIR/grpoflow-ckpt-*`` for :func:`local_copy`, removed at the latest when this process exits
    (``atexit``: also after ``KeyboardInterrupt``, or SIGTERM where a handler turns it into an exception, as a local
    run's does: ``tasks.failure.watch_interrupts``)."""
    target = tempfile.mkdtemp(prefix="grpoflow-ckpt-")
    with _COPIES_LOCK:
        if not _COPIES:
            atexit.unregister(_remove_copies)
            atexit.register(_remove_copies)
        _COPIES.add(target)
    return Path(target)


def remove_copy(folder: str) -> None:
    """Remove a temporary folder of :func:`local_copy` (a no-op where it is gone already)."""
    shutil.rmtree(folder, ignore_errors=True)
    with _COPIES_LOCK:
        _COPIES.discard(folder)


def _remove_copies() -> None:
    """Remove every temporary copy this process still has (at exit: a back-end that keeps reading its copy, such as a
    vLLM engine's model folder, keeps it until then)."""
    with _COPIES_LOCK:
        left = sorted(_COPIES)
    for folder in left:
        remove_copy(folder)


@contextlib.contextmanager
def local_folder(url: str, storage_options: dict[str, Any] | None = None, **options: Any) -> Iterator[str]:
    """:func:`local_copy` for the length of a ``with`` block: the temporary copy of a remote checkpoint is removed at
    its end (a local folder is used where it is and left alone).

    Args:
        url, storage_options: as :func:`local_copy`.
        options: :func:`local_copy`'s keyword arguments (``require_complete``, ``verify``, ``weights_only``,
            ``dtype``).

    Yields:
        the local folder's path.

    Raises:
        TypeError: a keyword :func:`local_copy` does not take.
        the errors of :func:`local_copy`.
    """
    folder = local_copy(url, storage_options, **options)
    copied = not filesystem(url, storage_options)[2]
    try:
        yield folder
    finally:
        if copied:
            remove_copy(folder)


def list_complete(url: str, storage_options: dict[str, Any] | None = None) -> list[tuple[int, str]]:
    """The complete checkpoints under ``url``: folders named ``step_<digits>`` with a ``_COMPLETE`` marker (other
    names, such as ``step_abc``, ``step_000002.bak``, staging folders or stray files, are ignored).

    Returns:
        ``(step, url)`` pairs, oldest first; empty when ``url`` does not exist.

    Raises:
        storage errors: permanent, or transient past the retry deadline.
    """
    fs, path, _ = filesystem(url, storage_options)

    def ls() -> list[str]:
        try:
            return fs.ls(path, detail=False)
        except FileNotFoundError:
            return []

    out = []
    for child in retry_transient(ls, what=f"checkpoints {url}: list"):
        name = child.rstrip("/").rsplit("/", 1)[-1]
        m = _STEP.fullmatch(name)
        if m and retry_transient(
            lambda c=child: fs.exists(f"{c.rstrip('/')}/{COMPLETE}"), what=f"checkpoints {url}: look at {name}"
        ):
            out.append((int(m[1]), f"{url.rstrip('/')}/{name}"))
    return sorted(out)


def prune(
    url: str,
    keep_last_k: int,
    storage_options: dict[str, Any] | None = None,
    *,
    keep: str | Iterable[str] | None = None,
) -> None:
    """Delete all but the newest ``keep_last_k`` complete checkpoints under ``url``, and never those in ``keep`` (the
    checkpoint the running step started from: a retry of that step must be able to load it again; with async GRPO
    also the policies later rollouts generate with).

    Each checkpoint loses its marker first, so a concurrent reader never takes a half-deleted one as complete; a
    prune that dies half-way leaves marker-less folders, which readers ignore and a later save replaces.

    Raises:
        storage errors: permanent, or transient past the retry deadline.
    """
    kept = {keep} if isinstance(keep, str) else set(keep or ())
    kept = {k.rstrip("/") for k in kept}
    complete = list_complete(url, storage_options)
    for _, old in complete[: max(len(complete) - keep_last_k, 0)]:
        if old.rstrip("/") not in kept:
            fs, path, _ = filesystem(old, storage_options)
            _remove_checkpoint(fs, path, old)
