"""One whole GRPO step, phase by phase, through the back-end interfaces and the data plane on a local folder, and our
decode against plain ``transformers.generate`` in the same process.

    python -m bench.step [--model DIR | --random-shape {135M,1B}] [--tokenizer DIR] [--device {cpu,cuda}]
        [--prompts 64] [--group 8] [--max-new-tokens 256] [--repeats 4] [--calls 3] [--pins no_cudnn,cudnn]
        [--precision auto] [--policy-backend transformers] [--generation-backend transformers] [--cuda-graphs]
        [--lora-rank R [--lora-alpha 2R] [--lora-targets all-linear]] [--saves 0] [--no-decode]
        [--workdir DIR] [--json PATH] [--out PATH.md]

No Flyte and no MLflow in the process (it never imports ``tasks/`` or ``workflows/``): a bare CUDA machine with torch,
transformers, pyarrow, fsspec and tensordict runs it. Steps k = 1 .. ``--repeats`` each run, timed with
``torch.cuda.synchronize()`` before every clock read on CUDA, what the step's tasks run:

1. rollout: ``rl.step.rollout_to_batch`` (B = ``--prompts`` chain_sum problems of step k, G = ``--group`` completions
   each, temperature 1, scored; the first put of the step partition, sealed), as the rollout task runs it;
2. reference_logprobs: ``DataPlanePolicy.get_reference_policy_logprobs_from_meta``;
3. advantages: ``rl.step.write_advantages``, as the advantages task runs it;
4. update: ``rl.step.update`` (``DataPlanePolicy.train_from_meta``), one on-policy update as in the default config;
5. refit: ``policy.prepare_checkpoint`` (the train task's gather; a no-op for transformers), then
   ``GenerationBackend.refit(PolicyVersion(k, ..), weights=policy.named_weights())``, the warm in-process refit of
   ``tasks/runtime.py``. Then the step's partition is cleared (timed as data-plane ``clear``).
Each phase includes its data-plane reads and writes; ``dataplane`` reports those seconds apart. Step 1 is a warm-up;
the figures are medians over the later steps (token counts: the lower median). Every step has new prompts, so its
generation rate (response tokens, eos included, / seconds inside ``GenerationBackend.generate``) is a cold-shape
figure, as in a real run.

``--lora-rank R`` sets ``policy.lora`` (`rl.lora`: rank R, alpha ``--lora-alpha``, default 2R, target modules
``--lora-targets``, comma-separated, default ``all-linear``); without it every weight trains. Recorded after the steps:
the trainable parameters (``requires_grad``, of the module the policy holds) and the peak memory of the steps: on CPU
the process's peak resident set (``VmHWM`` of ``/proc/self/status``, reset once the model folder exists, so a random
model built in the process does not count), on CUDA ``torch.cuda.max_memory_allocated``; in GiB. Then ``--saves N``
times ``policy.save_checkpoint(url, trainer_state=TrainerState(...))`` (weights, or the adapter under LoRA, plus the
optimizer and RNG state: what a run's checkpoint holds) into a fresh folder each (removed after it is measured):
the bytes of the saved folder and the median save seconds.

Then, unless ``--no-decode``, with the back-ends still loaded (the trainer's memory held), plain transformers
``model.generate`` is loaded beside them and ``bench/decode_calls.py`` compares the decoders even-handedly:
``generate``, ours through the back-end (``ours``: its loop under its SDPA pin, ``rl.backends.hf.sdpa.DECODE_PIN``) and
ours under each other pin of ``--pins`` (the transformers back-end; e.g. ``ours[cudnn]``), each warmed once at the timed
shape (the prompts of step ``--repeats`` + 1), then ``--calls`` timed calls each on those prompts (warm), then
``--calls`` each on prompts no side saw (cold); medians with min and max. The default chain_sum prompts all have one
length, so a warm batch has no padding (transformers then skips the mask); the cold sets are lengthened unevenly
(:func:`padded_prompts`) so that they need padding and bring widths no call had, as a real run's prompts do. Baseline
settings: the model with bf16 weights where the precision resolves to bf16 (else float32),
``attn_implementation="sdpa"``, ``do_sample=True, top_k=0, top_p=1.0``, same T; its tokens are those after the prompt up
to and including the first eos. Recorded too: ``torch.backends.cudnn.version()`` and the SDPA kernel torch picks for a
decode step's shapes under each pin (``rl.backends.hf.sdpa.decode_choice``).

Update MFU = sum_i (6 N + 12 L H S_i) S_i / update seconds / peak: PaLM (arXiv 2204.02311, appendix B) as
``bench/megatron.py`` counts it (N parameters with tied embeddings once, L layers, H hidden size, one forward and one
backward, no recomputation), but with each row's own length S_i. It counts every row's whole sequence, so a back-end
that shares a group's prompt forward shows a higher MFU. Peak: ``bench.megatron.peak_flops()``
on CUDA; on CPU n/a unless ``GRPOFLOW_PEAK_TFLOPS`` is set. With ``--random-shape`` (a random Llama of
``bench.megatron.SIZES``) eos is rare, so completions run to ``--max-new-tokens``, as a speed benchmark wants.
``--json`` gets one record after the steps (``"partial": true``, no decode comparison yet) and the whole record at
the end: a run stopped by a time limit still leaves its step figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.megatron import peak_flops, random_llama
from dataplane import paths
from rl.backends import registry
from rl.backends.dataplane_policy import DataPlanePolicy
from rl.backends.interfaces import PolicyVersion
from rl.config import DEFAULT_MODEL, config_from_dict
from rl.config.sections import LORA_ALL_LINEAR
from rl.data import prompt_token_ids, train_problems
from rl.model import load_tokenizer, resolve_model

PHASES = ("rollout", "reference_logprobs", "advantages", "update", "refit")

DATAPLANE_IO = ("register_partition", "put", "seal", "read", "read_batch", "write_columns", "clear")
"""``DataPlane`` methods timed as data-plane I/O (``read_batch`` calls the inner ``read``: counted once)."""


def add_step_args(
    p: argparse.ArgumentParser, *, prompts: int, group: int, max_new_tokens: int, repeats: int, steps_of: str = ""
) -> None:
    """The arguments ``bench.step`` shares with benchmarks that run it: ``--model`` or ``--random-shape`` (with
    ``--tokenizer``), ``--device``, and the step's shape (``--prompts``, ``--group``, ``--max-new-tokens``,
    ``--repeats``, with these defaults; ``steps_of``: whose steps ``--repeats`` counts, in its help)."""
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", help="a transformers model folder (default: the converted SmolLM2-135M-Instruct)")
    which.add_argument("--random-shape", choices=["135M", "1B"], help="a random-weight Llama of bench.megatron.SIZES")
    p.add_argument("--tokenizer", help="tokenizer folder for --random-shape (default: SmolLM2-135M-Instruct's)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--prompts", type=int, default=prompts)
    p.add_argument("--group", type=int, default=group)
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--repeats", type=int, default=repeats, help=f"whole steps{steps_of}; the first is a warm-up")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.step", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_step_args(p, prompts=64, group=8, max_new_tokens=256, repeats=4)
    p.add_argument("--calls", type=int, default=3, help="timed decode calls per side, warm and cold each")
    p.add_argument(
        "--pins",
        help="SDPA pins our loop is also timed under (rl.backends.hf.sdpa.PINS, comma-separated; default on CUDA: "
        "every pin but torch's own, none on the CPU, where the pins change nothing)",
    )
    p.add_argument("--precision", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--policy-backend", default="transformers")
    p.add_argument("--generation-backend", default="transformers")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="generation.cuda_graphs: static KV cache, decode step replayed as a CUDA graph",
    )
    p.add_argument("--lora-rank", type=int, help="policy.lora.rank: train a LoRA adapter (default: every weight)")
    p.add_argument("--lora-alpha", type=float, help="policy.lora.alpha (default: twice --lora-rank)")
    p.add_argument(
        "--lora-targets",
        default=LORA_ALL_LINEAR,
        help=f"policy.lora.target_modules, comma-separated module names (default: {LORA_ALL_LINEAR})",
    )
    p.add_argument("--saves", type=int, default=0, help="timed checkpoint saves after the steps (default: none)")
    p.add_argument("--no-decode", action="store_true", help="skip the decode comparison with transformers.generate")
    p.add_argument("--workdir", help="data plane and random models (default: a temporary folder, removed at the end)")
    p.add_argument("--json", help="append one JSON object per run to this file")
    p.add_argument("--out", help="also write the markdown table here")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.prompts < 1 or args.group < 2 or args.max_new_tokens < 1 or args.calls < 1:
        p.error("use --repeats >= 1, --calls >= 1, --prompts >= 1, --group >= 2 and --max-new-tokens >= 1")
    if args.saves < 0:
        p.error(f"--saves is {args.saves}: use 0 (no checkpoint saves) or more")
    if args.lora_rank is None and args.lora_alpha is not None:
        p.error("--lora-alpha needs --lora-rank: add --lora-rank R to train a LoRA adapter, or drop --lora-alpha")
    if args.lora_rank is not None and not [t for t in args.lora_targets.split(",") if t.strip()]:
        p.error("--lora-targets is empty: name module names such as q_proj,v_proj, or all-linear")
    from rl.backends.hf.sdpa import PINS

    unknown = [x for x in (args.pins or "").split(",") if x and x not in PINS]
    if unknown:
        p.error(f"unknown --pins {unknown}: use names of {sorted(PINS)}")
    return args


def select_device(device: str | None) -> tuple[bool, Callable[[], float]]:
    """Hide CUDA for ``cpu`` (before torch initialises it: the back-ends use CUDA whenever it is available).

    Returns:
        ``(cuda, now)``: whether to run on CUDA, and a clock that synchronizes the device before reading the time.

    Raises:
        SystemExit: ``cuda`` without a CUDA device, or ``cpu`` after something in this process initialised CUDA.
    """
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"bench.step: --device cuda, but torch {torch.__version__} sees no CUDA device")
    if device == "cpu" and torch.cuda.is_available():
        sys.exit("bench.step: --device cpu, but CUDA was initialised in this process before bench.step could hide it")
    cuda = torch.cuda.is_available()

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    return cuda, now


def model_path(args: argparse.Namespace, workdir: Path) -> str:
    """``--model``, or the random Llama of ``--random-shape``, built once into ``<workdir>/models/<size>``."""

    if not args.random_shape:
        return args.model or resolve_model(DEFAULT_MODEL)

    target = workdir / "models" / args.random_shape
    if not target.exists():  # written under a temporary name and renamed: a folder there is complete
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        random_llama(tmp, args.random_shape, args.tokenizer or resolve_model(DEFAULT_MODEL))
        tmp.rename(target)
    return str(target)


def model_shape(path: str) -> dict[str, int]:
    """N (parameters, tied ones once), L layers and H hidden size of the model at ``path``, without loading weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    return {"params": params, "layers": config.num_hidden_layers, "hidden": config.hidden_size}


