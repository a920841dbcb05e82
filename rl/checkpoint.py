"""Checkpoints on any fsspec filesystem: HF weights (safetensors) plus trainer state (optimizer, scheduler,
RNG, data position) with no pickle, made visible by a ``_COMPLETE`` marker written last.

The marker is a JSON manifest of every other file of the checkpoint, ``{"format": ..., "algorithm": "sha256",
"files": {relative_path: {"size": int, "sha256": hex}}}``, computed from the local staging folder before the
upload; loaders verify the files against it (:func:`verify`, :func:`local_copy`). A folder without the marker is
absent (its writer died, it is being re-saved, or it is being pruned). Checkpoints written before manifests (an
empty marker) are not supported: reading one raises a clear :class:`~dataplane.errors.IntegrityError`.

A save over an earlier attempt of the same folder (a retry, or an attempt that died mid-upload) ends with exactly
the files of a clean save. On a local filesystem the folder is staged in a hidden sibling folder (marker
included) and swapped in with renames; on an object store the old marker goes first, then the old objects, then
each new file is uploaded to its own path, then the marker. Every remote operation is retried on transient
failures (:func:`dataplane.errors.retry_transient`); each retried operation is idempotent.

Owns the on-disk format of a checkpoint; where checkpoints live is `dataplane.paths`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import fsspec
import numpy as np
import torch

from dataplane.errors import IntegrityError, retry_transient

COMPLETE = "_COMPLETE"
TRAINER_STATE = "trainer_state"
SERVING_DTYPES = ("bfloat16",)
"""Dtypes a checkpoint can also carry its weights in, each in a subfolder of that name (a whole HF folder: config,
tokenizer, safetensors): the copy that generation pods load where they compute in that dtype (half the bytes of the
float32 master; the same values, since they cast the master to it anyway). The trainer reads only the root."""
MANIFEST_FORMAT = "grpoflow-checkpoint/1"
HASH = "sha256"
"""The manifest's digest: on this project's machines (x86 with SHA extensions, OpenSSL 3) sha256 hashes ~1.1 GB/s,
about twice blake2b's rate, i.e. ~0.5 s for a 540 MB ``model.safetensors``."""
_CHUNK = 1 << 20
_STEP = re.compile(r"step_(\d+)")


@dataclass
class TrainerState:
    """Everything that resumes training exactly, besides the weights.

    Attributes:
        step: the optimizer step the checkpoint was taken after.
        mlflow_run_id: the MLflow run the metrics of the run go to.
        extra: small JSON-serialisable values (e.g. the data position).
    """

    step: int
    mlflow_run_id: str
    extra: dict[str, Any]


@dataclass
class ShardedOptimizerState:
    """The optimizer state dicts of a model split over ranks, one per shard name (``megatron-tp0-pp1``), saved as one
    trainer state: tensors under ``{shard}:{index}.{name}`` and param groups per shard. Each rank loads its own with
    ``load_trainer_state(..., shard=)``."""

    shards: dict[str, dict[str, Any]]

    def state_dict(self) -> dict[str, Any]:
        return {
            "state": {f"{shard}:{idx}": st for shard, sd in self.shards.items() for idx, st in sd["state"].items()},
            "param_groups": {shard: sd["param_groups"] for shard, sd in self.shards.items()},
        }


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = optimizer.state_dict()
    tensors = {f"{idx}.{k}": v.detach().contiguous().cpu() for idx, st in sd["state"].items() for k, v in st.items()}
    return tensors, {"param_groups": sd["param_groups"], "keys": sorted(tensors)}


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    py = random.getstate()
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state()}, {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }


