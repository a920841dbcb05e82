"""The SHA-256 manifest of a folder's files, as a checkpoint's and a published model's ``_COMPLETE`` marker holds it:
computing it, reading and parsing a marker, and checking a folder (local, or on any fsspec filesystem) against it.

A manifest is canonical JSON (sorted keys, one-space indent), ``{"format": MANIFEST_FORMAT, "algorithm": "sha256",
"files": {relative_path: {"size": int, "sha256": hex}}}``; relative paths are POSIX, with no ``.``, ``..``, empty or
absolute parts, and never the marker itself. The same files give the same bytes, so the SHA-256 of a manifest
addresses a folder's content (`rl.model_store`). A marker is written after every file it lists (`rl.checkpoint`,
`rl.model_store`); a folder without one is not trusted.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import fsspec

from dataplane.errors import IntegrityError, retry_transient

COMPLETE = "_COMPLETE"
"""The marker file: the manifest of every other file of its folder, written last."""
MANIFEST_FORMAT = "grpoflow-checkpoint/1"
HASH = "sha256"
"""The manifest's digest: on this project's machines (x86 with SHA extensions, OpenSSL 3) sha256 hashes ~1.1 GB/s,
about twice blake2b's rate, i.e. ~0.5 s for a 540 MB ``model.safetensors``."""
_CHUNK = 1 << 20


def filesystem(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str, bool]:
    """``(filesystem, path without trailing slash, whether it is the local filesystem)`` of ``url`` (an fsspec URL or
    a local path), with fsspec's listings cache off: another process may have saved or pruned since this one listed
    (as the data plane's client)."""
    fs, path = fsspec.core.url_to_fs(url, **{"use_listings_cache": False, **(storage_options or {})})
    path = path.rstrip("/")
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return fs, path, "file" in protocols or "local" in protocols


def stream_digest(fileobj: Any) -> str:
    """The :data:`HASH` hex digest of what ``fileobj`` (a binary file object) has left to read, read in 1 MiB
    chunks."""
    h = hashlib.new(HASH)
    while chunk := fileobj.read(_CHUNK):
        h.update(chunk)
    return h.hexdigest()


def file_digest(path: Path) -> str:
    """The :data:`HASH` hex digest of the local file ``path``."""
    with open(path, "rb") as f:
        return stream_digest(f)


def encode(files: Mapping[str, Path]) -> bytes:
    """The manifest of ``files`` (relative POSIX path -> local file), as a marker's bytes: each file's size and
    :data:`HASH`, read once, in the order given."""
    entries = {rel: {"size": p.stat().st_size, HASH: file_digest(p)} for rel, p in files.items()}
    doc = {"format": MANIFEST_FORMAT, "algorithm": HASH, "files": entries}
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def folder_manifest(folder: Path) -> bytes:
    """The manifest of every file under the local ``folder`` but its :data:`COMPLETE` marker, as the marker's bytes."""
    files = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel != COMPLETE:
            files[rel] = p
    return encode(files)


def _safe_rel(rel: Any) -> bool:
    if not isinstance(rel, str) or not rel or "\\" in rel or rel == COMPLETE:
        return False
    p = PurePosixPath(rel)
    return not p.is_absolute() and all(part not in ("", ".", "..") for part in rel.split("/"))


def parse(raw: bytes, where: str) -> dict[str, Any]:
    """The manifest in a marker's bytes; ``where`` (``"checkpoint {url}"``) starts every error message.

    Raises:
        IntegrityError: the marker is empty (a checkpoint written before grpoflow recorded manifests), not JSON, or
            not a manifest (no file list, another digest, or an entry without an int size and a string digest, or
            with an unsafe relative path).
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


def read_marker(fs: Any, path: str, where: str) -> bytes | None:
    """The bytes of the :data:`COMPLETE` marker of the folder ``path`` on ``fs`` (retried on transient failures, as
    ``"{where}: read _COMPLETE"``), or None when it has none.

    Raises:
        storage errors: permanent, or transient past the retry deadline.
    """
    try:
        return retry_transient(lambda: fs.cat_file(f"{path}/{COMPLETE}"), what=f"{where}: read {COMPLETE}")
    except FileNotFoundError:
        return None


def mismatch(where: str, rel: str, entry: dict[str, Any], size: int | None, actual: str | None) -> IntegrityError:
    """The error for the file ``rel`` that its manifest ``entry`` does not describe: missing (``size`` None), or of
    ``size`` bytes and digest ``actual``."""
    expected = f"expected {entry['size']} bytes, {HASH} {entry[HASH]}"
    if size is None:
        return IntegrityError(f"{where}: {rel} is missing ({expected})")
    return IntegrityError(f"{where}: {rel} is corrupt: {size} bytes, {HASH} {actual}; {expected}")


_VERIFIED: dict[tuple[str, int, int, int, int], str] = {}
"""Local files this process has hashed, by ``(path, size, mtime_ns, ctime_ns, inode)``: a second cold load of an
unchanged file (a resume verifies the checkpoint, then the trainer and the generator load it) skips the hashing.
Any write, rename-over or metadata change moves ``ctime``, which no writer can set back."""


def verify_folder(folder: Path, manifest: dict[str, Any], where: str) -> None:
    """Check every file ``manifest`` (as :func:`parse` returns it) lists under the local ``folder``: present, of its
    size and :data:`HASH`. A file this process already checked and that has not changed since (by size, mtime,
    ctime and inode) is not hashed again.

    Raises:
        IntegrityError: a file missing, or of another size or digest (:func:`mismatch`).
    """
    for rel, entry in manifest["files"].items():
        p = folder / rel
        try:
            st = p.stat()
        except (FileNotFoundError, NotADirectoryError):
            raise mismatch(where, rel, entry, None, None) from None
        key = (str(p.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        if st.st_size == entry["size"] and _VERIFIED.get(key) == entry[HASH]:
            continue
        actual = file_digest(p)
        if st.st_size != entry["size"] or actual != entry[HASH]:
            raise mismatch(where, rel, entry, st.st_size, actual)
        if len(_VERIFIED) > 4096:
            _VERIFIED.clear()
        _VERIFIED[key] = actual


def verify_remote(fs: Any, path: str, manifest: dict[str, Any], where: str) -> None:
    """:func:`verify_folder` for the folder ``path`` on the filesystem ``fs``: each file hashed as it streams
    (nothing written to disk), each read retried on transient failures.

    Raises:
        IntegrityError: a file missing, or of another size or digest (:func:`mismatch`).
        storage errors: permanent, or transient past the retry deadline.
    """
    for rel, entry in manifest["files"].items():
        obj = f"{path}/{rel}"

        def read(o: str = obj) -> tuple[int, str]:
            with fs.open(o, "rb") as f:
                return f.size, stream_digest(f)

        try:
            size, actual = retry_transient(read, what=f"{where}: hash {rel}")
        except FileNotFoundError:
            raise mismatch(where, rel, entry, None, None) from None
        if size != entry["size"] or actual != entry[HASH]:
            raise mismatch(where, rel, entry, size, actual)
