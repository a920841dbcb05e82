"""GPU train image: logprob and train tasks with transformers or Megatron-core on CUDA."""

from flytekit import ImageSpec

train_gpu_image = ImageSpec(
    name="grpoflow-train-gpu",
    python_version="3.11",
    cuda="12.8",
    packages=[
        "torch==2.13.0",
        "megatron-core==0.16.0",
        "tensordict==0.15.3",
        "pyarrow==25.0.1",
        "s3fs==2026.9.0",
        "flytekit==1.16.31",
        "mlflow==3.17.2",
        "transformers==5.23.0",
        "reasoning-gym",
    ],
    source_root=".",
)
