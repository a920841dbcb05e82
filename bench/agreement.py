"""Does our fast path compute the same GRPO update as the plain Hugging Face computation TRL runs?

    python -m bench.agreement [--samples-per-prompt 32] [--out bench/results/agreement.md]

Three checks on the real model (SmolLM2-135M-Instruct) and real problems, each ours against a plain baseline in
the same run:

1. gradient: one step's batch (8 prompts x 8 completions sampled by ours, rewards, group-mean advantages,
   reference logprobs) and the GRPO loss (token-level, k3 KL, beta 0.01) differentiated three ways: our training
   path (`rl.backends.hf.train.train_on_batch`: shared-prompt forward, packed LM head, row-wise embedding gradients) in
   bfloat16 and in float32, and the plain full-sequence HF forward with `log_softmax` over the vocabulary (as
   TRL computes it) under bf16 autocast; each is compared with the plain forward in float32 (cosine over all
   parameters and per group, norm ratio, share of entries with the same sign);
2. update: one AdamW step (lr 1e-5, grad clip 1) by `train_on_batch` vs by the plain gradient + `torch.optim.AdamW`
   from the same weights: parameter change norms and cosine, and the k3 KL to the initial model that each
   update produces on the batch, measured with bf16 and with float32 forwards;
3. sampling: K completions per prompt for 16 prompts from the initial model with ours (`rl.backends.hf.decode.generate`,
   bf16 and float32) and with transformers `generate` (as TRL calls it, with and without bf16 autocast): mean
   reward, length and truncated share with standard errors.

Prints a markdown report and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from rl.advantages import compute_advantages
from rl.backends.hf.decode import generate
from rl.backends.hf.logprobs import batched_logprobs
from rl.backends.hf.model import load_model
from rl.backends.hf.train import make_optimizer, train_on_batch
from rl.config import config_from_dict
from rl.data import prompt_token_ids, score, train_problems
from rl.loss import kl_penalty
from rl.model import load_tokenizer, resolve_model
from tasks.runtime import set_threads

REPO = Path(__file__).resolve().parents[1]
G = 8


def _rollout_batch(model, tok, cfg, problems, precision: str = "bfloat16"):
    """One step's padded training batch from ours' sampler, as `train_on_batch` takes it."""
    d = cfg.data
    prompts = [prompt_token_ids(tok, p.question, d.system_prompt) for p in problems for _ in range(G)]
    gen = generate(
        model, tok, prompts, max_new_tokens=32, temperature=1.0, batch_size=len(prompts), precision=precision
    )
    texts = tok.batch_decode(gen.response_token_ids, skip_special_tokens=True)
    owners = [p for p in problems for _ in range(G)]
    rewards = torch.tensor([score(p, t, d.dataset, d.dataset_kwargs, d.seed) for p, t in zip(owners, texts)])
    n = len(prompts)
    lengths = torch.tensor([len(x) for x in gen.input_ids])  # [N]
    s = int(lengths.max())
    ids, token_mask, gen_lp = (
        torch.zeros(n, s, dtype=torch.long),
        torch.zeros(n, s, dtype=torch.bool),
        torch.zeros(n, s),
    )
    for i in range(n):
        ids[i, : lengths[i]], token_mask[i, : lengths[i]] = gen.input_ids[i], gen.token_mask[i]
        gen_lp[i, : lengths[i]] = gen.generation_logprobs[i]
    adv, _, _ = compute_advantages(rewards, torch.ones(n, dtype=torch.bool), group_size=G, leave_one_out=False)
    ref = batched_logprobs(model, ids, lengths, token_mask, batch_size=32, precision=precision)
    batch = {
        "input_ids": ids,
        "input_lengths": lengths,
        "generation_logprobs": gen_lp,
        "reference_policy_logprobs": ref,
        "advantages": adv[:, None] * token_mask.float(),
        "token_mask": token_mask,
        "sample_mask": torch.ones(n, dtype=torch.bool),
    }
    return batch, float(rewards.mean())


def _plain_backward(model, batch, *, bf16: bool, beta: float = 0.01) -> None:
    """The GRPO loss as TRL computes it: full padded forward, log_softmax over the vocabulary, micro-batches of 8."""
    ids, lengths, tm = batch["input_ids"], batch["input_lengths"], batch["token_mask"]
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()  # [N, S]
    toks = float(tm[:, 1:].sum())
    model.train()
    for a in range(0, ids.shape[0], 8):
        r = slice(a, a + 8)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids[r], attention_mask=mask[r]).logits[:, :-1].float()  # [8, S-1, V]
        lp = logits.log_softmax(-1).gather(-1, ids[r, 1:, None]).squeeze(-1)  # [8, S-1]
        ratio = torch.exp(lp - lp.detach())
        kl = kl_penalty(lp, batch["reference_policy_logprobs"][r, 1:], "k3")
        loss = ((-batch["advantages"][r, 1:] * ratio + beta * kl) * tm[r, 1:].float()).sum() / toks
        loss.backward()
    model.eval()


class _Capture(torch.optim.Optimizer):
    """An 'optimizer' whose step records the gradients (what `train_on_batch` hands the optimizer)."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.0})
        self.grads: list[torch.Tensor] = []

    def step(self, closure=None) -> None:  # noqa: ARG002
        self.grads = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]]


