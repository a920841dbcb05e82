"""The transformers back-end's KV-cached decode loop and its sampler, on a tiny random model with the real tokenizer."""

from __future__ import annotations

import pytest
import torch

from rl.backends.hf.decode import _group_size, generate
from rl.backends.hf.sampling import sample_next


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from rl.backends.hf.model import load_model
    from rl.model import load_tokenizer

    return load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


def test_shared_prompt_prefill_matches_plain_generation(tiny):
    model, tok = tiny
    prompts = [[1, 5, 9, 13], [1, 7, 2]]
    grouped = [p for p in prompts for _ in range(3)]
    assert _group_size(grouped) == 3 and _group_size(prompts) == 1
    shared = generate(model, tok, grouped, max_new_tokens=5, greedy=True)
    plain = [generate(model, tok, [p], max_new_tokens=5, greedy=True) for p in grouped]
    for i, one in enumerate(plain):
        assert torch.equal(shared.input_ids[i], one.input_ids[0])
        assert torch.allclose(
            shared.generation_logprobs[i], one.generation_logprobs[0], atol=1e-3
        )  # float noise of padding


def test_inverse_cdf_sampling_draws_the_temperature_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)  # [n, V]
    expected = torch.softmax(logits[0] / 0.7, -1)  # exp(l/T) / sum: [0.743, 0.178, 0.043, 0.010] (rounded)
    torch.manual_seed(0)
    tokens, lp = sample_next(logits, temperature=0.7, top_p=1.0, greedy=False)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(freq, expected, atol=0.01)  # binomial std at n=20000 is <= 0.0035
    assert torch.allclose(lp, expected.log()[tokens])


def test_top_p_keeps_the_smallest_set_reaching_p_and_greedy_takes_the_argmax():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log()[None].repeat(20000, 1)
    torch.manual_seed(0)
    tokens, lp = sample_next(logits, temperature=1.0, top_p=0.5, greedy=False)
    # cumulative mass before each token: 0, 0.4, 0.7, 0.9 -> tokens 0 and 1 are kept, renormalized to 4/7 and 3/7
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert freq[2:].sum() == 0 and abs(freq[0].item() - 4 / 7) < 0.01
    assert torch.allclose(lp, probs.log()[tokens])  # the logprob before truncation
    top, top_lp = sample_next(logits[:2] * 3.0, temperature=0.5, top_p=0.5, greedy=True)
    assert top.tolist() == [0, 0] and torch.allclose(top_lp, torch.log_softmax(logits[0] * 3.0, -1)[0].expand(2))


def test_a_local_generator_fixes_the_samples_and_leaves_the_global_rng_alone():
    logits = torch.randn(64, 50)
    torch.manual_seed(1)
    before = torch.get_rng_state()
    a, lp_a = sample_next(logits, temperature=1.0, top_p=1.0, greedy=False, generator=torch.Generator().manual_seed(5))
    b, lp_b = sample_next(logits, temperature=1.0, top_p=1.0, greedy=False, generator=torch.Generator().manual_seed(5))
    c, _ = sample_next(logits, temperature=1.0, top_p=1.0, greedy=False, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and torch.equal(lp_a, lp_b) and not torch.equal(a, c)
    assert torch.equal(torch.get_rng_state(), before)


def test_every_loop_and_compaction_gives_the_same_greedy_completions(tiny):
    """The static loop (``loop="static"``; ``"graphs"`` runs it without a graph off CUDA) and the dynamic loop give the
    same greedy completions; on the CPU a finished row leaves at once whatever ``compact_below`` says."""
    model, tok = tiny
    rows = [p for p in ([1, 5, 9, 13], [1, 7, 2]) for _ in range(2)]
    dynamic = generate(model, tok, rows, max_new_tokens=6, greedy=True, precision="float32")
    for kwargs in ({"loop": "static"}, {"loop": "graphs"}, {"compact_below": 0.0}):
        other = generate(model, tok, rows, max_new_tokens=6, greedy=True, precision="float32", **kwargs)
        assert [x.tolist() for x in other.input_ids] == [x.tolist() for x in dynamic.input_ids], kwargs
        for a, b in zip(other.generation_logprobs, dynamic.generation_logprobs, strict=True):
            assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loop": "paged"}, r"unknown decode loop 'paged': use one of \['dynamic', 'static', 'graphs'\]"),
        ({"sdpa_pin": "fast"}, "unknown SDPA pin 'fast'"),
        ({"compact_below": 1.5}, r"compact_below is 1.5: use a share of the batch in \[0, 1\]"),
    ],
)
def test_bad_decode_settings_are_refused_before_decoding(tiny, kwargs, message):
    model, tok = tiny
    with pytest.raises(ValueError, match=message):
        generate(model, tok, [[1, 5]], max_new_tokens=2, **kwargs)


@pytest.mark.parametrize(
    ("graphs", "device", "loop"),
    [
        (None, "cuda", "graphs"),
        (False, "cuda", "dynamic"),
        (True, "cuda", "graphs"),
        (None, "cpu", "dynamic"),
        (True, "cpu", "dynamic"),
    ],
)
def test_the_back_end_picks_its_loop_from_generation_cuda_graphs_and_the_device(monkeypatch, graphs, device, loop):
    """Null: :data:`rl.backends.hf.decode.CUDA_LOOP` on CUDA; the CPU always decodes with the dynamic loop."""
    import rl.backends.hf.generation as hg
    from rl.backends.hf.decode import CUDA_LOOP
    from rl.config import config_from_dict

    gen = hg.HFGeneration(config_from_dict({"generation": {"cuda_graphs": graphs}}), tokenizer=None, model_path="")
    gen._model = torch.nn.Linear(1, 1)
    monkeypatch.setattr(hg, "device_of", lambda _: torch.device(device))
    assert gen._loop() == (CUDA_LOOP if graphs is None and device == "cuda" else loop)
