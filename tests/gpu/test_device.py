"""The transformers back-end on a real CUDA GPU against the same code on the CPU (float32, a tiny random Llama with the
real tokenizer): logprobs, an update, greedy decode and seeded sampling, and the generation copy's bf16/SDPA setup.
Marked ``gpu``: skipped where there is no CUDA device (CI, where ``tests/unit/rl/backends/hf/test_device.py`` checks the
same paths on a fake device). ``scripts/gpu_check.sh`` runs it."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rl.config import config_from_dict
from tests.helpers import grouped_batch

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from rl.backends.hf.model import load_model
    from rl.model import load_tokenizer

    torch.backends.cuda.matmul.allow_tf32 = False  # compare float32 with float32
    return (
        load_model(tiny_model_dir, device="cpu"),
        load_model(tiny_model_dir, device=CUDA),
        load_tokenizer(tiny_model_dir),
    )


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    return grouped_batch(16, 40, 12, seed)  # 16 rows of <= 40 tokens, groups of 4 sharing a 12-token prompt


def test_logprobs_on_cuda_equal_the_cpu(tiny):
    from rl.backends.hf.logprobs import batched_logprobs

    cpu, gpu, _ = tiny
    b = _batch()
    args = (b["input_ids"], b["input_lengths"], b["token_mask"])
    expected = batched_logprobs(cpu, *args, batch_size=6, precision="float32")
    got = batched_logprobs(gpu, *args, batch_size=6, precision="float32")
    assert got.device.type == "cpu"
    print(f"max |cuda - cpu| logprob: {(got - expected).abs().max().item():.2e}")
    assert torch.allclose(got, expected, atol=1e-4)


def test_an_update_on_cuda_equals_the_cpu(tiny):
    from rl.backends.hf.train import make_optimizer, train_on_batch

    cpu, gpu, _ = tiny
    cfg = config_from_dict(
        {
            "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4},
            "model": {"precision": "float32", "tf32": False},  # IEEE float32 on both sides (TF32 differs by ~3e-5 here)
            "optim": {"lr": 1e-3, "train_micro_batch_size": 4, "train_global_batch_size": 8},
        }
    )
    batch = _batch()
    batch["prev_logprobs"] = batch["generation_logprobs"] - 0.01  # two updates: pi_old is given
    results = []
    for model in (copy.deepcopy(cpu), copy.deepcopy(gpu)):
        opt, sched = make_optimizer(model, cfg)
        results.append((model, train_on_batch(model, opt, sched, batch, cfg)))
    (a, ma), (b, mb) = results
    for k, v in ma.items():
        assert math.isclose(mb[k], v, rel_tol=1e-4, abs_tol=1e-6), (k, v, mb[k])
    worst = max((p - q.cpu()).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))
    print(f"max |cuda - cpu| weight after 2 updates: {worst:.2e}")
    assert worst < 1e-5


def test_greedy_decode_on_cuda_scores_its_tokens_as_the_cpu_forward_does(tiny):
    """CUDA's greedy completions, teacher-forced through the CPU's forward, get the logprobs CUDA reported (comparing
    tokens directly would fail on a near-tie of two logits, which float32 rounding may break either way)."""
    from rl.backends.hf.decode import generate
    from rl.backends.hf.logprobs import forward_logprobs

    cpu, gpu, tok = tiny
    rows = [p for p in ([1, 5, 9, 13, 17], [1, 7, 2, 8]) for _ in range(4)]
    out = generate(gpu, tok, rows, max_new_tokens=24, greedy=True)
    lengths = torch.tensor([len(x) for x in out.input_ids])
    width = int(lengths.max())
    ids = torch.stack([torch.nn.functional.pad(x, (0, width - len(x)), value=2) for x in out.input_ids])
    mask = torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in out.token_mask])
    reported = torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in out.generation_logprobs])
    with torch.no_grad():
        teacher = forward_logprobs(cpu, ids, lengths, precision="float32", token_mask=mask)
    assert torch.allclose(
        reported[mask], teacher[mask], atol=5e-3
    )  # left- vs right-padded, cached vs full: float noise


def test_sampling_on_cuda_is_fixed_by_the_seed(tiny):
    from rl.backends.hf.decode import generate
    from rl.precision import device_generator

    _, gpu, tok = tiny
    rows = [[1, 5, 9, 13]] * 8

    def sample(seed: int) -> list[list[int]]:
        return generate(gpu, tok, rows, max_new_tokens=16, generator=device_generator(CUDA, seed)).response_token_ids

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_the_generation_copy_is_bf16_with_sdpa_and_agrees_with_the_trainer(tiny_model_dir):
    """With ``precision: auto`` on a GPU the generation copy holds bf16 weights and SDPA attention, the decode batch is
    sized from free memory, and its logprobs agree with the trainer's mixed-precision forward (token_mult_prob_error,
    NeMo-RL's metric: 1.0 is exact)."""
    from rl.backends.hf.decode import default_batch_size
    from rl.backends.hf.generation import HFGeneration
    from rl.backends.hf.policy import HFPolicy
    from rl.backends.interfaces import PolicyVersion
    from rl.model import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    cfg = config_from_dict({"generation": {"max_new_tokens": 16}, "optim": {"logprob_batch_size": 8}})
    start = PolicyVersion(step=0, path=tiny_model_dir)
    gen = HFGeneration(cfg, tokenizer=tok, model_path=tiny_model_dir)
    gen.refit(start)
    model = gen._model
    assert next(model.parameters()).dtype == torch.bfloat16 and model.config._attn_implementation == "sdpa"
    assert default_batch_size(model, 64) >= 64
    out = gen.generate([[1, 5, 9, 13], [1, 7, 2, 8]], group_size=4, seed=1)
    pol = HFPolicy(cfg, tokenizer=tok, reference_path=tiny_model_dir)
    pol.load_checkpoint(start, with_optimizer=False)
    lengths = torch.tensor([len(x) for x in out.input_ids])
    width = int(lengths.max())
    batch = {
        "input_ids": torch.stack([torch.nn.functional.pad(x, (0, width - len(x)), value=2) for x in out.input_ids]),
        "input_lengths": lengths,
        "token_mask": torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in out.token_mask]),
    }
    train_lp = pol.get_logprobs(batch)
    gen_lp = torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in out.generation_logprobs])
    mask = batch["token_mask"]
    error = torch.exp((train_lp - gen_lp).abs())[mask].mean().item()
    print(f"token_mult_prob_error (bf16 generation copy vs mixed-precision trainer): {error:.4f}")
    assert error < 1.05


