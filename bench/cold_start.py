"""What a GRPO step costs on Flyte, where every task is a fresh pod: measured at 135M, projected to 1B and 8B.

    python -m bench.cold_start [--steps 2] [--rate 1.0] [--steps-per-task 16] [--engine-start 30]
                               [--out bench/results/cold_start.md]

1. The same default config (the real SmolLM2-135M-Instruct, 8 x 8 x 32, float32) runs ``--steps`` steps three
   times, on a data plane and checkpoint store on a real S3 server on loopback (moto) with a sqlite MLflow store:
   - warm: the local executor, one process (what ``pyflyte run`` does on a laptop);
   - cold: the *serialized* workflow, every task a fresh process running its own ``pyflyte-execute`` command
     (``tests/flyte_pods.py``, as a pod does), sharing only S3 and MLflow;
   - cold with every step in one task (``resources.steps_per_task`` = ``--steps``): one fresh process for the steps.
   Reported per task: ``timing/<task>/startup`` (process start to first useful work: interpreter, imports, input
   download, model and optimizer loads), and each pod's wall time; per step, cold minus warm step time.
2. Load bandwidth of what those startups move: a safetensors file of the 135M model read and parsed from local
   disk and downloaded from the loopback S3 server, and uploaded to it.
3. Projection to 1B and 8B (:data:`PLANS`): per step, fixed (import) overhead plus bytes moved / bandwidth, at the
   local disk's measured rates and at a stated object-store rate (``--rate`` GB/s per pod).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TASKS = ("rollout", "reference_logprobs", "advantages", "train")


def _config(root: str, so: dict, uri: str, steps: int, model: str, steps_per_task: int = 1):
    from tasks.run_config import run_config_from_dict

    return run_config_from_dict(
        {
            "model": {"name": model, "precision": "float32"},
            "grpo": {"max_num_steps": steps, "val_period": 0},
            "dataplane": {"root": root, "storage_options": so},
            "tracking": {"uri": uri, "experiment_name": "cold_start"},
            "resources": {"steps_per_task": steps_per_task},
        }
    )


def _metrics(uri: str, run_id: str) -> dict[str, list[float]]:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(uri)
    keys = [f"timing/{t}/startup" for t in (*TASKS, "start_run")] + ["timing/train/total_step_time"]
    return {k: [m.value for m in sorted(c.get_metric_history(run_id, k), key=lambda m: m.step)] for k in keys}


def _bandwidth(model_dir: str, so: dict) -> dict[str, float]:
    import fsspec
    from safetensors.torch import load_file

    src = next(Path(model_dir).glob("*.safetensors"))
    size = src.stat().st_size
    out = {"bytes": size}
    with tempfile.TemporaryDirectory(dir=Path.home()) as d:  # a fresh file on disk, dropped from the page cache
        copy = Path(d) / "m.safetensors"
        t0 = time.perf_counter()
        with open(src, "rb") as f, open(copy, "wb") as g:
            while chunk := f.read(64 << 20):
                g.write(chunk)
            g.flush()
            os.fsync(g.fileno())
        out["local write GB/s"] = size / (time.perf_counter() - t0) / 1e9
        fd = os.open(copy, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        t0 = time.perf_counter()
        load_file(str(copy))
        out["local read+parse GB/s"] = size / (time.perf_counter() - t0) / 1e9
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **so)
    key = f"grpoflow/bandwidth-{random.randrange(1 << 30)}/model.safetensors"
    t0 = time.perf_counter()
    fs.put_file(str(src), key)
    out["S3 upload GB/s"] = size / (time.perf_counter() - t0) / 1e9
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        fs.get_file(key, f"{d}/m.safetensors")
        load_file(f"{d}/m.safetensors")
        out["S3 download+parse GB/s"] = size / (time.perf_counter() - t0) / 1e9
    return out


MODELS = (("135M", 135e6), ("1B", 1.0e9), ("8B", 8.0e9))

PLANS = {
    "one task per step, as landed": {"load": 7.0, "save": 3.0, "per_k": False},
    "one task per step, now": {"load": 3.5, "save": 3.5, "per_k": False},
    "K steps per task": {"load": 3.0, "save": 3.0, "per_k": True},
}
"""Bytes a step moves through storage, in units of W (the float32 weights, 4 B/param; optimizer state 2W; the bf16
serving copy W/2), per plan:

- as landed: rollout loaded the whole checkpoint, optimizer state included (3W), reference W, train 3W; the train
  task saved weights and optimizer state (3W).
- now (one task per step): rollout loads the bf16 copy (W/2: ``checkpoint.local_copy(dtype="bfloat16")``), the
  reference model comes from the node's model cache (0 after a node's first step), train loads 3W; train saves 3W
  plus the bf16 copy (W/2).
