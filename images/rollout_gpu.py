"""GPU rollout image: vLLM generation (vLLM pins its own torch and transformers, so it gets its own image)."""

from flytekit import ImageSpec

rollout_gpu_image = ImageSpec(
    name="grpoflow-rollout-gpu",
    python_version="3.12",
    cuda="12.8",
    packages=["vllm==0.33.0", "pyarrow==25.0.1", "s3fs==2026.9.0", "flytekit==1.16.31", "mlflow==3.17.2", "reasoning-gym"],
    source_root=".",
)
