"""Our GRPO against TRL's `GRPOTrainer` on the same machine, model, problems and GRPO settings.

    python bench/vs_trl.py                      # 4 steps of 8 prompts x 8 completions, 32 new tokens
    python bench/vs_trl.py --steps 1 --prompts 2 --generations 2 --max-new-tokens 8 --heldout 4 \\
        --out bench/results/vs_trl_smoke.md     # smoke run
    python bench/vs_trl.py --steps 8 --seeds 42,43,44   # each side once per seed: learning net of sampling luck

Needs the optional extra: `pip install -c constraints.txt -e ".[trl]"`. `trl` is imported only inside the TRL
side (`--side trl`); nothing else in the project imports it.

One invocation runs, one after the other and never concurrently, each in its own subprocess of this script
(so each side's peak RSS is its own, read with `os.wait4`):

1. ours: the `grpo` workflow through Flyte's local executor, exactly as users run it
   (`from workflows.grpo import grpo; grpo(cfg=cfg)`), with the data plane and the MLflow store in a temp
   folder; per-step metrics are read back from MLflow, the final weights are `summary.last_checkpoint`;
2. TRL: `GRPOTrainer` (no vLLM) on a dataset of the same chat-formatted problems in the order ours consumes
   them (step k uses training problems (k-1)*B .. k*B-1), rewarded by our `rl.data.score`; step wall time
   from a `TrainerCallback`, rewards and completion lengths from its logs; final model via `save_model`;
3. eval: greedy accuracy on held-out problems (`rl.data.val_problems`, content-disjoint from training) of the
   initial model and of each side's final model, with `rl.backends.hf.decode.generate` + `rl.data.score`.

Then it prints a markdown table (also written to `--out`, default bench/results/vs_trl.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Run as `python bench/vs_trl.py`, Python puts bench/ first on sys.path, where bench/dataplane.py would shadow the
# `dataplane` package: drop it and import from the repository root.
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))

from rl.backends.hf.model import load_model  # noqa: E402
from rl.data import Problem, prompt_token_ids, score, train_problems, val_problems  # noqa: E402
from rl.model import load_tokenizer, resolve_model  # noqa: E402

# ----------------------------------------------------------------------------------------------- settings


def ours_config(spec: dict):
    """Our `RunConfig` for the benchmark (data settings are the config defaults: the same for both sides)."""
    from tasks.run_config import run_config_from_dict  # not on the TRL side: its process time counts imports

    n = spec["prompts"] * spec["generations"]
    work = Path(spec["workdir"])
    return run_config_from_dict(
        {
            "model": {"name": spec["model_path"], "precision": spec["precision"]},
            "grpo": {
                "num_prompts_per_step": spec["prompts"],
                "num_generations_per_prompt": spec["generations"],
                "max_num_steps": spec["steps"],
                "val_period": 0,
                "use_leave_one_out_baseline": spec["baseline"] == "leave-one-out",
                "normalize_rewards": True,
                "seed": spec["seed"],
            },
            "generation": {
                "max_new_tokens": spec["max_new_tokens"],
                "temperature": spec["temperature"],
                "top_p": 1.0,
                "batch_size": n,  # the whole step in one generate call, as TRL does
            },
            "loss": {
                "reference_policy_kl_penalty": spec["beta"],
                "reference_policy_kl_type": "k3",
                "ratio_clip_min": spec["clip"],
                "ratio_clip_max": spec["clip"],
                "loss_type": "dapo",
            },
            "optim": {
                "lr": spec["lr"],
                "weight_decay": spec["weight_decay"],
                "max_grad_norm": spec["max_grad_norm"],
                "warmup_steps": 0,
                "train_micro_batch_size": spec["micro_batch"],
                "logprob_batch_size": spec["micro_batch"],
            },
            "data": {"num_val_problems": spec["heldout"]},
            "dataplane": {"root": str(work / "ours" / "dataplane")},
            "checkpointing": {"checkpoint_period": spec["steps"], "keep_last_k": 1},
            "tracking": {"uri": f"sqlite:///{work / 'ours' / 'mlflow.db'}", "experiment_name": "vs_trl"},
        }
    )


def data_settings(spec: dict) -> dict:
    d = ours_config(spec).data
    return {
        "dataset": d.dataset,
        "dataset_kwargs": dict(d.dataset_kwargs),
        "seed": d.seed,
        "val_seed": d.val_seed,
        "val_fraction": d.val_fraction,
        "system_prompt": d.system_prompt,
    }


# ----------------------------------------------------------------------------------------------- sides


def side_ours(spec: dict) -> dict:
    import torch
    from mlflow.tracking import MlflowClient

    from workflows.grpo import grpo

    cfg = ours_config(spec)
    summary = grpo(cfg=cfg)
    client = MlflowClient(cfg.tracking.uri)

    def history(key: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(summary.mlflow_run_id, key), key=lambda m: m.step)]

    return {
        "step_time_s": history("timing/train/total_step_time"),
        "checkpointing_s": history("timing/train/checkpointing"),
        "reward": history("train/reward"),
        "generated_tokens": history("train/generated_tokens"),
        "grad_norm": history("train/grad_norm"),  # before clipping
        "kl": history("train/kl_penalty"),
        "final_model": summary.last_checkpoint,
        "mlflow_run_id": summary.mlflow_run_id,
        "torch_threads": torch.get_num_threads(),
    }


def side_trl(spec: dict) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    d = data_settings(spec)
    b, g, steps = spec["prompts"], spec["generations"], spec["steps"]
    n = b * g
    problems = train_problems(
        dataset=d["dataset"],
        dataset_kwargs=d["dataset_kwargs"],
        seed=d["seed"],
        val_fraction=d["val_fraction"],
        start=0,
        count=steps * b,
    )  # step k (1-based) of ours uses problems (k-1)*B .. k*B-1; TRL (shuffle off) walks the dataset in order
    messages = [
        [{"role": "system", "content": d["system_prompt"]}, {"role": "user", "content": p.question}] for p in problems
    ]
    dataset = Dataset.from_dict(
        {
            "prompt": messages,
            "answer": [p.answer for p in problems],
            "entry": [json.dumps(p.entry) for p in problems],  # the reasoning-gym entry score_answer needs
        }
    )

    def grpoflow_score(completions, answer, entry, **_) -> list[float]:
        out = []
        for completion, ans, raw in zip(completions, answer, entry, strict=True):
            text = completion[0]["content"] if isinstance(completion, list) else completion
            item = json.loads(raw)
            problem = Problem(question=item["question"], answer=ans, entry=item)
            out.append(score(problem, text, d["dataset"], d["dataset_kwargs"], d["seed"]))
        return out

    tok = load_tokenizer(spec["model_path"])
    # The prompts TRL will generate from are token-for-token ours (same chat template call as TRL's).
    trl_ids = [
        tok.apply_chat_template(conversation=[m], add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ][0]
        for m in messages
    ]
    ours_ids = [prompt_token_ids(tok, p.question, d["system_prompt"]) for p in problems]
    prompts_identical = [list(map(int, x)) for x in trl_ids] == ours_ids
    # The JSON round trip of the entry does not change scoring.
    roundtrip_ok = all(
        grpoflow_score([[{"role": "assistant", "content": p.answer}]], [p.answer], [json.dumps(p.entry)])[0]
        == score(p, p.answer, d["dataset"], d["dataset_kwargs"], d["seed"])
        for p in problems
    )

    mbs = spec["trl_micro_batch"]
    out_dir = Path(spec["workdir"]) / "trl"
    args = TRLConfig(
        output_dir=str(out_dir / "trainer"),
        # model and precision: float32 master weights; bf16=True is HF Trainer's CPU autocast (mixed precision)
        model_init_kwargs={"dtype": "float32"},
        use_cpu=True,
        bf16=spec["trl_precision"] == "bfloat16",
        fp16=False,
        gradient_checkpointing=False,
        disable_dropout=True,
        # data: ours' order, no shuffling
        shuffle_dataset=False,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        # batch: B prompts x G completions per step, one optimizer update per step (micro-batches accumulate)
        num_generations=g,
        per_device_train_batch_size=mbs,
        gradient_accumulation_steps=n // mbs,
        max_steps=steps,
        num_iterations=1,
        # generation: transformers generate, no vLLM
        use_vllm=False,
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        # loss: clipped token-level PG + beta * k3 KL, normalized by the active tokens of the whole step batch
        loss_type="dapo",
        beta=spec["beta"],
        epsilon=spec["clip"],
        epsilon_high=spec["clip"],
        importance_sampling_level="token",
        use_bias_correction_kl=False,  # ours: beta * k3, not weighted by the (detached-equal-1) ratio
        scale_rewards="group",
        mask_truncated_completions=False,
        # optimizer: AdamW, constant lr, grad-norm clip
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=spec["weight_decay"],
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=spec["max_grad_norm"],
        seed=spec["seed"],
        # bookkeeping
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.started = 0.0
            self.times: list[float] = []
            self.logs: dict[int, dict] = {}

            self.pre_optimizer = 0.0
            self.until_optimizer: list[float] = []  # step begin -> after grad clip: generation, logprobs, fwd/bwd, clip
            self.optimizer: list[float] = []  # optimizer.step

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.pre_optimizer = time.perf_counter()
            self.until_optimizer.append(self.pre_optimizer - self.started)

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.optimizer.append(time.perf_counter() - self.pre_optimizer)

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.started)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs[state.global_step] = dict(logs)

    timer = StepTimer()
    trainer = GRPOTrainer(
        model=spec["model_path"],
        reward_funcs=grpoflow_score,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[timer],
    )
    trainer.train()
    final = out_dir / "final"
    trainer.save_model(str(final))
    logged = [timer.logs[s] for s in sorted(timer.logs)]
    return {
        "step_time_s": timer.times,
        "reward": [float(x["reward"]) for x in logged],
        "generated_tokens": [float(x["completions/mean_length"]) * n for x in logged],
        "grad_norm": [float(x.get("grad_norm", float("nan"))) for x in logged],  # before clipping
        "kl": [float(x.get("kl", float("nan"))) for x in logged],
        "trl_step_time_s": [
            float(x.get("step_time", float("nan"))) for x in logged
        ],  # TRL's own: training_step calls only
        "until_optimizer_s": timer.until_optimizer,
        "optimizer_s": timer.optimizer,
        "final_model": str(final),
        "trl_version": trl.__version__,
        "prompts_identical": prompts_identical,
        "reward_roundtrip_ok": roundtrip_ok,
        "eos_token_ids": list(trainer.eos_token_ids),
        "torch_threads": torch.get_num_threads(),
    }


def side_eval(spec: dict) -> dict:
    """Greedy held-out accuracy of the initial model and of each side's final model."""
    import torch

    from rl.backends.hf.decode import generate
    from rl.checkpoint import local_copy

    d = data_settings(spec)
    problems = val_problems(
        dataset=d["dataset"],
        dataset_kwargs=d["dataset_kwargs"],
        seed=d["val_seed"],
        val_fraction=d["val_fraction"],
        count=spec["heldout"],
    )
    tok = load_tokenizer(spec["model_path"])
    prompts = [prompt_token_ids(tok, p.question, d["system_prompt"]) for p in problems]
    out = {"n": len(problems)}
    for name, path in spec["eval_models"].items():
        model = load_model(local_copy(path, {}))
        torch.manual_seed(0)  # greedy: no randomness, seeded anyway
        gen = generate(
            model, tok, prompts, max_new_tokens=spec["max_new_tokens"], greedy=True, batch_size=64, precision="float32"
        )
        texts = tok.batch_decode(gen.response_token_ids, skip_special_tokens=True)
        rewards = [score(p, t, d["dataset"], d["dataset_kwargs"], d["seed"]) for p, t in zip(problems, texts)]
        out[name] = {
            "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "mean_reward": sum(rewards) / len(rewards),
            "mean_length": float(gen.response_lengths.float().mean()),
        }
        del model
    return out


