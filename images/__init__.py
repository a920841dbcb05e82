"""Container images, one per resource class (ImageSpec; built by `pyflyte run --remote` / `register`)."""

COMMON_PACKAGES = [
    "tensordict==0.15.3",
    "pyarrow==25.0.1",
    "s3fs==2026.9.0",
    "flytekit==1.16.31",
    "mlflow==3.17.2",
    "reasoning-gym",
]
"""Pins shared by every image: the data plane, orchestration and tracking stack."""
