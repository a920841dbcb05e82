"""scripts/wheelhouse.py offline: what goes in (the wanted closure less the target's), the split into parts, the
manifest, and a whole build with pip played by a fake (no network)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


wh = _load("wheelhouse")
wb = _load("wheelhouse_build")  # imports wheelhouse (from sys.modules)
ENV312 = wh.target_env("3.12", "manylinux_2_28_x86_64")


def test_have_lines_give_names_and_versions_without_local_labels():
    have = wh.parse_have(
        "# the image\ntorch==2.11.0+cu130\ntransformers==5.17.0  # pinned\nhuggingface_hub\n\nPyYAML\n"
    )
    assert have == {"torch": "2.11.0", "transformers": "5.17.0", "huggingface-hub": None, "pyyaml": None}


def test_constraint_pins_follow_the_target_python_and_yield_to_what_the_target_has():
    text = (REPO / "constraints.txt").read_text()
    pins = wh.constraint_pins(text, ENV312, skip={"torch", "transformers", "numpy"})
    assert "megatron-core==0.17.0" in pins and "megatron-core==0.16.1" not in pins
    assert "tensordict==0.15.3" in pins and "reasoning_gym==0.1.25" in pins
    assert not any(p.startswith(("torch", "transformers", "numpy")) for p in pins)
    pins311 = wh.constraint_pins(text, wh.target_env("3.11", "manylinux_2_28_x86_64"))
    assert "megatron-core==0.16.1" in pins311 and "megatron-core==0.17.0" not in pins311


def _resolved(spec: dict[str, list[str]]) -> dict:
    return {wh.normalize(n): wh.Resolved(wh.normalize(n), "1.0", reqs) for n, reqs in spec.items()}


def test_the_selection_is_the_wanted_closure_less_the_target_closure_and_never_torch():
    resolved = _resolved(
        {
            "megatron-core": ["torch>=2.6", "numpy", "packaging>=24.2", "wandb; extra == 'mlm'"],
            "tensordict": ["torch", "cloudpickle", "pyvers<0.3", "typing_extensions; python_version < '3.11'"],
            "reasoning-gym": ["cellpylib==2.4.0", "pyyaml", "zss"],
            "cellpylib": ["matplotlib>=3", "numpy"],
            "matplotlib": ["pillow", "python-dateutil", "numpy"],
            "zss": ["six"],
            "torch": ["filelock", "typing-extensions", "nvidia-cublas; platform_system == 'Linux'", "triton"],
            "transformers": ["huggingface-hub", "packaging", "pyyaml"],
            "huggingface-hub": ["filelock"],
            "pandas": ["python-dateutil", "numpy"],
            **{
                n: []
                for n in (
                    "numpy",
                    "packaging",
                    "cloudpickle",
                    "pyvers",
                    "pyyaml",
                    "pillow",
                    "python-dateutil",
                    "six",
                    "filelock",
                    "typing-extensions",
                    "nvidia-cublas",
                    "triton",
                    "wandb",
                    "unrelated",
                )
            },
        }
    )
    have = {"torch": "2.11.0", "transformers": "5.17.0", "numpy": None, "pandas": None}
    want = {"megatron-core": set(), "tensordict": set(), "reasoning-gym": set()}
    sel = wh.select(resolved, want, have, ENV312)
    assert [r.name for r in sel.keep] == [
        "cellpylib",
        "cloudpickle",
        "matplotlib",
        "megatron-core",
        "pillow",
        "pyvers",
        "reasoning-gym",
        "six",
        "tensordict",
        "zss",
    ]
    # needed, but on the target with torch, transformers and pandas (their dependencies included)
    assert sel.have == [
        "filelock",
        "numpy",
        "nvidia-cublas",
        "packaging",
        "python-dateutil",
        "pyyaml",
        "torch",
        "triton",
        "typing-extensions",
    ]
    assert sel.never == [] and sel.missing == []


def test_torch_and_cuda_wheels_are_never_selected_even_when_the_target_lacks_them():
    resolved = _resolved(
        {"a": ["torch", "nvidia-nccl-cu13", "triton", "b"], "torch": [], "nvidia-nccl-cu13": [], "triton": [], "b": []}
    )
    sel = wh.select(resolved, {"a": set()}, {}, ENV312)
    assert [r.name for r in sel.keep] == ["a", "b"]
    assert sel.never == ["nvidia-nccl-cu13", "torch", "triton"]


def test_a_dependency_the_target_python_needs_but_the_resolution_lacks_is_reported():
    # resolved with a Python 3.11 pip: a python_version >= '3.12' dependency was never resolved
    resolved = _resolved({"a": ["b; python_version >= '3.12'", "c; python_version < '3.12'"], "c": []})
    sel = wh.select(resolved, {"a": set()}, {}, ENV312)
    assert sel.missing == ["b"]
    assert [r.name for r in sel.keep] == ["a"]  # c is not needed on 3.12


@pytest.mark.parametrize("max_mb", [10, 25, 60])
def test_parts_hold_at_most_n_mb_and_every_file_once(max_mb):
    units = [
        (f"w{i}.whl", size)
        for i, size in enumerate(
            [9_900_000, 7_140_000, 5_440_000, 1_730_000, 850_000, 3_520_000, 80_000, 10_000, 9_000_000]
        )
    ]
    parts, warnings = wh.split_parts(units, max_mb * wh.MB)
    assert warnings == []
    assert all(p.size <= max_mb * wh.MB for p in parts)
    assert sorted(u for p in parts for u in p.units) == sorted(units)
    assert len(parts) == {10: 4, 25: 2, 60: 1}[max_mb]  # first fit, largest first: 9.99 + 9.85 + 8.87 + 8.96 MB at 10


def test_a_file_larger_than_n_gets_a_part_of_its_own_and_a_warning():
    units = [("big.whl", 12_000_000), ("a.whl", 4_000_000), ("b.whl", 3_000_000), ("c.whl", 2_500_000)]
    parts, warnings = wh.split_parts(units, 5 * wh.MB)
    assert [[n for n, _ in p.units] for p in parts] == [["big.whl"], ["a.whl"], ["b.whl"], ["c.whl"]]
    assert len(warnings) == 1 and "big.whl" in warnings[0] and "12.0 MB" in warnings[0]
    parts, _ = wh.split_parts(units, 6 * wh.MB)
    assert [[n for n, _ in p.units] for p in parts] == [["big.whl"], ["a.whl"], ["b.whl", "c.whl"]]


def test_platform_tags_take_every_older_manylinux_and_local_builds():
    tags = wb.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert "manylinux_2_29_x86_64" not in tags and tags[-1] == "linux_x86_64"


def _wheel(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def test_a_wheel_built_here_must_be_pure_or_for_the_target_python_and_glibc(tmp_path):
    ok = dict(python="3.12", platform="manylinux_2_28_x86_64")
    assert wb.built_wheel_problem(_wheel(tmp_path / "cellpylib-2.4.0-py3-none-any.whl", {"x.py": b""}), **ok) is None
    old = _wheel(
        tmp_path / "pycosat-0.6.6-cp312-cp312-linux_x86_64.whl", {"pycosat.so": b"\0GLIBC_2.2.5\0GLIBC_2.14\0"}
    )
    assert wb.glibc_needed(old) == (2, 14) and wb.built_wheel_problem(old, **ok) is None
    new = _wheel(tmp_path / "p-1-cp312-cp312-linux_x86_64.whl", {"p.cpython-312-x86_64-linux-gnu.so": b"GLIBC_2.34\0"})
    assert "glibc 2.34" in wb.built_wheel_problem(new, **ok)
    other = _wheel(tmp_path / "p-1-cp311-cp311-linux_x86_64.whl", {"p.so": b""})
    assert "--resolver-python" in wb.built_wheel_problem(other, **ok)


def test_the_manifest_lists_every_file_and_verify_finds_a_damaged_or_missing_one(tmp_path):
    (tmp_path / "part-1" / "tokenizer").mkdir(parents=True)
    (tmp_path / "part-2").mkdir()
    (tmp_path / "part-1" / "a-1.0-py3-none-any.whl").write_bytes(b"a" * 100)
    (tmp_path / "part-2" / "b-1.0-py3-none-any.whl").write_bytes(b"b" * 50)
    (tmp_path / "part-1" / "tokenizer" / "tokenizer_config.json").write_text("{}")
    rows = wh.write_manifest(tmp_path, ["test"])
    assert [r[0] for r in rows] == [
        "part-1/a-1.0-py3-none-any.whl",
        "part-1/tokenizer/tokenizer_config.json",
        "part-2/b-1.0-py3-none-any.whl",
    ]
    assert wh.read_manifest(tmp_path) == rows and wh.verify(tmp_path) == []
    assert [p.name for p in wh.wheels(tmp_path)] == ["a-1.0-py3-none-any.whl", "b-1.0-py3-none-any.whl"]
    assert wh.find_tokenizer(tmp_path) == tmp_path / "part-1" / "tokenizer"
    (tmp_path / "part-1" / "a-1.0-py3-none-any.whl").write_bytes(b"A" * 100)
    (tmp_path / "part-2" / "b-1.0-py3-none-any.whl").unlink()
    assert wh.verify(tmp_path) == [
        "sha256: part-1/a-1.0-py3-none-any.whl differs from the manifest",
        "missing: part-2/b-1.0-py3-none-any.whl",
    ]


class FakePip:
    """Plays pip for ``wheelhouse.build``: a dry-run report, ``pip wheel`` of the one source-only package, downloads."""

    def __init__(self, metadata: dict[str, list[str]], sizes: dict[str, int], sdist_only: set[str]):
        self.metadata, self.sizes, self.sdist_only, self.calls = metadata, sizes, sdist_only, []

    def __call__(self, cmd, **kw):
        self.calls.append(cmd)
        if "-c" in cmd and cmd[cmd.index("-c") + 1].startswith("import sys; from rl.model"):  # the tokenizer
            target = Path(cmd[-1])
            target.mkdir(parents=True)
            (target / "tokenizer_config.json").write_text("{}")
            (target / "tokenizer.json").write_bytes(b"t" * 3_000_000)
            return subprocess.CompletedProcess(cmd, 0, "", "")
        sub = cmd[cmd.index("pip") + 1]
        links = Path(cmd[cmd.index("--find-links") + 1]) if "--find-links" in cmd else None
        if sub == "install":
            built = {p.name.split("-")[0] for p in links.glob("*.whl")}
            todo = self.sdist_only - built
            if todo:
                return subprocess.CompletedProcess(
                    cmd, 1, "", f"ERROR: No matching distribution found for {sorted(todo)[0]}==2.4.0\n"
                )
            report = {
                "install": [
                    {
                        "metadata": {"name": n, "version": "1.0", "requires_dist": reqs},
                        "download_info": {
                            "url": (links / f"{n}-1.0-py3-none-any.whl").as_uri()
                            if n in self.sdist_only
                            else f"https://x/{n}.whl"
                        },
                    }
                    for n, reqs in self.metadata.items()
                ]
            }
            Path(cmd[cmd.index("--report") + 1]).write_text(json.dumps(report))
        elif sub == "wheel":
            name = cmd[-1].split("==")[0]
            _wheel(
                Path(cmd[cmd.index("-w") + 1]) / f"{name}-1.0-py3-none-any.whl", {f"{name}.py": b"x" * self.sizes[name]}
            )
        elif sub == "download":
            dest = Path(cmd[cmd.index("-d") + 1])
            for req in cmd[cmd.index("manylinux_2_28_x86_64") :]:
                if "==" in req:
                    name = req.split("==")[0]
                    (dest / f"{name}-1.0-py3-none-any.whl").write_bytes(b"w" * self.sizes[name])
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_a_build_with_a_fake_pip_selects_builds_splits_and_lists(tmp_path, monkeypatch, capsys):
    metadata = {
        "megatron-core": ["torch", "numpy"],
        "reasoning-gym": ["cellpylib==2.4.0", "pytz"],
        "cellpylib": ["numpy"],
        "pytz": [],
        "torch": ["nvidia-cublas"],
        "nvidia-cublas": [],
        "numpy": [],
    }
    sizes = {"megatron-core": 1_700_000, "reasoning-gym": 7_000_000, "cellpylib": 40_000, "pytz": 500_000}
    fake = FakePip(metadata, sizes, {"cellpylib"})
    monkeypatch.setattr(wb, "_run", fake)
    (tmp_path / "have.txt").write_text("torch==2.11.0\nnumpy\n")
    (tmp_path / "constraints.txt").write_text("torch==2.13.0\nreasoning_gym==0.1.25\n")
    out = tmp_path / "wh"
    (out / "part-9").mkdir(parents=True)  # left from an earlier build: removed
    wb.main(
        [
            "--out",
            str(out),
            "--have",
            str(tmp_path / "have.txt"),
            "--constraints",
            str(tmp_path / "constraints.txt"),
            "--split-mb",
            "5",
            "--resolver-python",
            "py",
            "--tokenizer-python",
            "py",
            "megatron-core",
            "reasoning-gym",
        ]
    )
    resolve = fake.calls[0]
    assert "torch==2.11.0" in resolve and "numpy" in resolve  # the target's packages resolved, to know their closure
    assert Path(resolve[resolve.index("-c") + 1]).name == "constraints.txt"
    assert any(c[c.index("pip") + 1] == "wheel" and c[-1] == "cellpylib==2.4.0" for c in fake.calls if "pip" in c)
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert sorted(f.split("/", 1)[1] for f in files if f != "MANIFEST.txt") == [
        "cellpylib-1.0-py3-none-any.whl",
        "megatron-core-1.0-py3-none-any.whl",
        "pytz-1.0-py3-none-any.whl",
        "reasoning-gym-1.0-py3-none-any.whl",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
    ]
    assert not (out / "part-9").exists() and not (out / ".staging").exists()
    part_files = {part.name: sorted(p.name for p in part.rglob("*") if p.is_file()) for part in out.glob("part-*")}
    assert part_files == {  # 7 MB alone (with a warning), then first fit, largest first, in 5 MB
        "part-1": ["reasoning-gym-1.0-py3-none-any.whl"],
        "part-2": [
            "cellpylib-1.0-py3-none-any.whl",
            "megatron-core-1.0-py3-none-any.whl",
            "tokenizer.json",
            "tokenizer_config.json",
        ],
        "part-3": ["pytz-1.0-py3-none-any.whl"],
    }
    printed = capsys.readouterr()
    assert "reasoning-gym-1.0-py3-none-any.whl is 7.0 MB" in printed.err
    assert "total 12.2 MB: 4 wheels and the tokenizer, 6 files" in printed.out
    manifest = (out / "MANIFEST.txt").read_text()
    assert (
        "left out, the target has them: numpy nvidia-cublas torch" in manifest
        and "pins: reasoning_gym==0.1.25" in manifest
    )
    assert wh.verify(out) == []


def test_the_listing_prints_each_wheel_each_part_and_the_total(tmp_path, capsys):
    (tmp_path / "part-1" / "tokenizer").mkdir(parents=True)
    (tmp_path / "part-1" / "a-1.0-py3-none-any.whl").write_bytes(b"a" * 2_000_000)
    (tmp_path / "part-1" / "tokenizer" / "tokenizer.json").write_bytes(b"t" * 1_500_000)
    rows = wh.write_manifest(tmp_path, [])
    wb.print_listing(tmp_path, rows)
    text = capsys.readouterr().out
    assert "    2.00 MB  part-1/a-1.0-py3-none-any.whl" in text
    assert "    1.50 MB  part-1/tokenizer/" in text and "    3.50 MB  part-1/ in all" in text
    assert "total 3.5 MB: 1 wheels and the tokenizer" in text