class Timed:
    """``inner`` with the seconds spent in its methods ``names`` added up in :attr:`seconds` (the caller resets it)."""

    def __init__(self, inner: Any, names: tuple[str, ...], now: Callable[[], float]) -> None:
        self.inner, self.names, self.now, self.seconds = inner, names, now, 0.0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in self.names:
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = self.now()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += self.now() - t0

        return timed


def lora_settings(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``policy.lora`` mapping of ``--lora-rank``, ``--lora-alpha`` (default 2 x rank) and ``--lora-targets``;
    None (full fine-tuning) without ``--lora-rank``. The config checks the values (`rl.config.sections.LoRASettings`).
    """
    if args.lora_rank is None:
        return None
    alpha = 2.0 * args.lora_rank if args.lora_alpha is None else args.lora_alpha
    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    return {"rank": args.lora_rank, "alpha": alpha, "target_modules": targets}


def reset_peak_memory(cuda: bool) -> None:
    """Start :func:`peak_memory_gib` afresh: CUDA's peak statistics, or the process's ``VmHWM`` (Linux: writing 5 to
    ``/proc/self/clear_refs`` sets it to the current resident set; nothing where there is no such file)."""
    if cuda:
        import torch

        torch.cuda.reset_peak_memory_stats()
    elif Path("/proc/self/clear_refs").exists():
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_gib(cuda: bool, status: str | None = None) -> float | None:
    """Peak memory since :func:`reset_peak_memory` in GiB: ``torch.cuda.max_memory_allocated`` on CUDA, else ``VmHWM``
    (peak resident set, kB) of ``status`` (default: ``/proc/self/status``); None where there is no such file."""
    if cuda:
        import torch

        return torch.cuda.max_memory_allocated() / 2**30
    if status is None:
        if not Path("/proc/self/status").exists():
            return None
        status = Path("/proc/self/status").read_text()
    kb = next((line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")), None)
    return None if kb is None else int(kb) * 1024 / 2**30


def trainable_params(policy: Any) -> int:
    """Parameters that require grad in the module the policy holds (this rank's under model parallelism)."""
    return sum(p.numel() for p in policy.model.parameters() if p.requires_grad)


def folder_bytes(folder: str | Path) -> int:
    """Bytes of the files under ``folder``, recursively."""
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def time_saves(policy: Any, root: Path, *, count: int, step: int, now: Callable[[], float]) -> dict[str, Any]:
    """``count`` timed ``policy.save_checkpoint(url, trainer_state=TrainerState(step, ...))``, each into a fresh folder
    under ``root`` (removed after it is measured).

    Returns:
        ``{"bytes": of the first folder, "trainer_state_bytes": its trainer_state/ part, "save_s": median seconds,
        "save_s_all": every call's seconds}``.
    """
    from rl.trainer_state import TRAINER_STATE, TrainerState

    seconds, sizes = [], []
    for i in range(count):
        url = root / f"save-{i}"
        t0 = now()
        policy.save_checkpoint(str(url), trainer_state=TrainerState(step=step, mlflow_run_id="bench", extra={}))
        seconds.append(now() - t0)
        sizes.append((folder_bytes(url), folder_bytes(url / TRAINER_STATE)))
        shutil.rmtree(url)
    return {
        "bytes": sizes[0][0],
        "trainer_state_bytes": sizes[0][1],
        "save_s": statistics.median(seconds),
        "save_s_all": seconds,
    }


def grpo_step(
    step: int, *, cfg: Any, tokenizer: Any, gen: Any, policy: Any, dp: Timed, now: Callable[[], float], base: str
) -> dict[str, Any]:
    """Run and time step ``step`` (the phases of the module docstring); the policy holds version ``step - 1``."""
    from rl.step import rollout_to_batch, update, write_advantages

    seconds: dict[str, float] = {}
    io: dict[str, float] = {}

    @contextmanager
    def phase(name: str) -> Iterator[None]:
        dp.seconds, t0 = 0.0, now()
        yield
        seconds[name], io[name] = now() - t0, dp.seconds

    timed_gen = Timed(gen, ("generate",), now)
    trainer = DataPlanePolicy(policy, dp)
    start = now()
    with phase("rollout"):
        meta = rollout_to_batch(timed_gen, tokenizer, cfg, dataplane=dp, step=step)
    metrics = {k.removeprefix("rollout/"): v for k, v in meta.extra_info.items() if k.startswith("rollout/")}
    with phase("reference_logprobs"):
        meta = trainer.get_reference_policy_logprobs_from_meta(meta)
    with phase("advantages"):
        meta, _, _ = write_advantages(cfg, dp, meta)
    with phase("update"):  # on-policy: no prev_logprobs, the update's own forward gives them
        trained = update(cfg, trainer, meta, step=step)
    with phase("refit"):  # gather the policy (megatron: shards to rank 0) and copy it in; the path is never read
        policy.prepare_checkpoint(with_trainer_state=False)
        gen.refit(PolicyVersion(step=step, path=base), weights=policy.named_weights())
    with phase("clear"):
        dp.clear(paths.step_partition(step))
    io["clear"] = seconds.pop("clear")
    return {
        "step": step,
        "phases": seconds,
        "dataplane": io,
        "step_s": now() - start,
        "generation_s": timed_gen.seconds,
        "generated_tokens": int(metrics["generated_tokens"]),
        "update_tokens": int(trained["total_num_tokens"]),
        "lengths": list(meta.sequence_lengths),
        "reward": metrics["reward"],
        "loss": trained["loss"],
    }


@contextmanager
def loaded_backends(path: str, cfg: Any) -> Iterator[tuple[Any, Any, Any]]:
    """``(tokenizer, generation back-end, policy back-end)`` built as ``tasks/runtime.py`` builds them, both at
    version 0 (the policy with its optimizer and reference model); shut down on exit."""
    tok = load_tokenizer(path)
    gen = registry.load("generation", cfg.generation.backend)(cfg, tokenizer=tok, model_path=path)
    gen.refit(PolicyVersion(step=0, path=path))
    policy = registry.load("policy", cfg.policy.backend)(cfg, tokenizer=tok, reference_path=path)
    try:
        policy.load_checkpoint(PolicyVersion(step=0, path=path), with_optimizer=True)
        policy.load_reference_policy()
        yield tok, gen, policy
    finally:
        gen.shutdown()
        policy.shutdown()


def run_steps(
    path: str, cfg: Any, backends: tuple[Any, Any, Any], *, repeats: int, now: Callable[[], float]
) -> list[dict[str, Any]]:
    """Run steps 1 .. ``repeats`` with ``backends`` (:func:`loaded_backends`)."""

    from dataplane.client import DataPlane

    tok, gen, policy = backends
    dp = Timed(DataPlane(cfg.dataplane.root, f"bench-step-{uuid.uuid4().hex[:8]}"), DATAPLANE_IO, time.perf_counter)
    steps = []
    for k in range(1, repeats + 1):
        steps.append(grpo_step(k, cfg=cfg, tokenizer=tok, gen=gen, policy=policy, dp=dp, now=now, base=path))
        print(f"[bench.step] step {k}: {steps[-1]['step_s']:.3f} s", file=sys.stderr, flush=True)
    return steps


def step_prompts(cfg: Any, tok: Any, step: int, count: int) -> list[list[int]]:
    """Prompt token ids of training step ``step`` (problems ``(step - 1) * count ..``), as the rollout makes them."""
    d = cfg.data
    problems = train_problems(
        dataset=d.dataset,
        dataset_kwargs=d.dataset_kwargs,
        seed=d.seed,
        val_fraction=d.val_fraction,
        start=(step - 1) * count,
        count=count,
    )
    return [prompt_token_ids(tok, p.question, d.system_prompt) for p in problems]


def padded_prompts(prompts: list[list[int]], index: int) -> list[list[int]]:
    """``prompts`` lengthened as user data would be: prompt j by ``index + 1 + j % 8`` tokens (its first token
    repeated), so that a batch needs padding and each cold set ``index`` has widths no earlier set had (the default
    chain_sum prompts are all one length: a batch without padding, and one shape every step)."""
    return [p[:1] * (index + 1 + j % 8) + p for j, p in enumerate(prompts)]


def decode_comparison(
    args: argparse.Namespace, path: str, cfg: Any, backends: tuple[Any, Any, Any], *, cuda: bool, now: Any
) -> dict[str, Any]:
    """``bench/decode_calls.py``'s comparison, with the back-ends loaded: ``generate``, ``ours`` and ``ours[<pin>]``
    for each pin of ``--pins`` other than the back-end's; the prompts of the steps after ``--repeats``."""
    from bench.decode_calls import compare, generate_side, ours_side
    from rl.backends.hf.sdpa import DECODE_PIN, PINS
    from rl.precision import resolve

    tok, gen, _ = backends
    pins = (args.pins or ",".join(p for p in PINS if p != "torch") if cuda else args.pins or "").split(",")
    pins = [p for p in pins if p and p != DECODE_PIN] if args.generation_backend == "transformers" else []
    bf16 = resolve(args.precision, "cuda" if cuda else "cpu") == "bfloat16"  # the baseline in the precision ours runs
    baseline, close = generate_side(path, group=args.group, max_new_tokens=args.max_new_tokens, cuda=cuda, bf16=bf16)
    sides = {"generate": baseline, "ours": ours_side(gen, cfg, group=args.group)}
    sides |= {f"ours[{p}]": ours_side(gen, cfg, group=args.group, pin=p) for p in pins}
    first = args.repeats + 1  # the steps after the timed ones: prompts no side saw
    cold = [
        padded_prompts(step_prompts(cfg, tok, first + 1 + i, args.prompts), i) for i in range(args.calls * len(sides))
    ]
    try:
        return compare(
            sides,
            warm_prompts=step_prompts(cfg, tok, first, args.prompts),
            cold_prompts=cold,
            calls=args.calls,
            now=now,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    finally:
        close()


def summarize(steps: list[dict[str, Any]], shape: dict[str, int], *, cuda: bool) -> dict[str, Any]:
    """Medians over the steps after the warm-up (over the only step when there is one); adds each step's
    ``update_flops`` in place of its row ``lengths``."""

    timed = steps[1:] or steps

    def med(f: Callable[[dict[str, Any]], float]) -> float:
        return statistics.median(f(s) for s in timed)

    for s in steps:  # sum_i (6 N + 12 L H S_i) S_i over the update's rows
        s["update_flops"] = sum(
            (6 * shape["params"] + 12 * shape["layers"] * shape["hidden"] * x) * x for x in s.pop("lengths")
        )
    peak = None
    if cuda or os.environ.get("GRPOFLOW_PEAK_TFLOPS"):
        try:
            peak = peak_flops()
        except RuntimeError as err:  # an unknown GPU
            print(f"[bench.step] MFU n/a: {err}", file=sys.stderr)
    return {
        "phases": {p: med(lambda s, p=p: s["phases"][p]) for p in PHASES},
        "dataplane": {p: med(lambda s, p=p: s["dataplane"][p]) for p in (*PHASES, "clear")},
        "generation_s": med(lambda s: s["generation_s"]),
        "generated_tokens": statistics.median_low(s["generated_tokens"] for s in timed),
        "step_gen_tok_per_s": med(lambda s: s["generated_tokens"] / s["generation_s"]),
        "update_tokens": statistics.median_low(s["update_tokens"] for s in timed),
        "update_tok_per_s": med(lambda s: s["update_tokens"] / s["phases"]["update"]),
        "update_mfu": None if peak is None else med(lambda s: s["update_flops"] / s["phases"]["update"]) / peak,
        "step_s": med(lambda s: s["step_s"]),
        "warmup_step_s": steps[0]["step_s"] if len(steps) > 1 else None,
        "timed_steps": len(timed),
    }


def decode_figures(decode: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline ratios of a comparison: ours / generate, warm and cold (medians)."""
    ours, base = decode["ours"], decode["generate"]
    return {
        "gen_tok_per_s": ours["warm"]["tok_per_s"],
        "baseline_tok_per_s": base["warm"]["tok_per_s"],
        "gen_vs_baseline": ours["warm"]["tok_per_s"] / base["warm"]["tok_per_s"],
        "cold_gen_tok_per_s": ours["cold"]["tok_per_s"],
        "cold_baseline_tok_per_s": base["cold"]["tok_per_s"],
        "cold_gen_vs_baseline": ours["cold"]["tok_per_s"] / base["cold"]["tok_per_s"],
    }


def table(r: dict[str, Any]) -> str:
    step, io = r["step_s"], r["dataplane"]
    mfu = "n/a" if r["update_mfu"] is None else f"{r['update_mfu']:.1%}"
    warm = "no warm-up: one step" if r["warmup_step_s"] is None else f"after a {r['warmup_step_s']:.2f} s warm-up step"
    lora = r.get("lora")
    training = "full fine-tuning" if not lora else f"LoRA {lora_label(lora)}"
    lines = [
        f"# One GRPO step: {r['generation_backend']} generation ({r['loop']} loop), {r['policy_backend']} policy, "
        f"{training} ({r['device']}: {r['device_name']}, torch {r['torch']})",
        "",
        f"`{r['command']}`",
        "",
        f"Model {r['shape']} ({r['params'] / 1e6:.1f}M parameters), "
        f"B x G x T = {r['prompts']} x {r['group']} x {r['max_new_tokens']}, "
        f"precision {r['precision_requested']} -> {r['precision']}; "
        f"median of {r['timed_steps']} step(s), {warm}.",
        "",
        "| phase | s (median) | share of step | data plane inside (s) |",
        "|---|---|---|---|",
        *[f"| {p} | {r['phases'][p]:.3f} | {r['phases'][p] / step:.0%} | {io[p]:.3f} |" for p in PHASES],
        f"| clear the partition | {io['clear']:.3f} | {io['clear'] / step:.0%} | {io['clear']:.3f} |",
        f"| **step** | **{step:.3f}** | 100% | {sum(io.values()):.3f} |",
        "",
        "| figure | value |",
        "|---|---|",
        f"| generated tokens (rollout) | {r['generated_tokens']:,} in {r['generation_s']:.3f} s of generate, "
        f"{r['step_gen_tok_per_s']:,.0f} tok/s (new prompts every step) |",
        f"| update tokens (sum of input_lengths), tok/s | {r['update_tokens']:,}, {r['update_tok_per_s']:,.0f} |",
        f"| update MFU | {mfu} |",
    ]
    if "trainable_params" in r:
        peak = r["peak_memory_gib"]
        lines += [
            f"| trainable parameters | {r['trainable_params']:,} ({r['trainable_params'] / r['params']:.2%}) |",
            f"| peak memory of the steps ({r['peak_memory_source']}) | "
            + ("n/a" if peak is None else f"{peak:.2f} GiB")
            + " |",
        ]
    ckpt = r.get("checkpoint")
    if ckpt:
        lines.append(
            f"| checkpoint with trainer state | {ckpt['bytes'] / 2**20:,.1f} MiB (trainer state "
            f"{ckpt['trainer_state_bytes'] / 2**20:,.1f} MiB), saved in {ckpt['save_s']:.3f} s "
            f"(median of {len(ckpt['save_s_all'])}) |"
        )
    decode = r.get("decode")
    if decode:
        sdpa = r.get("sdpa") or {}
        lines += [
            "",
            f"Decode, side by side in this process with the back-ends loaded, each side warmed once at the timed "
            f"shape, {r['calls']} timed calls each (tok/s, median [min - max]); cuDNN {sdpa.get('cudnn_version')}, "
            f"our SDPA pin `{sdpa.get('decode_pin')}`:",
            "",
            "| decoder | SDPA kernel of a decode step | warm tok/s | warm / generate | cold tok/s | cold / generate |",
            "|---|---|---|---|---|---|",
        ]
        base = decode["generate"]
        for name, d in decode.items():
            pin = "torch" if name == "generate" else name[5:-1] if name.startswith("ours[") else sdpa.get("decode_pin")
            choice = (sdpa.get("choice") or {}).get(pin, "n/a")
            if "error" in d:
                lines.append(f"| {name} | {choice} | failed: {d['error']} | | | |".replace("\n", " "))
                continue
            cells = []
            for phase in ("warm", "cold"):
                x = d[phase]
                cells += [
                    f"{x['tok_per_s']:,.0f} [{x['min']:,.0f} - {x['max']:,.0f}]",
                    f"{x['tok_per_s'] / base[phase]['tok_per_s']:.2f}",
                ]
            lines.append(f"| {name} | {choice} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def lora_label(lora: dict[str, Any]) -> str:
    """``r=16 alpha=32 all-linear``: a ``policy.lora`` mapping in a line."""
    return f"r={lora['rank']} alpha={lora['alpha']:g} {','.join(lora['target_modules'])}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cuda, now = select_device(args.device)

    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        workdir = Path(args.workdir or tmp)
        path = model_path(args, workdir)
        reset_peak_memory(cuda)  # a random model just built here is no part of the step's memory
        cfg = config_from_dict(
            {
                "model": {"name": path, "precision": args.precision},
                "grpo": {"num_prompts_per_step": args.prompts, "num_generations_per_prompt": args.group},
                "generation": {
                    "backend": args.generation_backend,
                    "max_new_tokens": args.max_new_tokens,
                    "cuda_graphs": args.cuda_graphs,
                },
                "policy": {"backend": args.policy_backend, "lora": lora_settings(args)},
                "dataplane": {"root": str(workdir / "dataplane")},
            }
        )
        shape = model_shape(path)
        with loaded_backends(path, cfg) as backends:
            steps = run_steps(path, cfg, backends, repeats=args.repeats, now=now)
            record = describe(args, argv, path=path, cuda=cuda, params=shape["params"], gen=backends[1])
            record |= summarize(steps, shape, cuda=cuda)
            record |= {
                "lora": lora_settings(args),
                "trainable_params": trainable_params(backends[2]),
                "peak_memory_gib": peak_memory_gib(cuda),
                "peak_memory_source": "torch.cuda.max_memory_allocated" if cuda else "VmHWM",
            }
            emit(args, record | {"partial": True, "steps": steps})
            if args.saves:
                workdir.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(prefix="checkpoints-", dir=workdir) as root:
                    ckpt = time_saves(backends[2], Path(root), count=args.saves, step=args.repeats, now=now)
                record["checkpoint"] = ckpt
            record["steps"] = steps
            if not args.no_decode:
                decode = decode_comparison(args, path, cfg, backends, cuda=cuda, now=now)
                record |= {"decode": decode, "calls": args.calls} | decode_figures(decode)
    text = table(record)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    emit(args, record)
    return record


def emit(args: argparse.Namespace, record: dict[str, Any]) -> None:
    """Append ``record`` to ``--json`` as one line."""
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(record) + "\n")


def describe(
    args: argparse.Namespace, argv: list[str] | None, *, path: str, cuda: bool, params: int, gen: Any
) -> dict[str, Any]:
    """What ran where: device, versions, model, shape of the step, the decode loop and SDPA kernels, the command."""

    import torch
    import transformers

    from rl.precision import resolve

    return {
        "device": "cuda" if cuda else "cpu",
        "device_name": torch.cuda.get_device_name() if cuda else _cpu_name() or platform.machine(),
        "torch": torch.__version__,
        "shape": args.random_shape or Path(path).name,
        "params": params,
        "prompts": args.prompts,
        "group": args.group,
        "max_new_tokens": args.max_new_tokens,
        "precision": resolve(args.precision, "cuda" if cuda else "cpu"),
        "precision_requested": args.precision,
        "generation_backend": args.generation_backend,
        "policy_backend": args.policy_backend,
        "cuda_graphs": args.cuda_graphs,
        "loop": gen._loop() if hasattr(gen, "_loop") else args.generation_backend,
        "transformers": transformers.__version__,
        "sdpa": sdpa_record(gen, cuda=cuda, max_new_tokens=args.max_new_tokens, rows=args.prompts * args.group),
        "command": shlex.join(["python", "-m", "bench.step", *(sys.argv[1:] if argv is None else argv)]),
    }


def sdpa_record(gen: Any, *, cuda: bool, max_new_tokens: int, rows: int) -> dict[str, Any]:
    """cuDNN's version, our decode pin, and the SDPA kernel torch picks under each pin for a decode step of ``rows``
    rows half-way through a completion (keys: 128 prompt positions + ``max_new_tokens`` / 2)."""
    import torch

    from rl.backends.hf.sdpa import DECODE_PIN, PINS, cudnn_version, decode_choice, pinned

    record: dict[str, Any] = {"cudnn_version": cudnn_version(), "decode_pin": DECODE_PIN, "choice": {}}
    model = getattr(gen, "_model", None)
    if not cuda or model is None:
        return record
    c, device = model.config, torch.device("cuda")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    for name in PINS:
        with pinned(device, name):
            record["choice"][name] = _choice_or_error(
                decode_choice,
                device,
                rows=rows,
                heads=c.num_attention_heads,
                head_dim=head_dim,
                keys=128 + max_new_tokens // 2,
                dtype=next(model.parameters()).dtype,
            )
    return record


def _choice_or_error(choice: Callable[..., str], *args: Any, **kwargs: Any) -> str:
    """``choice(...)``, or the error it raised as text: the kernel's name is a label of the figures, and a torch
    whose private dispatcher query differs must not stop the benchmark."""
    try:
        return choice(*args, **kwargs)
    except (RuntimeError, TypeError, AttributeError) as err:
        return f"unknown ({type(err).__name__}: {err})"[:120]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


if __name__ == "__main__":
    main()