def _flat(grads: dict[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
    return torch.cat([grads[k].double().flatten() for k in keys])


def _cos(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(x @ y / (x.norm() * y.norm()))


GROUPS = {
    "all parameters": "",
    "embedding (tied LM head)": "embed_tokens",
    "attention q_proj": "q_proj",
    "MLP down_proj": "down_proj",
    "RMSNorm weights": "norm",
}


def check_gradient(path: str, batch: dict, cfg_for) -> list[str]:
    grads: dict[str, dict[str, torch.Tensor]] = {}
    seconds: dict[str, float] = {}
    for precision in ("bfloat16", "float32"):
        model = load_model(path)
        opt = _Capture(list(model.parameters()))
        t0 = time.perf_counter()
        train_on_batch(
            model,
            opt,
            torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0),
            batch,
            cfg_for(precision, max_grad_norm=0.0),
        )
        seconds[f"ours {precision}"] = time.perf_counter() - t0
        grads[f"ours {precision}"] = dict(zip([k for k, _ in model.named_parameters()], opt.grads))
    for bf16 in (True, False):
        model = load_model(path, attn_implementation="sdpa")
        t0 = time.perf_counter()
        _plain_backward(model, batch, bf16=bf16)
        name = "plain HF, bf16 autocast" if bf16 else "plain HF, float32"
        seconds[name] = time.perf_counter() - t0
        grads[name] = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    base = grads["plain HF, float32"]
    keys = list(base)
    lines = [
        "| gradient vs plain HF float32 | "
        + " | ".join(f"cos, {g}" for g in GROUPS)
        + " | norm ratio | same sign | fwd+bwd s |",
        "|---|" + "---:|" * (len(GROUPS) + 3),
    ]
    for name in ("ours bfloat16", "ours float32", "plain HF, bf16 autocast"):
        cos = [
            _cos(_flat(grads[name], ks), _flat(base, ks))
            for ks in ([k for k in keys if sub in k] for sub in GROUPS.values())
        ]
        x, y = _flat(grads[name], keys), _flat(base, keys)
        lines.append(
            f"| {name} | "
            + " | ".join(f"{c:.4f}" for c in cos)
            + f" | {float(x.norm() / y.norm()):.4f} | {float((x.sign() == y.sign()).double().mean()):.4f} | "
            f"{seconds[name]:.1f} |"
        )
    return lines


def check_update(path: str, batch: dict, cfg_for) -> list[str]:
    initial = load_model(path)
    w0 = {k: v.detach().clone() for k, v in initial.named_parameters()}
    cfg = cfg_for("bfloat16", max_grad_norm=1.0)
    ours = load_model(path)
    opt, sched = make_optimizer(ours, cfg)
    train_on_batch(ours, opt, sched, batch, cfg)
    plain = load_model(path, attn_implementation="sdpa")
    _plain_backward(plain, batch, bf16=True)
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
    popt = torch.optim.AdamW(
        plain.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, betas=(0.9, 0.999), eps=1e-8
    )
    popt.step()
    deltas = {
        name: torch.cat([(p.detach() - w0[k]).double().flatten() for k, p in m.named_parameters()])
        for name, m in (("ours", ours), ("plain", plain))
    }
    tm = batch["token_mask"].clone()
    tm[:, 0] = False
    kls = {}
    for name, m in (("ours", ours), ("plain", plain)):
        for precision in ("bfloat16", "float32"):
            args = (batch["input_ids"], batch["input_lengths"], batch["token_mask"])
            lp = batched_logprobs(m, *args, batch_size=32, precision=precision)
            lp0 = batched_logprobs(initial, *args, batch_size=32, precision=precision)
            kls[name, precision] = float(kl_penalty(lp, lp0, "k3")[tm].mean())
    return [
        "| one AdamW step (lr 1e-5, clip 1) | ours (`train_on_batch`, bf16) | plain HF bf16 + torch AdamW |",
        "|---|---:|---:|",
        f"| parameter change norm | {float(deltas['ours'].norm()):.4f} | {float(deltas['plain'].norm()):.4f} |",
        f"| cosine of the two changes | {_cos(deltas['ours'], deltas['plain']):.3f} | |",
        f"| k3 KL to the initial model on the batch, bf16 forward | {kls['ours', 'bfloat16']:.4f} | "
        f"{kls['plain', 'bfloat16']:.4f} |",
        f"| k3 KL to the initial model on the batch, float32 forward | {kls['ours', 'float32']:.4f} | "
        f"{kls['plain', 'float32']:.4f} |",
    ]


def check_sampling(path: str, tok, cfg, k: int) -> list[str]:
    d = cfg.data
    problems = train_problems(
        dataset=d.dataset, dataset_kwargs=d.dataset_kwargs, seed=d.seed, val_fraction=d.val_fraction, start=0, count=16
    )
    prompts = [prompt_token_ids(tok, p.question, d.system_prompt) for p in problems]
    owners = [p for p in problems for _ in range(k)]
    eos = tok.eos_token_id

    def row(name: str, texts: list[str], lengths: list[int], seconds: float) -> str:
        r = torch.tensor([score(p, t, d.dataset, d.dataset_kwargs, d.seed) for p, t in zip(owners, texts)])
        ln = torch.tensor(lengths, dtype=torch.float64)
        se = lambda x: float(x.std() / len(x) ** 0.5)  # noqa: E731
        return (
            f"| {name} | {r.mean():.3f} +- {se(r):.3f} | {ln.mean():.2f} +- {se(ln):.2f} | "
            f"{float((ln >= 32).double().mean()):.3f} | {seconds:.0f} |"
        )

    lines = [
        f"| sampler, {len(owners)} completions (16 prompts x {k}), temperature 1, 32 new tokens | mean "
        "reward +- s.e. | mean length +- s.e. | share at 32 tokens | s |",
        "|---|---:|---:|---:|---:|",
    ]
    model = load_model(path)
    for precision in ("bfloat16", "float32"):
        torch.manual_seed(1)
        t0 = time.perf_counter()
        gen = generate(
            model, tok, [x for x in prompts for _ in range(k)], max_new_tokens=32, batch_size=128, precision=precision
        )
        texts = tok.batch_decode(gen.response_token_ids, skip_special_tokens=True)
        lines.append(
            row(
                f"ours `rl.backends.hf.decode.generate`, {precision}",
                texts,
                gen.response_lengths.tolist(),
                time.perf_counter() - t0,
            )
        )
    hf = load_model(path, attn_implementation="sdpa")
    side = tok.padding_side
    tok.padding_side = "left"
    try:
        for bf16 in (True, False):
            torch.manual_seed(1)
            texts, lengths = [], []
            t0 = time.perf_counter()
            for i in range(0, len(prompts), 4):
                enc = tok.pad({"input_ids": [x for x in prompts[i : i + 4] for _ in range(k)]}, return_tensors="pt")
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    out = hf.generate(
                        **enc,
                        do_sample=True,
                        temperature=1.0,
                        top_k=0,
                        top_p=1.0,
                        max_new_tokens=32,
                        pad_token_id=tok.pad_token_id,
                        eos_token_id=eos,
                    )
                for completion in out[:, enc["input_ids"].shape[1] :].tolist():
                    n = completion.index(eos) + 1 if eos in completion else len(completion)
                    lengths.append(n)
                    texts.append(tok.decode(completion[:n], skip_special_tokens=True))
            name = "transformers `generate` (TRL's path), " + ("bf16 autocast" if bf16 else "float32")
            lines.append(row(name, texts, lengths, time.perf_counter() - t0))
    finally:
        tok.padding_side = side
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--samples-per-prompt", type=int, default=32, help="K completions per prompt in the sampling check"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the rollout that makes the training batch")
    parser.add_argument("--out", default="bench/results/agreement.md")
    args = parser.parse_args()

    set_threads()
    path = resolve_model("SmolLM2-135M-Instruct")
    tok = load_tokenizer(path)

    def cfg_for(precision: str, *, max_grad_norm: float):
        return config_from_dict(
            {"model": {"name": path, "precision": precision}, "optim": {"max_grad_norm": max_grad_norm}}
        )

    cfg = cfg_for("bfloat16", max_grad_norm=1.0)
    d = cfg.data
    problems = train_problems(
        dataset=d.dataset, dataset_kwargs=d.dataset_kwargs, seed=d.seed, val_fraction=d.val_fraction, start=0, count=8
    )
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    batch, reward = _rollout_batch(load_model(path), tok, cfg, problems)
    print(f"[agreement] batch: {batch['input_ids'].shape[0]} samples, reward {reward:.3f}", flush=True)
    sections = [
        ("Gradient of one step's GRPO loss", check_gradient(path, batch, cfg_for)),
        ("One optimizer update", check_update(path, batch, cfg_for)),
        ("Sampling distribution of the initial model", check_sampling(path, tok, cfg, args.samples_per_prompt)),
    ]
    text = [
        "# Ours vs the plain Hugging Face computation: gradient, update, sampling",
        "",
        f"Command: `python -m bench.agreement --samples-per-prompt {args.samples_per_prompt} --seed {args.seed}` "
        f"({(time.perf_counter() - t0) / 60:.1f} min). Batch: the first step's 8 chain_sum prompts x {G} completions "
        f"sampled by ours (reward {reward:.3f}), group-mean advantages, reference = initial model, k3 KL beta 0.01.",
    ]
    for title, lines in sections:
        text += ["", f"## {title}", "", *lines]
    out = "\n".join(text)
    print(out)
    target = REPO / args.out
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(out + "\n")


if __name__ == "__main__":
    main()
