"""The base model on the run's storage: published once, content-addressed, and loaded by every pod through a
node-local cache.

A model folder that exists only on one machine (the default model, converted from its GGUF into ``start_run``'s home
cache; any folder on that pod's disk) means nothing to the pods that run the other tasks. :func:`publish` copies it to
``{root}/models/{digest}/`` of the run's storage, where ``digest`` is the SHA-256 of its manifest (every file's
relative path, size and SHA-256), so a second run of the same model finds it there and uploads nothing.
:func:`materialize` turns that URL back into a local folder on any machine: a folder named by the digest in the node
cache (:func:`cache_root`), downloaded once per node and checked against the manifest.

The published folder has :mod:`rl.checkpoint`'s format, a weights-only checkpoint: the files, then a ``_COMPLETE``
marker holding the manifest (:mod:`rl.manifest`), written last. A folder without its marker (its publisher died
half-way, or is still uploading) is not trusted: :func:`materialize` refuses it and the next :func:`publish` completes
it. A publish that finds the marker checks that every file it lists is there with its size (one ``stat`` or
``HEAD`` per file) and uploads again any that is missing or of another size. Concurrent publishers are safe: on an
object store they upload identical bytes to the same keys, each writing the marker only after all of its own files;
on a local or shared disk each stages a hidden folder and renames it into place, the first rename winning (a stray
folder without a marker at the digest path, never a publish's, is moved aside and replaced). Publishers delete
nothing else. The node cache works the same way (a hidden download folder, verified, then renamed), so pods that
start side by side on one node never see each other's half-written files.

The node cache is not trusted blindly: each process hashes a cached copy's files once against the manifest before
it uses them (SHA-256 at ~0.7-0.9 GB/s on this project's 2-core machine under load, ``python -m bench.model_cache``:
~0.8 s for the 135M model in float32, ~3 s for a 1B model in bfloat16, plus the disk read when the files are not in
the page cache), then only ``stat``s them (~0.3 ms) while their size, mtime, ctime and inode stay the same. A copy
that fails (a flipped bit, a hand-edited ``config.json``, a file gone) is moved aside, with a warning naming the
file, and downloaded again.

Local folders and hub ids pass through :func:`materialize` unchanged, so a run on one machine (the local executor)
loads its model where it is, with nothing hashed or copied; only a remote execution publishes (``tasks.setup``).

Layout under a root: ``{root}/models/{sha256 hex}/{files..., _COMPLETE}``; node cache:
``{cache_root()}/{sha256 hex}/{files..., .grpoflow-manifest.json}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dataplane.errors import IntegrityError, retry_transient
from dataplane.urls import redact
from rl.manifest import COMPLETE, encode, filesystem, parse, read_marker, verify_folder

MODELS = "models"
"""The folder under a storage root that holds published models (beside the runs' folders)."""

CACHE_ENV = "GRPOFLOW_MODEL_CACHE"
"""The node-local cache of published models (default ``{rl.model.cache_dir()}/published``). On a cluster, point it at
a node-local disk mounted into every pod (a hostPath or local NVMe volume) so that the pods of one node share it."""

CACHE_MANIFEST = ".grpoflow-manifest.json"
"""The manifest (the published marker's bytes) beside a node-cache copy's files. Hidden and not named ``_COMPLETE``:
loaders take the copy as a plain model folder, which :func:`materialize` checks against it (once per process)."""
_DIGEST = re.compile(r"[0-9a-f]{64}")
_WORKERS = 8
"""Files transferred at once (a sharded model's shards upload and download side by side)."""
_TRUSTED: dict[str, tuple[str, tuple[tuple[str, int, int, int, int, int], ...]]] = {}
"""Node-cache copies this process has checked whole against their manifest: folder -> (digest, ``(relative path,
device, inode, size, mtime_ns, ctime_ns)`` of each file, taken before it was hashed). A write, truncation or
replacement of a file moves its ctime or inode, which no writer can set back, so a changed file is hashed again."""


def cache_root() -> Path:
    """``$GRPOFLOW_MODEL_CACHE``, else ``{rl.model.cache_dir()}/published`` (``$GRPOFLOW_CACHE`` or
    ``~/.cache/grpoflow``): the node-local folder that holds published models, one sub-folder per digest."""
    from rl.model import cache_dir

    found = os.environ.get(CACHE_ENV)
    return Path(found) if found else cache_dir() / "published"


def models_dir(root: str) -> str:
    """``{root}/models``: where :func:`publish` puts models under the storage root ``root`` (a URL or folder)."""
    return f"{root.rstrip('/')}/{MODELS}"


def _published_files(folder: Path) -> dict[str, Path]:
    """The files of a model folder that a publish copies, by relative POSIX path: everything but hidden files and
    folders (``.git``, a hub download's ``.cache``), a checkpoint's ``_COMPLETE`` marker, its ``trainer_state/`` and
    its serving copies (``bfloat16/``)."""
    from rl.checkpoint import SERVING_DTYPES
    from rl.trainer_state import TRAINER_STATE

    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        parts = rel.split("/")
        if (
            any(part.startswith(".") for part in parts)
            or rel == COMPLETE
            or parts[0] in (TRAINER_STATE, *SERVING_DTYPES)
            or not p.is_file()
        ):
            continue
        out[rel] = p
    return out


def manifest(folder: str | Path) -> bytes:
    """The manifest of the model folder ``folder`` as a published marker holds it: canonical JSON (sorted keys) in
    :mod:`rl.manifest`'s format, ``{"format", "algorithm": "sha256", "files": {relative_path: {"size": bytes,
    "sha256": hex}}}``, of the files a publish copies. Reads every file once (~1 GB/s here).

    Raises:
        FileNotFoundError: ``folder`` is not a folder, or holds no file to publish.
    """
    src = Path(folder)
    if not src.is_dir():
        msg = f"model folder {src}: not a folder"
        raise FileNotFoundError(msg)
    files = _published_files(src)
    if not files:
        msg = f"model folder {src}: no files to publish"
        raise FileNotFoundError(msg)
    return encode(files)


def digest(manifest_bytes: bytes) -> str:
    """The content address of a model: the SHA-256 (hex) of its manifest's bytes (:func:`manifest`)."""
    return hashlib.sha256(manifest_bytes).hexdigest()


def is_remote(url: str) -> bool:
    """Whether ``url`` names something on a filesystem other than the local one (``s3://...``, ``gs://...``,
    ``simplecache::s3://...``); a local folder, ``file://`` URL or hub id (``org/name``) is not."""
    if "://" not in url and "::" not in url:
        return False
    return not filesystem(url, None)[2]


def _local_path(url: str) -> str:
    return url.removeprefix("file://") if url.startswith("file://") else url


def publish(folder: str | Path, root: str, storage_options: dict[str, Any] | None = None) -> str:
    """Publish the model folder ``folder`` under the storage root ``root``, once: return the URL of
    ``{root}/models/{digest}`` (:func:`digest` of its :func:`manifest`), uploading nothing when a complete copy is
    already there (an earlier run of the same model, or a concurrent publisher that finished first).

    Files go first, each to its own path, then the ``_COMPLETE`` marker with the manifest: readers trust only a
    folder with its marker, so a publish that dies half-way leaves nothing anyone loads, and the next one completes
    it. On a local or shared disk the files are staged in a hidden sibling folder, checked against the manifest, and
    renamed into place (the first of concurrent publishers wins; the others drop theirs); a folder or file without a
    marker already at that path (a torn copy made by other means) is moved aside and deleted, with a warning.
    Hidden files, a ``_COMPLETE`` marker and ``trainer_state/`` of ``folder`` are left out (:func:`manifest`).

    When the marker is there, what it claims is checked by size, not content: every file it lists must exist with
    its size (one ``stat``, or one ``HEAD`` on an object store, per file); any that does not (deleted, truncated) is
    copied again from ``folder``, with a warning. Reading ``folder`` to hash it costs ~1 s per GB either way.

    Args:
        folder: a local model folder (``config.json``, weights, tokenizer).
        root: the storage root (``dataplane.root``): a local folder or an fsspec URL.
        storage_options: fsspec options of ``root``'s filesystem.

    Returns:
        the published model's URL (a local path when ``root`` is local).

    Raises:
        FileNotFoundError: ``folder`` is not a folder or holds no files.
        FileExistsError, NotADirectoryError: ``{root}/models`` on a local disk is a file, or a path above it is.
        dataplane.errors.IntegrityError: a marker already at that URL holds another manifest (corrupt storage), or
            a file changed while it was being published (on a local disk: its size or SHA-256; on an object
            store: its size).
        OSError and storage errors: permanent, or transient past the retry deadline (a later publish completes it).
    """
    src = Path(folder)
    raw = manifest(src)
    key = digest(raw)
    url = f"{models_dir(root)}/{key}"
    fs, path, local = filesystem(url, storage_options)
    files = json.loads(raw)["files"]
    if local:
        _make_dir(Path(path).parent, "the storage root's models folder", "remove or rename it, or use another root")
    found = read_marker(fs, path, f"published model {redact(url)}") if not local or Path(path).is_dir() else None
    if found is not None:
        if found != raw:
            msg = (
                f"published model {redact(url)}: its {COMPLETE} marker holds another manifest than the folder it is "
                f"named after; storage is corrupt there: delete {redact(url)} and publish again"
            )
            raise IntegrityError(msg)
        _repair(fs, path, url, src, raw, files, local)
        return url
    t0 = time.perf_counter()
    if local:
        _publish_local(src, Path(path), raw, files)
    else:
        _upload(fs, path, url, src, raw, files)
    size = sum(e["size"] for e in files.values())
    print(
        f"[grpoflow] published the base model ({len(files)} files, {size / 1e6:.1f} MB) to {redact(url)} in "
        f"{time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return url


def _make_dir(folder: Path, what: str, fix: str) -> None:
    """Create the local folder ``folder`` (and its parents) unless it exists.

    Raises:
        FileExistsError: ``folder`` is a file; NotADirectoryError: a path above it is: the message names ``what``
            and ``folder``, and says ``fix``.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        msg = f"{what} {folder} is a file, not a folder: {fix}"
        raise FileExistsError(msg) from None
    except NotADirectoryError as err:
        msg = f"{what} {folder}: a path above it is a file, not a folder ({err}): {fix}"
        raise NotADirectoryError(msg) from None


def _move_aside(target: Path) -> Path | None:
    """Rename ``target`` (a folder or file) to a hidden sibling and return that, or None when it is gone already."""
    trash = target.with_name(f".{target.name}.bad-{uuid.uuid4().hex}")
    try:
        target.rename(trash)
    except FileNotFoundError:
        return None
    return trash


def _remove(path: Path) -> None:
    """Delete what :func:`_move_aside` moved aside (best effort: it is hidden, and nobody loads it)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _publish_local(src: Path, target: Path, raw: bytes, files: dict[str, Any]) -> None:
    staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex}"  # hidden: never taken for a model
    try:
        for rel in files:
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, staging / rel)
        verify_folder(staging, json.loads(raw), f"published model {target}")  # what lands is what the manifest says
        (staging / COMPLETE).write_bytes(raw)
        for _ in range(3):
            try:
                staging.rename(target)  # atomic: the folder appears whole, its marker included
                return
            except OSError:
                if (target / COMPLETE).is_file():  # a concurrent publisher's complete copy
                    return
                if not target.exists() and not target.is_symlink():
                    raise
            # a folder or file without a marker: not a publish (those rename a whole folder with its marker)
            print(
                f"[grpoflow] warning: {target} holds no {COMPLETE} marker (a torn or foreign copy, not a publish); "
                "replacing it with a complete copy",
                file=sys.stderr,
                flush=True,
            )
            trash = _move_aside(target)
            if trash is not None:
                _remove(trash)  # a concurrent publisher's copy moved aside meanwhile holds the same bytes as ours
        msg = (
            f"published model {target}: something keeps writing a folder there while this publish renames its copy "
            f"into place; stop it, delete {target}, and publish again"
        )
        raise IntegrityError(msg)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _damaged(fs: Any, path: str, url: str, files: dict[str, Any], local: bool) -> list[str]:
    """The files of the published model at ``path`` that are missing or of another size than ``files`` (its
    manifest's entries) says: one ``stat`` (local) or ``info`` (an object store's ``HEAD``) per file."""

    def bad(rel: str) -> bool:
        if local:
            p = Path(path) / rel
            return not p.is_file() or p.stat().st_size != files[rel]["size"]
        try:
            info = retry_transient(lambda: fs.info(f"{path}/{rel}"), what=f"published model {redact(url)}: check {rel}")
        except FileNotFoundError:
            return True
        return info.get("size") != files[rel]["size"]

    with ThreadPoolExecutor(max_workers=min(_WORKERS, len(files))) as pool:
        return [rel for rel, b in zip(files, pool.map(bad, files)) if b]


