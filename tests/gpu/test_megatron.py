"""The megatron policy back-end on a CUDA GPU, against the transformers back-end on the real SmolLM2-135M-Instruct:
logprob parity (max and mean absolute difference, printed), the same loss and gradient norm on the first update, a loss
that goes down over updates on a fixed batch, and the step time and MFU of both (printed; ``bench/megatron.py`` is the
benchmark). Marked ``gpu``: skipped where there is no CUDA device (CI). The back-end contract itself (checkpoints,
top-k, the data-plane entry points) runs in ``tests/unit/rl/backends/test_conformance.py``, whose megatron parameter is
marked ``gpu`` as well.
"""

from __future__ import annotations

import pytest
import torch

from rl.backends.interfaces import PolicyVersion
from rl.config import config_from_dict

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
pytest.importorskip("megatron.core")

TEXTS = [
    ("What is 4 + 3? Answer with a number.", "4 + 3 = 7. The answer is 7."),
    ("What is 9 - 5? Answer with a number.", "9 - 5 = 4, so the answer is 4."),
    ("Name a prime number.", "Seven is a prime number: it has no divisors other than 1 and itself."),
    ("What is 2 * 6?", "12"),
]


def _cfg(tmp_path, precision: str, backend: str):
    return config_from_dict(
        {
            "model": {"precision": precision},
            "policy": {"backend": backend},
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
            "optim": {"lr": 1e-5, "logprob_batch_size": 4, "train_micro_batch_size": 2, "max_grad_norm": 1.0},
            "dataplane": {"root": str(tmp_path)},
        }
    )


def _batch(tok) -> dict[str, torch.Tensor]:
    """The prompts (chat template) and responses as a right-padded batch, responses masked in, advantages +1/-1."""
    rows, masks = [], []
    for prompt, response in TEXTS:
        p = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        p = list(p["input_ids"] if hasattr(p, "keys") else p)  # a BatchEncoding is no dict
        r = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(p + r)
        masks.append([False] * len(p) + [True] * len(r))
    n, s = len(rows), max(map(len, rows))
    ids = torch.full((n, s), tok.pad_token_id, dtype=torch.int64)
    token_mask = torch.zeros(n, s, dtype=torch.bool)
    for i, (x, m) in enumerate(zip(rows, masks)):
        ids[i, : len(x)], token_mask[i, : len(x)] = torch.tensor(x), torch.tensor(m)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None] * token_mask
    return {
        "input_ids": ids,
        "input_lengths": torch.tensor([len(x) for x in rows]),
        "token_mask": token_mask,
        "sample_mask": torch.ones(n, dtype=torch.bool),
        "advantages": advantages,
    }


def _policies(tmp_path, real_model_dir, precision: str):
    from rl.backends import registry
    from rl.model import load_tokenizer

    tok = load_tokenizer(real_model_dir)
    out = {}
    for name in ("transformers", "megatron"):
        pol = registry.load("policy", name)(
            _cfg(tmp_path, precision, name), tokenizer=tok, reference_path=real_model_dir
        )
        pol.load_checkpoint(PolicyVersion(step=0, path=real_model_dir), with_optimizer=True)
        out[name] = pol
    return tok, out


@pytest.mark.parametrize(("precision", "max_diff", "mean_diff"), [("float32", 2e-3, 2e-4), ("bfloat16", 0.3, 0.03)])
def test_logprobs_match_the_transformers_backend_on_the_real_model(
    tmp_path, real_model_dir, precision, max_diff, mean_diff
):
    tok, pols = _policies(tmp_path, real_model_dir, precision)
    batch = _batch(tok)
    hf, mc = pols["transformers"].get_logprobs(batch), pols["megatron"].get_logprobs(batch)
    mask = batch["token_mask"]
    diff = (hf - mc).abs()[mask]
    print(
        f"\n[megatron parity {precision}] {int(mask.sum())} tokens: max |diff| {float(diff.max()):.2e}, mean "
        f"{float(diff.mean()):.2e} nats"
    )
    assert (mc[~mask] == 0).all() and (mc[mask] < 0).all()
    assert float(diff.max()) < max_diff and float(diff.mean()) < mean_diff
    ref = pols["megatron"].get_reference_policy_logprobs(batch)
    assert torch.equal(ref, mc)  # at step 0 the policy is the reference policy: same weights, same kernels
    top_hf, top_mc = pols["transformers"].get_topk_logits(batch, 5), pols["megatron"].get_topk_logits(batch, 5)
    agree = (top_hf.topk_indices[..., 0] == top_mc.topk_indices[..., 0]).float().mean()
    assert float(agree) > 0.95  # the argmax token agrees almost everywhere (near-ties may swap)


def test_training_matches_the_transformers_backend_and_lowers_the_loss(tmp_path, real_model_dir):
    tok, pols = _policies(tmp_path, real_model_dir, "float32")
    batch = _batch(tok)
    lp = pols["transformers"].get_logprobs(batch)
    batch = {**batch, "prev_logprobs": lp, "reference_policy_logprobs": lp, "generation_logprobs": lp}
    losses: dict[str, list[float]] = {}
    first: dict[str, dict[str, float]] = {}
    for name, pol in pols.items():
        for step in range(3):  # the same batch three times: pi_old stays fixed, so each update should lower the loss
            pol.prepare_for_training()
            metrics = pol.train(batch)  # the loss is measured before the update
            pol.finish_training()
            losses.setdefault(name, []).append(metrics["loss"])
            if step == 0:
                first[name] = metrics
    print(
        f"\n[megatron train] losses {losses}; grad_norm {first['megatron']['grad_norm']:.6f} vs "
        f"{first['transformers']['grad_norm']:.6f}"
    )
    assert first["megatron"]["loss"] == pytest.approx(first["transformers"]["loss"], abs=1e-4)
    assert first["megatron"]["grad_norm"] == pytest.approx(first["transformers"]["grad_norm"], rel=1e-2)
    assert first["megatron"]["global_valid_toks"] == first["transformers"]["global_valid_toks"]
    assert losses["megatron"][2] < losses["megatron"][0]  # the loss before the third update is below the first's
    # after the same updates both back-ends hold (nearly) the same weights, read back under HF names
    hf_weights = dict(pols["transformers"].named_weights())
    worst = max(float((hf_weights[k].float().cpu() - v).abs().max()) for k, v in pols["megatron"].named_weights())
    assert worst < 1e-4, worst


def test_step_time_and_mfu(tmp_path, real_model_dir):
    from bench.megatron import measure

    rows = measure(real_model_dir, batch_rows=64, length=512, steps=3, precision="bfloat16")
    for row in rows:
        print(f"\n[megatron bench] {row}")
        assert 0 < row["mfu"] < 1 and row["step_s"] > 0