def test_the_cuda_graph_decode_replays_the_eager_static_loop(tiny):
    """``generation.cuda_graphs``: the captured one-token step gives what the same static loop gives launched op by op
    (greedy and seeded sampling), and the generation copy runs it in bf16."""
    from rl.backends.hf.sampling import DecodeSettings
    from rl.backends.hf.static_decode import decode_static
    from rl.precision import device_generator

    _, gpu, tok = tiny
    rows = [p for p in ([1, 5, 9, 13, 17], [1, 7, 2, 8]) for _ in range(4)]
    common = {
        "pad_id": tok.pad_token_id,
        "eos_id": tok.eos_token_id,
        "max_new_tokens": 24,
        "temperature": 1.0,
        "top_p": 1.0,
        "precision": "float32",
    }
    eager = decode_static(gpu, rows, DecodeSettings(**common, greedy=True, generator=None), graph=False)
    graphed = decode_static(gpu, rows, DecodeSettings(**common, greedy=True, generator=None), graph=True)
    assert torch.equal(eager[0], graphed[0]) and torch.allclose(eager[1], graphed[1], atol=1e-5)
    sampled = [
        decode_static(gpu, rows, DecodeSettings(**common, greedy=False, generator=device_generator(CUDA, 3)), graph=g)
        for g in (False, True)
    ]
    assert torch.equal(sampled[0][0], sampled[1][0])


def test_the_generation_back_end_decodes_with_cuda_graphs_in_bf16(tiny_model_dir):
    from rl.backends.hf.generation import HFGeneration
    from rl.backends.interfaces import PolicyVersion
    from rl.model import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    cfgs = [config_from_dict({"generation": {"max_new_tokens": 16, "cuda_graphs": g}}) for g in (False, True)]
    outs = []
    for cfg in cfgs:
        gen = HFGeneration(cfg, tokenizer=tok, model_path=tiny_model_dir)
        gen.refit(PolicyVersion(step=0, path=tiny_model_dir))
        outs.append(gen.generate([[1, 5, 9, 13], [1, 7, 2, 8]], group_size=4, seed=1, greedy=True))
        gen.shutdown()
    plain, graphed = outs
    same = sum(torch.equal(a, b) for a, b in zip(plain.input_ids, graphed.input_ids, strict=True))
    print(
        f"bf16 greedy completions equal with and without CUDA graphs: {same} of {len(plain.input_ids)}"
    )  # bf16 rounding may differ
    assert len(graphed.input_ids) == 8 and int(graphed.response_lengths.min()) >= 1
    assert all(torch.isfinite(x).all() and (x <= 0).all() for x in graphed.generation_logprobs)