def restore_rng(tensors: dict[str, torch.Tensor], doc: dict[str, Any]) -> None:
    """Set the torch, Python and NumPy global RNG states to those saved in a checkpoint.

    Args:
        tensors: ``trainer_state/rng.safetensors`` as loaded (key ``torch``).
        doc: the ``rng`` entry of ``trainer_state/state.json`` (keys ``python``, ``numpy``).
    """
    torch.set_rng_state(tensors["torch"])
    py = doc["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    st = doc["numpy"]
    np.random.set_state((st[0], np.array(st[1], dtype=np.uint32), *st[2:]))


# ------------------------------------------------------------------------------------------------ helpers
def _fs(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str, bool]:
    """``(filesystem, path without trailing slash, whether it is the local filesystem)``."""
    # no listings cache (as the data plane's client): another process may have saved or pruned since this one listed
    fs, path = fsspec.core.url_to_fs(url, **{"use_listings_cache": False, **(storage_options or {})})
    path = path.rstrip("/")
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return fs, path, "file" in protocols or "local" in protocols


def _digest(fileobj: Any) -> str:
    h = hashlib.new(HASH)
    while chunk := fileobj.read(_CHUNK):
        h.update(chunk)
    return h.hexdigest()


def _file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return _digest(f)


def _manifest(folder: Path) -> bytes:
    """The manifest of every file under ``folder`` (a local staging folder), as the marker's bytes."""
    files = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel != COMPLETE:
            files[rel] = {"size": p.stat().st_size, HASH: _file_digest(p)}
    return json.dumps({"format": MANIFEST_FORMAT, "algorithm": HASH, "files": files}, indent=1, sort_keys=True).encode()


def _safe_rel(rel: Any) -> bool:
    if not isinstance(rel, str) or not rel or "\\" in rel or rel == COMPLETE:
        return False
    p = PurePosixPath(rel)
    return not p.is_absolute() and all(part not in ("", ".", "..") for part in rel.split("/"))


def _parse_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """The manifest in a marker's bytes.

    Raises:
        IntegrityError: the marker is empty (a pre-manifest checkpoint), not JSON, or not a manifest.
    """
    if not raw.strip():
        msg = (
            f"{where}: {COMPLETE} is empty: a checkpoint written before grpoflow recorded file manifests, which is not "
            "supported (start a new run, or re-save it with this version)"
        )
        raise IntegrityError(msg)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        msg = f"{where}: {COMPLETE} is not a JSON manifest ({err})"
        raise IntegrityError(msg) from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict) or not files or doc.get("algorithm", HASH) != HASH:
        msg = f"{where}: {COMPLETE} is not a {MANIFEST_FORMAT} manifest (no file list, or a digest other than {HASH})"
        raise IntegrityError(msg)
    for rel, entry in files.items():
        ok = isinstance(entry, dict) and type(entry.get("size")) is int and isinstance(entry.get(HASH), str)
        if not ok or not _safe_rel(rel):
            msg = f"{where}: {COMPLETE} has a malformed entry {rel!r}: {entry!r}"
            raise IntegrityError(msg)
    return doc


def _read_manifest(fs: Any, path: str, url: str) -> dict[str, Any] | None:
    """The checkpoint's manifest, or None when it has no marker (not complete)."""
    try:
        raw = retry_transient(lambda: fs.cat_file(f"{path}/{COMPLETE}"), what=f"checkpoint {url}: read {COMPLETE}")
    except FileNotFoundError:
        return None
    return _parse_manifest(raw, f"checkpoint {url}")


def _not_complete(url: str) -> IntegrityError:
    return IntegrityError(
        f"checkpoint {url} is not complete: it has no {COMPLETE} marker (its writer died before finishing, or it is "
        "being re-saved or pruned); weights are loaded only from complete checkpoints"
    )


def _mismatch(where: str, rel: str, entry: dict[str, Any], size: int | None, actual: str | None) -> IntegrityError:
    expected = f"expected {entry['size']} bytes, {HASH} {entry[HASH]}"
    if size is None:
        return IntegrityError(f"{where}: {rel} is missing ({expected})")
    return IntegrityError(f"{where}: {rel} is corrupt: {size} bytes, {HASH} {actual}; {expected}")


_VERIFIED: dict[tuple[str, int, int, int, int], str] = {}
"""Local files this process has hashed, by ``(path, size, mtime_ns, ctime_ns, inode)``: a second cold load of an
unchanged file (a resume verifies the checkpoint, then the trainer and the generator load it) skips the hashing.
Any write, rename-over or metadata change moves ``ctime``, which no writer can set back."""