- K steps per task (``resources.steps_per_task`` = K): the task loads 3W when it starts and saves 3W when it ends
  (the next task's trainer state); the steps between save nothing but the checkpoints that are due
  (``checkpointing.checkpoint_period``: 3W each, not counted here); its fixed costs (imports, engine start-up) come
  once per K steps.
"""


def _projection(fixed: float, bw: dict[str, float], rate: float, k: int, engine_start: float) -> list[str]:
    """The projection table: seconds of storage and fixed start-up per step, per plan and model size, at the
    measured local-disk rates and at ``rate`` GB/s per pod (an object store). The fixed part is ``fixed`` seconds per
    task started (interpreter, imports, inputs) plus ``engine_start`` seconds per task that starts a generation engine:
    every step's rollout task with a task per step; once per K steps (one task, ``fixed + engine_start``) else."""
    tasks = len(TASKS)
    out = [
        f"## Projection per step (W = float32 weights, 4 B/param; optimizer state 2W; bf16 copy W/2; K = {k})",
        "",
        f"Fixed part: {tasks} tasks x {fixed:.1f} s per step (the advantages task's startup: interpreter, imports, "
        f"inputs; no model) plus a generation engine's cold start ({engine_start:.0f} s, stated: vLLM's ~30 s) for "
        f"the rollout task; one task's {fixed:.1f} + {engine_start:.0f} s per K steps with K steps per task. Storage "
        f"at {rate:g} GB/s per pod (an object store; stated, not measured) and at this machine's local disk "
        f"(read+parse {bw['local read+parse GB/s']:.2f}, write {bw['local write GB/s']:.2f} GB/s). Bytes per step, in "
        "W: as landed 7W loaded + 3W saved; now 3.5W + 3.5W; K steps per task (3W + 3W)/K, plus the checkpoints due. "
        "Seconds per step:",
        "",
        "| model | W (GB) | plan | storage, object store | **per step, object store** | storage, local disk | per "
        "step, local disk |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, params in MODELS:
        w = 4 * params / 1e9
        for plan, b in PLANS.items():
            div = k if b["per_k"] else 1
            load, save = b["load"] * w / div, b["save"] * w / div
            f = (fixed + engine_start) / k if b["per_k"] else tasks * fixed + engine_start
            store = (load + save) / rate
            disk = load / bw["local read+parse GB/s"] + save / bw["local write GB/s"]
            out.append(
                f"| {name} | {w:.1f} | {plan} | {store:.1f} | **{f + store:.1f}** | {disk:.1f} | {f + disk:.1f} |"
            )
    out += [
        "",
        f"Measured on the loopback S3 server (moto, one Python process: {bw['S3 download+parse GB/s']:.2f} GB/s down, "
        f"{bw['S3 upload GB/s']:.2f} GB/s up), the 135M step above. A real cluster adds pod scheduling, image pulls "
        "(cached per node after the first) to every task of the one-task-per-step plans, once per K steps to the "
        "other.",
    ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="bench/results/cold_start.md")
    parser.add_argument(
        "--rate", type=float, default=1.0, help="object-store GB/s per pod for the projection (stated, not measured)"
    )
    parser.add_argument("--steps-per-task", type=int, default=16, help="K of the K-steps-per-task projection")
    parser.add_argument(
        "--engine-start", type=float, default=30.0, help="seconds a generation engine takes to start cold (stated)"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

    import boto3
    import fsspec
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.admin.workflow import WorkflowSpec
    from flytekit.models.task import TaskSpec
    from moto.server import ThreadedMotoServer

    from rl.model import cache_dir, resolve_model
    from tasks.run_config import RunConfig
    from tasks.types import RunSummary
    from tests.flyte_pods import Pods
    from workflows.grpo import grpo
    from workflows.registration import fake_images, serialize, settings

    port = random.randrange(20000, 40000)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="grpoflow")
    so = {"endpoint_url": endpoint}
    model = resolve_model("SmolLM2-135M-Instruct")
    work = Path(tempfile.mkdtemp(prefix="cold_start-"))
    uri = f"sqlite:///{work}/mlflow.db"
    threads = os.environ.get("GRPOFLOW_NUM_THREADS", "2")

    with fake_images():  # before the warm run: a run leaves its compiled step loop among flytekit's entities
        entities = serialize(settings())

    # warm: one process
    fsspec.filesystem("s3").clear_instance_cache()
    t0 = time.time()
    warm = grpo(cfg=_config("s3://grpoflow/warm", so, uri, args.steps, model))
    warm_wall = time.time() - t0
    warm_m = _metrics(uri, warm.mlflow_run_id)

    # cold: every task a fresh process; then every step in one task (resources.steps_per_task = steps)
    tasks = {e.template.id.name: e.template for e in entities if isinstance(e, TaskSpec)}
    (spec,) = [e for e in entities if isinstance(e, WorkflowSpec) and e.template.id.name == "workflows.grpo.grpo"]
    ctx = FlyteContextManager.current_context()

    def cold_run(root: str, steps_per_task: int) -> tuple[dict[str, list[float]], float, Any]:
        cfg = _config(root, so, uri, args.steps, model, steps_per_task)
        inputs = {"cfg": TypeEngine.to_literal(ctx, cfg, RunConfig, TypeEngine.to_literal_type(RunConfig))}
        # one node: the pods share its model cache (the first to load the published base model downloads it) and the
        # cache where start_run finds the converted default model
        node = {"GRPOFLOW_CACHE": str(cache_dir()), "GRPOFLOW_MODEL_CACHE": str(work / f"node-cache-{steps_per_task}")}
        pods = Pods(
            work / f"cluster-{steps_per_task}",
            execution=f"bench{random.randrange(1 << 30):x}",
            env={"GRPOFLOW_NUM_THREADS": threads, **node},
        )
        t0 = time.time()
        out = pods.run_workflow(spec, tasks, inputs)
        wall = time.time() - t0
        return _metrics(uri, TypeEngine.to_python_value(ctx, out["o0"], RunSummary).mlflow_run_id), wall, pods

    cold_m, cold_wall, pods = cold_run("s3://grpoflow/cold", 1)
    whole_m, whole_wall, whole_pods = cold_run("s3://grpoflow/cold-k", args.steps)
    bw = _bandwidth(model, so)
    server.stop()

    lines = [
        "# Cold tasks: what a step costs when every task is a fresh pod",
        "",
        f"Command: `python -m bench.cold_start --steps {args.steps}`; {platform.machine()}, {os.cpu_count()} cores, "
        f"{threads} torch threads, {time.strftime('%Y-%m-%d %H:%M')}. Real SmolLM2-135M-Instruct, float32, the default "
        "8 x 8 x 32 step, data plane and checkpoints on a loopback S3 server (moto), sqlite MLflow.",
        "",
        "## Startup per task (process start to first useful work), seconds, per step",
        "",
        "| task | warm (one process) | cold (fresh process) |",
        "|---|---|---|",
    ]
    for t in TASKS:
        k = f"timing/{t}/startup"
        lines.append(
            f"| {t} | {', '.join(f'{v:.1f}' for v in warm_m[k])} | {', '.join(f'{v:.1f}' for v in cold_m[k])} |"
        )
    lines += [
        f"| start_run | {warm_m['timing/start_run/startup'][0]:.1f} | {cold_m['timing/start_run/startup'][0]:.1f} |",
        "",
    ]
    ws, cs, ks = (m["timing/train/total_step_time"] for m in (warm_m, cold_m, whole_m))
    per_step_startup = [sum(cold_m[f"timing/{t}/startup"][i] for t in TASKS) for i in range(args.steps)]
    lines += [
        "## Step time (rollout start to train end), seconds",
        "",
        f"- warm: {', '.join(f'{v:.1f}' for v in ws)}; cold, a pod per task: {', '.join(f'{v:.1f}' for v in cs)}; "
        f"cold, {args.steps} steps in one pod (`resources.steps_per_task: {args.steps}`): "
        f"{', '.join(f'{v:.1f}' for v in ks)}",
        f"- cold minus warm, median over steps: **{statistics.median(c - w for c, w in zip(cs, ws)):.1f} s**; sum of "
        f"the step's cold startups: {', '.join(f'{v:.1f}' for v in per_step_startup)} s (the tasks of a step run one "
        "after another here; on a cluster the two logprob tasks and advantages run side by side)",
        "- steps in one pod minus warm, median over steps: "
        f"**{statistics.median(k - w for k, w in zip(ks, ws)):.1f} s**",
        f"- whole run wall: warm {warm_wall:.0f} s, cold {cold_wall:.0f} s ({len(pods.pods)} pods), steps in one pod "
        f"{whole_wall:.0f} s ({len(whole_pods.pods)} pods)",
        "",
        "Pods (wall seconds): "
        + ", ".join(
            f"{p.node.split('-', 2)[-1] if p.node.startswith('n1-') else p.task.rsplit('.', 1)[-1]} {p.seconds:.1f}"
            for p in pods.pods
        ),
        "",
        "## Load bandwidth",
        "",
        f"- model file {bw['bytes'] / 1e6:.0f} MB: local disk read+parse {bw['local read+parse GB/s']:.2f} GB/s "
        f"(dropped from the page cache first), write+fsync {bw['local write GB/s']:.2f} GB/s; loopback S3 (moto, a "
        f"Python server) download+parse {bw['S3 download+parse GB/s']:.2f} GB/s, upload {bw['S3 upload GB/s']:.2f} "
        "GB/s",
        "",
    ]
    fixed = statistics.median(cold_m["timing/advantages/startup"])  # imports + input download, no model
    lines += _projection(fixed, bw, args.rate, args.steps_per_task, args.engine_start)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