SIDES = {"ours": side_ours, "trl": side_trl, "eval": side_eval}


# ----------------------------------------------------------------------------------------------- driver


def run_child(side: str, spec_path: Path, result_path: Path) -> dict:
    """Run one side in a subprocess; return its JSON result plus wall time and peak RSS (os.wait4).

    A result already complete at ``result_path`` (from an interrupted run resumed with ``--workdir``) is reused.
    """
    if result_path.exists():
        result = json.loads(result_path.read_text())
        if "peak_rss_bytes" in result:
            print(f"[vs_trl] --- {side}: reusing {result_path}", flush=True)
            return result | {"reused": True}
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--side",
        side,
        "--spec",
        str(spec_path),
        "--result",
        str(result_path),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL pings the Hub on trainer start otherwise
    env.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local folder: no Hub look-ups on either side
    print(f"[vs_trl] --- {side}: {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=str(REPO), env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        msg = f"side {side!r} failed with exit code {proc.returncode}; see its output above"
        raise SystemExit(msg)
    result = json.loads(result_path.read_text())
    result["process_wall_s"] = wall
    result["peak_rss_bytes"] = usage.ru_maxrss * 1024  # Linux: KiB
    result_path.write_text(json.dumps(result))  # complete: a resumed run (--workdir) reuses it
    print(f"[vs_trl] --- {side} done in {wall:.1f} s, peak RSS {usage.ru_maxrss / 2**20:.2f} GiB", flush=True)
    return result


def machine() -> dict:
    model = platform.processor() or "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
                break
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        nproc = int(subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout)
    except (OSError, subprocess.CalledProcessError, ValueError):
        nproc = len(os.sched_getaffinity(0))
    mem = ""
    try:
        kib = int(
            next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal")).split()[1]
        )
        mem = f"{kib / 2**20:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    return {"nproc": nproc, "cpu": model, "mem": mem}


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return centre - half, centre + half


def _med(values: list[float] | None) -> str:
    return f"{statistics.median(values):.2f}" if values else "n/a"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b and math.isfinite(a) and math.isfinite(b) else "n/a"


def report(
    spec: dict,
    ours: dict[int, dict],
    trl_res: dict[int, dict],
    ev: dict,
    command: str,
    total_wall: float,
    reused: int = 0,
) -> str:
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "?"

    m = machine()
    n = spec["prompts"] * spec["generations"]
    seeds = spec["seeds"]

    def pooled(res: dict[int, dict], key: str) -> list[float]:
        return [v for seed in seeds for v in res[seed][key]]

    def per_step_rate(res: dict) -> list[float]:
        return [t / s for t, s in zip(res["generated_tokens"], res["step_time_s"]) if s > 0]

    def step_means(res: dict[int, dict], key: str) -> list[float]:  # per step, the mean over seeds
        return [statistics.mean(vals) for vals in zip(*(res[seed][key] for seed in seeds))]

    first = ours[seeds[0]], trl_res[seeds[0]]
    o_med, t_med = statistics.median(pooled(ours, "step_time_s")), statistics.median(pooled(trl_res, "step_time_s"))
    o_ex = [s - c for seed in seeds for s, c in zip(ours[seed]["step_time_s"], ours[seed]["checkpointing_s"])]
    o_rate = statistics.median([r for seed in seeds for r in per_step_rate(ours[seed])])
    t_rate = statistics.median([r for seed in seeds for r in per_step_rate(trl_res[seed])])
    o_mem = max(ours[seed]["peak_rss_bytes"] for seed in seeds) / 2**30
    t_mem = max(trl_res[seed]["peak_rss_bytes"] for seed in seeds) / 2**30
    o_wall = statistics.median(ours[seed]["process_wall_s"] for seed in seeds)
    t_wall = statistics.median(trl_res[seed]["process_wall_s"] for seed in seeds)
    o_rew, t_rew = statistics.mean(pooled(ours, "reward")), statistics.mean(pooled(trl_res, "reward"))
    k = ev["n"]
    before = ev["before"]["accuracy"]
    o_accs = [ev[f"ours/{seed}"]["accuracy"] for seed in seeds]
    t_accs = [ev[f"trl/{seed}"]["accuracy"] for seed in seeds]
    o_acc, t_acc = statistics.mean(o_accs), statistics.mean(t_accs)

    def acc(p: float, trials: int = k) -> str:
        lo, hi = wilson(p, trials)
        return f"{p:.3f} [{lo:.2f}, {hi:.2f}]"

    def steps(values: list[float], fmt: str) -> str:
        return ", ".join(format(v, fmt) for v in values)

    def per_seed(values: list[float]) -> str:
        return ", ".join(f"{v:.3f}" for v in values)

    diffs = [o - t for o, t in zip(o_accs, t_accs)]
    paired = ""
    if len(seeds) > 1:
        sd = statistics.stdev(diffs)
        paired = f"mean {statistics.mean(diffs):+.3f}, sd over seeds {sd:.3f}"
    seed_note = (
        f"seed {seeds[0]}"
        if len(seeds) == 1
        else f"seeds {', '.join(map(str, seeds))}: each side runs once per seed (same problems in the same order, "
        "only the sampling differs); step times, tokens/s and memory pool all seeds, rewards per step are means over "
        "seeds"
    )
    loo = spec["baseline"] == "leave-one-out"
    lines = [
        f"# grpoflow vs TRL GRPOTrainer ({spec['steps']} steps)",
        "",
        f"Command: `{command}` (total {total_wall / 60:.1f} min, sides run one after the other"
        + (
            f"; {reused} side runs reused from the work folder, their times are those of their own run"
            if reused
            else ""
        )
        + ").",
        f"Machine: nproc {m['nproc']}, {m['cpu']}, {m['mem']} RAM; torch threads ours "
        f"{first[0]['torch_threads']}, TRL {first[1]['torch_threads']}.",
        f"Versions: torch {version('torch')}, transformers {version('transformers')}, trl {first[1]['trl_version']}, "
        f"flytekit {version('flytekit')}, mlflow {version('mlflow')}.",
        "",
        f"**Precision: ours {spec['precision']}, TRL {spec['trl_precision']}** (bfloat16 = mixed precision with "
        "float32 master weights: ours `model.precision: bfloat16`, the LM head's matmul in bf16 with the target and "
        "top-8 logits exact in float32, `rl.backends.hf.lm_head`; TRL `bf16=True`, HF Trainer's CPU autocast); "
        "held-out evaluation in float32 for every model. Same model folder (`"
        + spec["model_path"]
        + "`), same training problems in the "
        f"same order ({spec['data']['dataset']} {spec['data']['dataset_kwargs']}, seed {spec['data']['seed']}; step k "
        "uses problems (k-1)*B .. k*B-1), same chat-formatted prompts (system prompt "
        f"{spec['data']['system_prompt']!r}; token ids identical: {first[1]['prompts_identical']}), same reward "
        "(`rl.data.score`).",
        "",
        f"Settings, both sides: {spec['prompts']} prompts x {spec['generations']} completions per step ({n} "
        "samples, one optimizer "
        f"update), max {spec['max_new_tokens']} new tokens, temperature {spec['temperature']}, top-p 1, "
        f"top-k off, lr {spec['lr']:g} "
        f"constant (AdamW 0.9/0.999, eps 1e-8, weight decay {spec['weight_decay']:g}), grad-norm clip "
        f"{spec['max_grad_norm']:g}, "
        f"KL k3 beta {spec['beta']:g}, ratio clip {spec['clip']:g}/{spec['clip']:g}, token-level loss over "
        "the active tokens of the step "
        f'batch (TRL `loss_type="dapo"`), group std normalization (TRL `scale_rewards="group"`), one update per batch '
        f"(TRL `num_iterations=1`), micro-batch ours {spec['micro_batch']}, TRL {spec['trl_micro_batch']} "
        f"(gradient accumulation {n // spec['trl_micro_batch']}), no vLLM, " + seed_note + ".",
        "",
        "| | ours (grpoflow, Flyte local) | TRL GRPOTrainer | ours / TRL |",
        "|---|---:|---:|---:|",
        f"| median step wall time (s) | {o_med:.2f} | {t_med:.2f} | {ratio(o_med, t_med)} |",
        f"| median step wall time, ours without weight saving (s) | {statistics.median(o_ex):.2f} | "
        f"{t_med:.2f} | {ratio(statistics.median(o_ex), t_med)} |",
        f"| step wall times (s{'' if len(seeds) == 1 else ', first seed'}) | "
        f"{steps(first[0]['step_time_s'], '.2f')} | {steps(first[1]['step_time_s'], '.2f')} | |",
        f"| generated tokens per step | {steps(step_means(ours, 'generated_tokens'), '.0f')} | "
        f"{steps(step_means(trl_res, 'generated_tokens'), '.0f')} | |",
        f"| generated tokens/s (median over steps of tokens / step time) | {o_rate:.1f} | {t_rate:.1f} | "
        f"{ratio(o_rate, t_rate)} |",
        f"| peak RSS of the side's process (GiB) | {o_mem:.2f} | {t_mem:.2f} | {ratio(o_mem, t_mem)} |",
        f"| process wall time, incl. imports, model loading, saving (s) | {o_wall:.1f} | {t_wall:.1f} | "
        f"{ratio(o_wall, t_wall)} |",
        f"| training reward per step | {steps(step_means(ours, 'reward'), '.3f')} | "
        f"{steps(step_means(trl_res, 'reward'), '.3f')} | |",
        f"| mean training reward over steps | {o_rew:.3f} | {t_rew:.3f} | {ratio(o_rew, t_rew)} |",
        f"| greedy held-out accuracy before (initial model, shared) [95% CI] | {acc(before)} | {acc(before)} | 1.00 |",
        f"| greedy held-out accuracy after [95% CI{'' if len(seeds) == 1 else ', pooled over seeds'}] | "
        f"{acc(o_acc, k * len(seeds))} | {acc(t_acc, k * len(seeds))} | {ratio(o_acc, t_acc)} |",
        *(
            [f"| held-out accuracy after, per seed | {per_seed(o_accs)} | {per_seed(t_accs)} | ours - TRL: {paired} |"]
            if len(seeds) > 1
            else []
        ),
        "",
        f"Held-out: {k} problems from `rl.data.val_problems` (val seed {spec['data']['val_seed']}, the validation "
        f"split by question hash, never trained on), greedy, max {spec['max_new_tokens']} new tokens, scored with "
        "`rl.data.score` (accuracy = share with reward 1). Mean greedy length before "
        f"{ev['before']['mean_length']:.1f}, after: ours "
        f"{statistics.mean(ev[f'ours/{s}']['mean_length'] for s in seeds):.1f}, TRL "
        f"{statistics.mean(ev[f'trl/{s}']['mean_length'] for s in seeds):.1f} tokens.",
        "",
        "Settings that differ between the sides:",
        "",
        (
            "- baseline: ours uses its default leave-one-out baseline (`--ours-baseline leave-one-out`); TRL has "
            "only the group mean."
            if loo
            else "- baseline: group mean on both sides; ours' default leave-one-out baseline is turned off "
            "(`grpo.use_leave_one_out_baseline: false`) because TRL has none (`--ours-baseline leave-one-out` keeps "
            "it)."
        ),
        "- std normalization: both divide by the group's Bessel-corrected reward std; ours adds eps 1e-6 "
        "(and only where std > 0), TRL adds 1e-4.",
        "- KL: both k3 = exp(ref - logp) - (ref - logp) - 1 weighted by beta (TRL "
        "`use_bias_correction_kl=False`); ours clamps the log-ratio "
        "to +-20 and the per-token KL to 10 (NeMo-RL), TRL does not clamp.",
        "- weight decay: both AdamW 0.01, but HF Trainer exempts biases and norm weights; ours decays every parameter.",
        "- sampling randomness: same seed value, different streams (ours re-seeds every RNG per step and purpose with "
        "`rl.seeding.step_seed`, TRL seeds once), so the completions, and hence rewards and updates, differ.",
        "- step time scope: ours' step (rollout task start to train task end) includes Flyte task overhead, "
        "data-plane Parquet I/O and saving the step's weights (a full checkpoint on the last step; the row 'without "
        "weight saving' subtracts it), and its step 1 loads the policy and reference models; TRL loads both before "
        "its first step and saves nothing during steps.",
        "- generation: ours runs its own KV-cached decode loop (one prefill per distinct prompt, inverse-CDF "
        "sampling, finished rows leave the batch); TRL calls transformers `generate`.",
        "- forward passes: ours encodes each group's shared prompt once per micro-batch (the completions attend to "
        "its KV cache, `rl.backends.hf.logprobs.forward_logprobs`), runs the LM head only on response tokens (bf16 "
        "matmul, float32-exact target and top-8 logits, `rl.backends.hf.lm_head`) and uses eager attention; TRL runs "
        "every padded row through the full model (SDPA attention, the LM head on all completion positions under bf16 "
        "autocast).",
        "- extra work per step: ours computes generation logprobs while sampling; TRL computes per-token "
        "entropy in its training forward. Reference logprobs in batches of the micro-batch size; TRL "
        "shuffles the step's rows before splitting them into micro-batches (same gradient).",
        f"- TRL step split (medians): {_med(pooled(trl_res, 'until_optimizer_s'))} s from step begin to the optimizer "
        f"step (generation, logprobs, forward/backward, grad clip), {_med(pooled(trl_res, 'optimizer_s'))} s in "
        "`optimizer.step`; TRL's own logged `step_time` (its `training_step` calls only) "
        f"{_med(pooled(trl_res, 'trl_step_time_s'))} s.",
        "- generated tokens: both count the eos token of completions that end; TRL's come from its logged "
        "`completions/mean_length` x samples per step.",
    ]
    if not first[1]["prompts_identical"]:
        lines.append("- WARNING: TRL's chat-template token ids differ from ours for some prompts.")
    if not first[1]["reward_roundtrip_ok"]:
        lines.append(
            "- WARNING: scoring through the dataset's JSON entry column differs from scoring the original entry."
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps (optimizer updates)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (B)")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="max new tokens (TRL max_completion_length)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--beta", type=float, default=0.01, help="KL coefficient")
    parser.add_argument("--clip", type=float, default=0.2, help="ratio clip (TRL epsilon and epsilon_high)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument(
        "--micro-batch", type=int, default=32, help="ours: samples per forward/backward (capped at B*G)"
    )
    parser.add_argument(
        "--trl-micro-batch", type=int, default=8, help="TRL: per_device_train_batch_size (capped at B*G)"
    )
    parser.add_argument("--heldout", type=int, default=64, help="held-out problems for greedy accuracy")
    parser.add_argument("--seed", type=int, default=42, help="sampling seed of both sides (one run each)")
    parser.add_argument(
        "--seeds",
        type=lambda v: [int(x) for x in v.split(",")],
        help="comma-separated seeds: one run of each side per seed (overrides --seed), e.g. 42,43,44",
    )
    parser.add_argument(
        "--precision",
        choices=["float32", "bfloat16"],
        default="bfloat16",
        help="training/generation precision of ours (bfloat16: mixed, float32 master weights)",
    )
    parser.add_argument(
        "--trl-precision", choices=["float32", "bfloat16"], help="TRL's precision (default: --precision)"
    )
    parser.add_argument(
        "--ours-baseline",
        choices=["mean", "leave-one-out"],
        default="mean",
        help="ours' baseline: 'mean' matches TRL; 'leave-one-out' is ours' default",
    )
    parser.add_argument("--out", default="bench/results/vs_trl.md", help="markdown result file (relative to the repo)")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the temp folder (data plane, MLflow, models)")
    parser.add_argument(
        "--workdir",
        help="work in this folder and keep it; sides whose results are already there are "
        "reused (resumes an interrupted run with the same settings)",
    )
    parser.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.side:  # child process: run one side, write its JSON result
        spec = json.loads(Path(args.spec).read_text())
        Path(args.result).write_text(json.dumps(SIDES[args.side](spec)))
        return

    n = args.prompts * args.generations
    micro, trl_micro = min(args.micro_batch, n), min(args.trl_micro_batch, n)
    if n % micro or n % trl_micro:
        parser.error(f"--micro-batch {micro} and --trl-micro-batch {trl_micro} must divide prompts x generations = {n}")
    if args.heldout < 1:
        parser.error(f"--heldout {args.heldout}: use at least 1 held-out problem")
    seeds = args.seeds or [args.seed]
    if len(set(seeds)) != len(seeds):
        parser.error(f"--seeds {seeds} repeats a seed; give distinct seeds")
    command = "python bench/vs_trl.py" + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vs_trl-"))
    work.mkdir(parents=True, exist_ok=True)
    spec = {
        "steps": args.steps,
        "prompts": args.prompts,
        "generations": args.generations,
        "max_new_tokens": args.max_new_tokens,
        "lr": args.lr,
        "beta": args.beta,
        "clip": args.clip,
        "temperature": args.temperature,
        "weight_decay": args.weight_decay,
        "max_grad_norm": args.max_grad_norm,
        "micro_batch": micro,
        "trl_micro_batch": trl_micro,
        "heldout": args.heldout,
        "seed": seeds[0],
        "seeds": seeds,
        "precision": args.precision,
        "trl_precision": args.trl_precision or args.precision,
        "baseline": args.ours_baseline,
        "model_path": resolve_model("SmolLM2-135M-Instruct"),
        "workdir": str(work),
    }
    spec["data"] = data_settings(spec)
    d = spec["data"]
    try:  # the held-out set must exist before any side runs
        val_problems(
            dataset=d["dataset"],
            dataset_kwargs=d["dataset_kwargs"],
            seed=d["val_seed"],
            val_fraction=d["val_fraction"],
            count=args.heldout,
        )
    except ValueError as e:
        parser.error(f"--heldout {args.heldout}: {e}")
    t0 = time.perf_counter()
    try:
        ours: dict[int, dict] = {}
        trl_res: dict[int, dict] = {}
        models = {"before": spec["model_path"]}
        for seed in seeds:  # the same problems in the same order; only the sampling seed changes
            seed_spec = {k: v for k, v in spec.items() if k != "seeds"} | {
                "seed": seed,
                "workdir": str(work / f"seed{seed}"),
            }
            Path(seed_spec["workdir"]).mkdir(exist_ok=True)
            seed_path = work / f"spec_seed{seed}.json"
            stored = json.loads(seed_path.read_text()) if seed_path.exists() else None
            if stored is not None and {k: v for k, v in stored.items() if k != "seeds"} != json.loads(
                json.dumps(seed_spec)
            ):
                msg = f"{work} holds a run of seed {seed} with other settings ({seed_path}); use another --workdir"
                raise SystemExit(msg)
            seed_path.write_text(json.dumps(seed_spec, indent=2))
            ours[seed] = run_child("ours", seed_path, work / f"ours_seed{seed}.json")
            trl_res[seed] = run_child("trl", seed_path, work / f"trl_seed{seed}.json")
            models[f"ours/{seed}"], models[f"trl/{seed}"] = ours[seed]["final_model"], trl_res[seed]["final_model"]
        spec["eval_models"] = models
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(spec, indent=2))
        (work / "eval.json").unlink(missing_ok=True)  # the models to evaluate may have changed
        ev = run_child("eval", spec_path, work / "eval.json")
        total = time.perf_counter() - t0
        reused = sum(bool(r.get("reused")) for res in (ours, trl_res) for r in res.values())
        text = report(spec, ours, trl_res, ev, command, total, reused)
        raw = {"spec": spec, "ours": ours, "trl": trl_res, "eval": ev}
    finally:
        if args.keep_workdir or args.workdir:
            print(f"[vs_trl] kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(text)
    out = REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps(raw, indent=2) + "\n")
    print(f"[vs_trl] wrote {out} and {out.with_suffix('.json')}", flush=True)


if __name__ == "__main__":
    main()