def _verify_folder(folder: Path, manifest: dict[str, Any], where: str) -> None:
    for rel, entry in manifest["files"].items():
        p = folder / rel
        try:
            st = p.stat()
        except (FileNotFoundError, NotADirectoryError):
            raise _mismatch(where, rel, entry, None, None) from None
        key = (str(p.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        if st.st_size == entry["size"] and _VERIFIED.get(key) == entry[HASH]:
            continue
        actual = _file_digest(p)
        if st.st_size != entry["size"] or actual != entry[HASH]:
            raise _mismatch(where, rel, entry, st.st_size, actual)
        if len(_VERIFIED) > 4096:
            _VERIFIED.clear()
        _VERIFIED[key] = actual


def _verify_remote(fs: Any, path: str, manifest: dict[str, Any], url: str) -> None:
    where = f"checkpoint {url}"
    for rel, entry in manifest["files"].items():
        obj = f"{path}/{rel}"

        def read(o: str = obj) -> tuple[int, str]:
            with fs.open(o, "rb") as f:
                return f.size, _digest(f)

        try:
            size, actual = retry_transient(read, what=f"{where}: hash {rel}")
        except FileNotFoundError:
            raise _mismatch(where, rel, entry, None, None) from None
        if size != entry["size"] or actual != entry[HASH]:
            raise _mismatch(where, rel, entry, size, actual)


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
    from safetensors.torch import save_file

    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if serving_dtype is not None:
        _write_serving_copy(staging, serving_dtype)
    if optimizer is not None and state is not None:
        ts = staging / TRAINER_STATE
        ts.mkdir()
        tensors, doc = _optimizer_tensors(optimizer)
        save_file(tensors, str(ts / "optimizer.safetensors"))
        rng_tensors, rng_doc = _rng_state()
        save_file(rng_tensors, str(ts / "rng.safetensors"))
        (ts / "state.json").write_text(
            json.dumps(
                {
                    "step": state.step,
                    "mlflow_run_id": state.mlflow_run_id,
                    "extra": state.extra,
                    "optimizer": doc,
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                    "rng": rng_doc,
                }
            )
        )


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
        msg = f"serving_dtype={serving_dtype!r}: a checkpoint carries copies in {', '.join(SERVING_DTYPES)} only (None: no copy)"
        raise ValueError(msg)
    fs, path, local = _fs(url, storage_options)
    if local:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex}"  # same filesystem: renames are atomic
        staging.mkdir()
    else:
        staging = Path(tempfile.mkdtemp(prefix="grpoflow-save-"))
    try:
        _write_staging(staging, model, tokenizer, optimizer, scheduler, state, serving_dtype)
        manifest = _manifest(staging)
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
    fs, path, _ = _fs(url, storage_options)
    return retry_transient(lambda: fs.exists(f"{path}/{COMPLETE}"), what=f"checkpoint {url}: look for {COMPLETE}")


def has_trainer_state(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``url`` is complete (:func:`is_complete`) and holds trainer state (not a weights-only folder).

    Raises:
        storage errors: permanent, or transient past the retry deadline.
    """
    fs, path, _ = _fs(url, storage_options)
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


def trainer_state_doc(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document of the checkpoint's trainer state (``step``, ``mlflow_run_id``, ``extra``), read without
    loading any tensor.

    Raises:
        FileNotFoundError: ``url`` holds no trainer state (a weights-only folder, or no checkpoint).
        storage errors: permanent, or transient past the retry deadline.
    """
    fs, path, _ = _fs(url, storage_options)
    raw = retry_transient(
        lambda: fs.cat_file(f"{path}/{TRAINER_STATE}/state.json"), what=f"checkpoint {url}: read its trainer state"
    )
    return json.loads(raw)


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
    fs, path, local = _fs(url, storage_options)
    manifest = _read_manifest(fs, path, url)
    if manifest is None:
        raise _not_complete(url)
    if local:
        _verify_folder(Path(path), manifest, f"checkpoint {url}")
    else:
        _verify_remote(fs, path, manifest, url)
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
        the local folder's path.

    Raises:
        dataplane.errors.IntegrityError: ``require_complete`` and no marker; an empty or malformed marker; a listed
            file missing, or (with ``verify``) of another size or hash.
        FileNotFoundError: no marker, not ``require_complete``, and nothing at a remote ``url``.
        storage errors: permanent, or transient past the retry deadline.
    """
    fs, path, local = _fs(url, storage_options)
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
                _verify_folder(folder, manifest, f"checkpoint {url}")
            return str(folder)
        rels = list(manifest["files"])
    source = f"{path}/{sub}" if sub else path
    target = Path(tempfile.mkdtemp(prefix="grpoflow-ckpt-"))
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
                raise _mismatch(f"checkpoint {url}", rel, manifest["files"][rel], None, None) from None
        if manifest is not None:
            if verify:
                _verify_folder(target, manifest, f"checkpoint {url}")
            (target / COMPLETE).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return str(target)


@contextlib.contextmanager
def local_folder(
    url: str,
    storage_options: dict[str, Any] | None = None,
    *,
    require_complete: bool = False,
    verify: bool = True,
    weights_only: bool = False,
    dtype: str | None = None,
) -> Iterator[str]:
    """:func:`local_copy` for the length of a ``with`` block: the temporary copy of a remote checkpoint is removed at
    its end (a local folder is used where it is and left alone). Same arguments and errors as :func:`local_copy`."""
    folder = local_copy(
        url, storage_options, require_complete=require_complete, verify=verify, weights_only=weights_only, dtype=dtype
    )
    copied = not _fs(url, storage_options)[2]
    try:
        yield folder
    finally:
        if copied:
            shutil.rmtree(folder, ignore_errors=True)


def load_trainer_state(
    folder: str, optimizer: torch.optim.Optimizer, scheduler: Any, *, shard: str | None = None
) -> TrainerState:
    """Load optimizer, scheduler and RNG state from a local checkpoint folder (see :func:`local_copy`) into the
    given objects.

    Args:
        folder: a local checkpoint folder with ``trainer_state/``.
        optimizer: built for the checkpoint's model (or for ``shard`` of it); its state is replaced.
        scheduler: its state is replaced when given and the checkpoint has one.
        shard: the model-parallel shard whose optimizer state to load (:class:`ShardedOptimizerState`); None for a
            checkpoint of one unsplit optimizer.

    Returns:
        the saved :class:`TrainerState`.

    Raises:
        FileNotFoundError: ``folder`` has no trainer state.
        RuntimeError: the checkpoint's optimizer state is split into shards and ``shard`` is not one of them (or it
            is not split and ``shard`` is given): it was written by another back-end or other parallel sizes.
    """
    from safetensors.torch import load_file

    ts = Path(folder) / TRAINER_STATE
    doc = json.loads((ts / "state.json").read_text())
    groups = doc["optimizer"]["param_groups"]
    sharded = isinstance(groups, dict)
    if sharded != (shard is not None) or (sharded and shard not in groups):
        held = f"the shards {sorted(groups)}" if sharded else "one unsplit optimizer (the transformers back-end)"
        wanted = (
            f"shard {shard!r} (policy.backend megatron with its parallel sizes)"
            if shard is not None
            else "one unsplit optimizer"
        )
        msg = (
            f"checkpoint {folder}: its optimizer state holds {held}, but this policy needs {wanted}; resume with the "
            "policy.backend and policy.megatron_cfg parallel sizes the checkpoint was saved with"
        )
        raise RuntimeError(msg)
    tensors = load_file(str(ts / "optimizer.safetensors"))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        if shard is not None:
            owner, _, idx = idx.partition(":")
            if owner != shard:
                continue
        state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": groups[shard] if shard is not None else groups})
    if scheduler is not None and doc["scheduler"] is not None:
        scheduler.load_state_dict(doc["scheduler"])
    restore_rng(load_file(str(ts / "rng.safetensors")), doc["rng"])
    return TrainerState(step=doc["step"], mlflow_run_id=doc["mlflow_run_id"], extra=doc["extra"])


def list_complete(url: str, storage_options: dict[str, Any] | None = None) -> list[tuple[int, str]]:
    """The complete checkpoints under ``url``: folders named ``step_<digits>`` with a ``_COMPLETE`` marker (other
    names, such as ``step_abc``, ``step_000002.bak``, staging folders or stray files, are ignored).

    Returns:
        ``(step, url)`` pairs, oldest first; empty when ``url`` does not exist.

    Raises:
        storage errors: permanent, or transient past the retry deadline.
    """
    fs, path, _ = _fs(url, storage_options)

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
            fs, path, _ = _fs(old, storage_options)
            _remove_checkpoint(fs, path, old)