def _repair(fs: Any, path: str, url: str, src: Path, raw: bytes, files: dict[str, Any], local: bool) -> None:
    """Publish again the files of the published model at ``path`` (with its marker) that :func:`_damaged` finds,
    from the local model folder ``src``; on a local disk each goes to a hidden file that is checked against the
    manifest and renamed over the damaged one, so a reader never sees it half-written."""
    bad = _damaged(fs, path, url, files, local)
    if not bad:
        return
    print(
        f"[grpoflow] warning: published model {redact(url)} has its {COMPLETE} marker but lacks {len(bad)} of its "
        f"files, or has them at another size ({', '.join(bad)}); publishing them again",
        file=sys.stderr,
        flush=True,
    )
    if not local:
        _upload(fs, path, url, src, raw, {rel: files[rel] for rel in bad})
        return
    for rel in bad:
        dest = Path(path) / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex}")
        try:
            shutil.copyfile(src / rel, tmp)
            verify_folder(tmp.parent, {"files": {tmp.name: files[rel]}}, f"published model {path}")
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)


def _upload(fs: Any, path: str, url: str, src: Path, raw: bytes, files: dict[str, Any]) -> None:
    def put(rel: str) -> None:
        dest = f"{path}/{rel}"
        retry_transient(lambda: fs.put_file(str(src / rel), dest), what=f"published model {redact(url)}: upload {rel}")
        size = retry_transient(lambda: fs.info(dest)["size"], what=f"published model {redact(url)}: check {rel}")
        if size != files[rel]["size"]:
            msg = (
                f"published model {redact(url)}: {rel} has {size} bytes after its upload, the manifest "
                f"{files[rel]['size']}: did {src / rel} change meanwhile?"
            )
            raise IntegrityError(msg)

    with ThreadPoolExecutor(max_workers=min(_WORKERS, len(files))) as pool:
        list(pool.map(put, files))  # re-raises the first failure; the marker is not written then
    retry_transient(
        lambda: fs.pipe_file(f"{path}/{COMPLETE}", raw), what=f"published model {redact(url)}: write {COMPLETE}"
    )


