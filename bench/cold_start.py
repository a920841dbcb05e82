"""What a GRPO step costs on Flyte, where every task is a fresh pod: measured at 135M, projected to 1B and 8B.

    python -m bench.cold_start [--steps 2] [--out bench/results/cold_start.md]

1. The same default config (the real SmolLM2-135M-Instruct, 8 x 8 x 32, float32) runs ``--steps`` steps twice, on a
   data plane and checkpoint store on a real S3 server on loopback (moto) with a sqlite MLflow store:
   - warm: the local executor, one process (what ``pyflyte run`` does on a laptop);
   - cold: the *serialized* workflow, every task a fresh process running its own ``pyflyte-execute`` command
     (``tests/flyte_pods.py``, as a pod does), sharing only S3 and MLflow.
   Reported per task: ``timing/<task>/startup`` (process start to first useful work: interpreter, imports, input
   download, model and optimizer loads), and each pod's wall time; per step, cold minus warm step time.
2. Load bandwidth of what those startups move: a safetensors file of the 135M model read and parsed from local
   disk (page cache warm: the best case of a node that already pulled it) and downloaded from the loopback S3
   server, and uploaded to it.
3. Projection to 1B and 8B: per step, fixed (import) overhead plus bytes moved / bandwidth, where the bytes are what
   the tasks of a step load and save (float32 weights W = 4 B/param, AdamW state 2W): rollout loads W, the
   reference-logprob task W, train loads W + 2W and saves the 2W a warm run keeps in memory; an off-policy step adds a
   policy-logprob load W.
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

REPO = Path(__file__).resolve().parents[1]
TASKS = ("rollout", "reference_logprobs", "advantages", "train")


def _config(root: str, so: dict, uri: str, steps: int, model: str):
    from rl.config import config_from_dict

    return config_from_dict({
        "model": {"name": model, "precision": "float32"},
        "grpo": {"max_num_steps": steps, "val_period": 0},
        "dataplane": {"root": root, "storage_options": so},
        "tracking": {"uri": uri, "experiment_name": "cold_start"},
    })


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="bench/results/cold_start.md")
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

    from rl.config import GRPOConfig
    from rl.model import resolve_model
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

    # cold: every task a fresh process
    cfg = _config("s3://grpoflow/cold", so, uri, args.steps, model)
    tasks = {e.template.id.name: e.template for e in entities if isinstance(e, TaskSpec)}
    (spec,) = [e for e in entities if isinstance(e, WorkflowSpec) and e.template.id.name == "workflows.grpo.grpo"]
    ctx = FlyteContextManager.current_context()
    inputs = {"cfg": TypeEngine.to_literal(ctx, cfg, GRPOConfig, TypeEngine.to_literal_type(GRPOConfig))}
    pods = Pods(work / "cluster", execution=f"bench{random.randrange(1 << 30):x}", env={"GRPOFLOW_NUM_THREADS": threads})
    t0 = time.time()
    out = pods.run_workflow(spec, tasks, inputs)
    cold_wall = time.time() - t0
    cold = TypeEngine.to_python_value(ctx, out["o0"], RunSummary)
    cold_m = _metrics(uri, cold.mlflow_run_id)
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
        lines.append(f"| {t} | {', '.join(f'{v:.1f}' for v in warm_m[k])} | {', '.join(f'{v:.1f}' for v in cold_m[k])} |")
    lines += [f"| start_run | {warm_m['timing/start_run/startup'][0]:.1f} | {cold_m['timing/start_run/startup'][0]:.1f} |", ""]
    ws, cs = warm_m["timing/train/total_step_time"], cold_m["timing/train/total_step_time"]
    per_step_startup = [sum(cold_m[f"timing/{t}/startup"][i] for t in TASKS) for i in range(args.steps)]
    lines += [
        "## Step time (rollout start to train end), seconds",
        "",
        f"- warm: {', '.join(f'{v:.1f}' for v in ws)}; cold: {', '.join(f'{v:.1f}' for v in cs)}",
        f"- cold minus warm, median over steps: **{statistics.median(c - w for c, w in zip(cs, ws)):.1f} s**; sum of the "
        f"step's cold startups: {', '.join(f'{v:.1f}' for v in per_step_startup)} s (the tasks of a step run one after "
        "another here; on a cluster the two logprob tasks and advantages run side by side)",
        f"- whole run wall: warm {warm_wall:.0f} s, cold {cold_wall:.0f} s ({len(pods.pods)} pods)",
        "",
        "Pods (wall seconds): " + ", ".join(f"{p.node.split('-', 2)[-1] if p.node.startswith('n1-') else p.task.rsplit('.', 1)[-1]} {p.seconds:.1f}" for p in pods.pods),
        "",
        "## Load bandwidth",
        "",
        f"- model file {bw['bytes'] / 1e6:.0f} MB: local disk read+parse {bw['local read+parse GB/s']:.2f} GB/s (dropped from "
        f"the page cache first), write+fsync {bw['local write GB/s']:.2f} GB/s; loopback S3 (moto, a Python server) "
        f"download+parse {bw['S3 download+parse GB/s']:.2f} GB/s, upload {bw['S3 upload GB/s']:.2f} GB/s",
        "",
    ]
    fixed = statistics.median(cold_m["timing/advantages/startup"])  # imports + input download, no model
    lines += [
        "## Projection per step (float32 weights W = 4 B/param, AdamW state 2W)",
        "",
        f"Fixed part: {len(TASKS)} tasks x {fixed:.1f} s (the advantages task's startup: interpreter, imports, inputs; no "
        "model). Loads per step: rollout W, reference W, train 3W (weights and optimizer state); extra saves: the optimizer "
        "state 2W (a warm run saves the weights W every step too). Seconds per step at each measured rate:",
        "",
        "| model | W (GB) | fixed | loads + saves, local disk | **per step, local disk** | loads + saves, loopback S3 | **per step, loopback S3** |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, params in (("135M", 135e6), ("1B", 1.0e9), ("8B", 8.0e9)):
        w = 4 * params / 1e9
        disk = 5 * w / bw["local read+parse GB/s"] + 2 * w / bw["local write GB/s"]
        s3 = 5 * w / bw["S3 download+parse GB/s"] + 2 * w / bw["S3 upload GB/s"]
        f = len(TASKS) * fixed
        lines.append(f"| {name} | {w:.1f} | {f:.0f} | {disk:.0f} | **{f + disk:.0f}** | {s3:.0f} | **{f + s3:.0f}** |")
    lines += [
        "",
        f"The loopback S3 server is moto, one Python process ({bw['S3 download+parse GB/s']:.2f} GB/s here); a real object "
        "store moves data at another rate per pod: scale the loads + saves column by the ratio of the two rates. The "
        "local-disk column is the cost when the weights come from a node-local disk. A real cluster also adds pod "
        "scheduling and image pulls (cached per node after the first).",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
