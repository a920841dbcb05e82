"""CPU driver image: setup, advantages, validation bookkeeping, finish (and the whole run on CPU)."""

from flytekit import ImageSpec

cpu_image = ImageSpec(
    name="grpoflow-cpu",
    python_version="3.11",
    packages=[
        "torch==2.13.0",
        "tensordict==0.15.3",
        "pyarrow==25.0.1",
        "s3fs==2026.9.0",
        "flytekit==1.16.31",
        "mlflow==3.17.2",
        "transformers==5.23.0",
        "gguf==0.19.0",
        "accelerate==1.15.0",
        "reasoning-gym",
        "matplotlib",
    ],
    pip_extra_index_url=["https://download.pytorch.org/whl/cpu"],
    source_root=".",
)