def is_published(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``url`` holds a complete published model (its ``_COMPLETE`` marker exists; the files are not read).

    Raises:
        storage errors: permanent, or transient past the retry deadline.
    """
    fs, path, _ = filesystem(url, storage_options)
    return read_marker(fs, path, f"published model {redact(url)}") is not None


def materialize(url: str, storage_options: dict[str, Any] | None = None, *, cache: str | Path | None = None) -> str:
    """A local folder holding the model at ``url``, for ``from_pretrained``.

    A local folder, ``file://`` URL or hub id is returned as it is (a ``file://`` URL as its path): nothing is copied.
    A published model on a remote filesystem (``{root}/models/{digest}``, :func:`publish`) is downloaded once per node
    into ``{cache}/{digest}``: into a hidden folder beside it, checked file by file against the manifest (size and
    SHA-256), then renamed into place, so concurrent pods on one node never see a partial copy (if two download at
    once, the first rename wins). The copy keeps the manifest as :data:`CACHE_MANIFEST`, not as a ``_COMPLETE``
    marker, so loaders take it as a plain model folder.

    A later call finds the cached folder and checks it against that manifest: the first time in a process, every
    file's size and SHA-256 (~1 s per GB, plus the disk read when it is not in the page cache); after that (or
    after this process downloaded it), only each file's ``stat`` while its size, mtime, ctime and inode are
    unchanged. A copy that fails is moved aside and deleted, with a warning on stderr naming the file, and
    downloaded again; anything else at that path (a stray folder or file) likewise.

    Args:
        url: a local folder, hub id, or the URL of a published model.
        storage_options: fsspec options of ``url``'s filesystem.
        cache: the node cache (default :func:`cache_root`).

    Returns:
        the local folder (or the hub id, unchanged).

    Raises:
        ValueError: ``url`` is remote but does not end in a model digest (64 hex digits): not a published model.
        FileExistsError, NotADirectoryError: the node cache ``cache`` is a file, or a path above it is.
        dataplane.errors.IntegrityError: no ``_COMPLETE`` marker there (never published, or its publisher died
            half-way); the marker does not hash to the digest in the URL, or is malformed; a file is missing from
            the store (the message names its path, and says to publish the model again), or downloads at another
            size or SHA-256 than the manifest says; a damaged cached copy could not be moved aside.
        OSError and storage errors: permanent, or transient past the retry deadline.
    """
    if not is_remote(url):
        return _local_path(url)
    fs, path, _ = filesystem(url, storage_options)
    key = path.rsplit("/", 1)[-1]
    if not _DIGEST.fullmatch(key):
        msg = (
            f"{redact(url)}: not a published model (a remote model is loaded from {{root}}/{MODELS}/<sha256 digest>, "
            "as start_run publishes it); give a local folder or hub id, or a published model's URL"
        )
        raise ValueError(msg)
    root = Path(cache) if cache is not None else cache_root()
    _make_dir(root, "the node model cache", f"remove {root}, or point ${CACHE_ENV} at a node-local folder")
    target = root / key
    if _cached(target, key):
        return str(target)
    where = f"published model {redact(url)}"
    raw = read_marker(fs, path, where)
    if raw is None:
        msg = (
            f"{where} is not complete: it has no {COMPLETE} marker (its publisher died before finishing, or the URL "
            "is wrong); a model is loaded only once published whole"
        )
        raise IntegrityError(msg)
    if digest(raw) != key:
        msg = (
            f"{where}: its {COMPLETE} marker hashes to {digest(raw)}, not to the digest the folder is named after; "
            "storage is corrupt there"
        )
        raise IntegrityError(msg)
    doc = parse(raw, where)
    files = doc["files"]
    t0 = time.perf_counter()
    staging = root / f".{key}.tmp-{uuid.uuid4().hex}"
    try:

        def get(rel: str) -> None:
            dest = staging / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                retry_transient(lambda: fs.get_file(f"{path}/{rel}", str(dest)), what=f"{where}: download {rel}")
            except FileNotFoundError:
                msg = (
                    f"{where}: {rel} is missing from the store ({redact(url)}/{rel}), though its {COMPLETE} marker "
                    "lists it (deleted, or lost by the store): publish the model folder again "
                    "(rl.model_store.publish, which start_run runs, uploads the files that are missing), then retry"
                )
                raise IntegrityError(msg) from None

        with ThreadPoolExecutor(max_workers=min(_WORKERS, len(files))) as pool:
            list(pool.map(get, files))
        stats = _stats(staging, files)  # before hashing: a file changed meanwhile is hashed again next time
        try:
            verify_folder(staging, doc, where)  # sizes and SHA-256 of every file against the manifest
        except IntegrityError as err:
            msg = f"{err}; the copy in the store is damaged: delete {redact(url)} and publish the model folder again"
            raise IntegrityError(msg) from None
        (staging / CACHE_MANIFEST).write_bytes(raw)
        try:
            staging.rename(target)
            if stats is not None:
                _TRUSTED[str(target)] = (key, stats)  # a folder's rename leaves its files' stat as it was
        except OSError:
            if not _cached(target, key):  # not a concurrent download's complete copy
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(e["size"] for e in files.values())
    print(
        f"[grpoflow] base model {key[:12]}: {len(files)} files, {size / 1e6:.1f} MB from {redact(url)} into the node "
        f"cache {target} in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return str(target)


def _stats(folder: Path, files: dict[str, Any]) -> tuple[tuple[str, int, int, int, int, int], ...] | None:
    """``(relative path, device, inode, size, mtime_ns, ctime_ns)`` of each of ``files`` (a manifest's entries) under
    ``folder``, or None when one is missing, not a regular file, or of another size than its entry says."""
    out = []
    for rel, entry in files.items():
        try:
            st = (folder / rel).stat()
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_size != entry["size"]:
            return None
        out.append((rel, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


def _cached(target: Path, key: str) -> bool:
    """Whether the node cache holds the model ``key`` at ``target`` whole: its :data:`CACHE_MANIFEST` hashes to
    ``key`` and every listed file has its size and SHA-256 (hashed once per process, :data:`_TRUSTED`). Anything else
    there (a copy with a file corrupt, truncated or gone; a folder or file left by something else) is moved aside and
    removed, with a warning naming what is wrong, so that a fresh download can take its place.

    Raises:
        dataplane.errors.IntegrityError: a damaged copy that could not be moved aside (the message names it and the
            fix).
    """
    if not target.exists() and not target.is_symlink():
        return False
    try:
        ino = target.lstat().st_ino
        raw = (target / CACHE_MANIFEST).read_bytes()
        if digest(raw) != key:
            msg = f"{target}: its {CACHE_MANIFEST} does not hash to {key}"
            raise IntegrityError(msg)
        doc = parse(raw, str(target))
        stats = _stats(target, doc["files"])
        if stats is None or _TRUSTED.get(str(target)) != (key, stats):
            verify_folder(target, doc, str(target))  # raises naming the first file that is missing or corrupt
            if stats is not None:
                _TRUSTED[str(target)] = (key, stats)
        return True
    except FileNotFoundError as err:
        if not target.exists() and not target.is_symlink():
            return False  # another process moved it aside meanwhile
        reason = f"{err.strerror}: {err.filename}"
    except (OSError, IntegrityError) as err:
        reason = str(err)
    print(
        f"[grpoflow] warning: the node cache's copy {target} is damaged or not a cached model ({reason}); moving it "
        "aside and downloading the model again",
        file=sys.stderr,
        flush=True,
    )
    try:
        trash = _move_aside(target)
    except OSError as err:
        msg = (
            f"the node cache's copy {target} is damaged or not a cached model ({reason}), and could not be moved "
            f"aside ({err}): delete {target}, or point ${CACHE_ENV} at a node-local folder this process can write, "
            "and retry"
        )
        raise IntegrityError(msg) from None
    if trash is not None and trash.lstat().st_ino != ino:  # a fresh copy renamed into place meanwhile: put it back
        try:
            trash.rename(target)
            return False
        except OSError:
            pass  # yet another copy is in place; the caller downloads and checks whatever it finds there
    if trash is not None:
        _remove(trash)
    return False
