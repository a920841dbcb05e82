"""A GRPO run whose S3 endpoint refuses every connection for 30 s mid-run completes, with every step's metrics
once and a complete, verified final checkpoint: each storage operation retries transient failures with backoff
(`dataplane.errors.retry_transient`) instead of failing its task.

The data plane and checkpoints live on a real S3 server on loopback (moto) reached through a TCP proxy
(`tests/tcp_proxy.py`) that is taken down (connects refused, open connections reset) once step 2 has started.
"""

from __future__ import annotations

import random
import threading
import time
from urllib.parse import urlparse

import pytest

from tests.helpers import metric_steps, small_config
from tests.tcp_proxy import TcpProxy

OUTAGE_S = 30.0


@pytest.mark.integration
@pytest.mark.slow
def test_run_completes_through_a_30s_s3_outage(tmp_path, tiny_model_dir, s3_server, capfd):
    import boto3
    import fsspec

    from rl import checkpoint
    from workflows.grpo import grpo

    endpoint = urlparse(s3_server)
    proxy = TcpProxy((endpoint.hostname, endpoint.port), seed=7)
    prefix = f"outage-{random.randrange(1 << 30)}"
    cfg = small_config(
        tmp_path,
        tiny_model_dir,
        grpo={"max_num_steps": 3, "val_period": 3},
        dataplane={"root": f"s3://grpoflow/{prefix}", "storage_options": {"endpoint_url": proxy.url}},
    )
    fsspec.filesystem("s3").clear_instance_cache()
    direct = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")  # the test's own view, not proxied
    outage: dict[str, float] = {}

    def take_down_during_step_2() -> None:
        deadline = time.time() + 600
        while time.time() < deadline:
            keys = direct.list_objects_v2(Bucket="grpoflow", Prefix=prefix).get("Contents", [])
            if any(k["Key"].endswith("step_000002/_schema.json") for k in keys):
                break
            time.sleep(0.05)
        outage["down"] = time.time()
        proxy.down()
        time.sleep(OUTAGE_S)
        proxy.up()
        outage["up"] = time.time()

    watcher = threading.Thread(target=take_down_during_step_2, daemon=True)
    watcher.start()
    try:
        summary = grpo(cfg=cfg)
    finally:
        watcher.join(timeout=OUTAGE_S + 60)
        proxy.close()

    assert outage["up"] - outage["down"] >= OUTAGE_S
    assert summary.final_step == 3
    for key in ("train/loss", "train/reward", "timing/train/total_step_time"):
        assert metric_steps(cfg.tracking.uri, summary.mlflow_run_id, key) == [1, 2, 3], key
    assert metric_steps(cfg.tracking.uri, summary.mlflow_run_id, "validation/accuracy") == [3]
    err = capfd.readouterr().err
    assert "transient" in err and "retrying in" in err  # the outage was met, and waited out
    proxy.up()
    try:  # the final checkpoint is complete and every file matches its manifest
        assert checkpoint.is_complete(summary.last_checkpoint, cfg.dataplane.storage_options)
        checkpoint.local_copy(summary.last_checkpoint, cfg.dataplane.storage_options, require_complete=True)
    finally:
        proxy.close()
