"""`load_config_file`: the run's config from a YAML or JSON file at a URL (launching from the console with a file)."""

from __future__ import annotations

from flytekit import task

from rl.config import GRPOConfig
from tasks.placement import declared
from tasks.retry import transient_errors_retried


@task(retries=2, **declared("cpu"))
@transient_errors_retried
def load_config_file(url: str) -> GRPOConfig:
    """Read and validate the config at ``url`` (``s3://...``, any fsspec URL, or a local path).

    Raises:
        ValueError: the file does not exist, is not YAML or JSON, or holds an invalid config (naming the key).
    """
    from rl.config import load_config

    cfg = load_config(url)
    print(f"[grpoflow] config from {url}", flush=True)
    return cfg