def test_the_decode_pin_keeps_cudnn_off_a_decode_step_and_gives_torchs_flags_back(tiny):
    """Under the decode pin torch picks a kernel other than cuDNN's for a masked one-token step; a decode under each
    pin leaves SDPA's flags as it found them, and the pins' greedy completions score alike."""
    from rl.backends.hf.decode import generate
    from rl.backends.hf.sdpa import DECODE_PIN, PINS, decode_choice, pinned

    _, gpu, tok = tiny
    shape = {"rows": 64, "heads": 8, "head_dim": 64, "keys": 300, "dtype": torch.bfloat16}
    with pinned(CUDA, "no_cudnn"):
        assert decode_choice(CUDA, **shape) != "CUDNN_ATTENTION"
    flags = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled())
    rows = [p for p in ([1, 5, 9, 13, 17], [1, 7, 2, 8]) for _ in range(4)]
    outs = {}
    for pin in PINS:
        outs[pin] = generate(gpu, tok, rows, max_new_tokens=16, greedy=True, precision="float32", sdpa_pin=pin)
        assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()) == flags
    same = sum(
        a.tolist() == b.tolist() for a, b in zip(outs["torch"].input_ids, outs[DECODE_PIN].input_ids, strict=True)
    )
    print(f"greedy completions equal under torch's choice and the decode pin: {same} of {len(rows)}")
    assert same >= len(rows) - 2  # float32 kernels may break a near-tie differently


def test_finished_rows_leave_a_cuda_batch_only_when_most_are_done(tiny):
    """On CUDA, compaction at any threshold gives the completions of a batch that keeps every row (greedy)."""
    from types import SimpleNamespace

    from rl.backends.hf.decode import generate

    _, gpu, tok = tiny
    rows = [p for p in ([1, 5, 9, 13], [1, 7, 2], [1, 4], [1, 9, 9, 6]) for _ in range(2)]
    eos = generate(gpu, tok, rows, max_new_tokens=12, greedy=True, precision="float32").response_token_ids[0][0]
    ends = SimpleNamespace(pad_token_id=tok.pad_token_id, eos_token_id=eos)
    outs = [
        generate(gpu, ends, rows, max_new_tokens=12, greedy=True, precision="float32", compact_below=b)
        for b in (0.0, 0.5, 1.0)
    ]
    assert [x.tolist() for x in outs[0].input_ids] == [x.tolist() for x in outs[2].input_ids]
    assert [x.tolist() for x in outs[1].input_ids] == [x.tolist() for x in outs[2].input_ids]


def test_the_grouped_query_decode_gives_the_repeated_heads_completions_on_cuda(tiny_model_dir):
    """On CUDA every decode folds the grouped query heads (`rl.backends.hf.gqa_decode`); in float32 its greedy
    completions are those of transformers' SDPA attention, which repeats the key-value heads, padded or not."""
    from rl.backends.hf.decode import generate
    from rl.backends.hf.model import load_model
    from rl.model import load_tokenizer

    model, tok = load_model(tiny_model_dir, "sdpa", device=CUDA), load_tokenizer(tiny_model_dir)
    for rows in ([p for p in ([1, 5, 9, 13], [1, 7, 2]) for _ in range(4)], [[1, 5, 9, 13]] * 8):
        outs = [
            generate(model, tok, rows, max_new_tokens=16, greedy=True, precision="float32", gqa_decode=g, loop=loop)
            for loop in ("dynamic", "static")
            for g in (False, True)
        ]
        for i in (0, 2):
            same = sum(a.tolist() == b.tolist() for a, b in zip(outs[i].input_ids, outs[i + 1].input_ids, strict=True))
            assert same >= len(rows) - 1, (i, same)  # float32 kernels may break a near-tie differently
        assert model.config._attn_implementation == "sdpa"
