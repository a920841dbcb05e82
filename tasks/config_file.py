"""`load_config_file`: the run's config from a YAML or JSON file at a URL (launching from the console with a file)."""

from __future__ import annotations

from flytekit import task

from dataplane.urls import redact
from tasks.placement import declared
from tasks.retry import transient_errors_retried
from tasks.run_config import RunConfig, load_run_config


@task(retries=2, **declared("cpu"))
@transient_errors_retried
def load_config_file(url: str) -> RunConfig:
    """Read and validate the config at ``url`` (``s3://...``, any fsspec URL, or a local path).

    Raises:
        ValueError: the file does not exist, is not a regular file (a FIFO, a device), is larger than 1 MiB, is not
            YAML or JSON, or holds an invalid config (naming the key); as `rl.config.load_config`.
    """
    cfg = load_run_config(url)
    print(f"[grpoflow] config from {redact(url)}", flush=True)
    return cfg
