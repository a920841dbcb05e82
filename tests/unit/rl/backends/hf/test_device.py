"""The transformers back-end on an accelerator, checked on the CPU (`tests/fake_device.py`): no host tensor meets a
device tensor in the logprob, loss, update and decode paths; the device is read once per call or step (decode: once
per ``SYNC_EVERY`` tokens); batches go up in pinned, non-blocking copies; and the numbers equal a plain CPU run's.

A real GPU runs the same paths in ``tests/gpu/test_device.py`` (``scripts/gpu_check.sh``)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import rl.backends.hf.static_decode as static
from rl.backends.hf.decode import SYNC_EVERY, generate
from rl.backends.hf.generation import HFGeneration
from rl.backends.hf.logprobs import batched_logprobs
from rl.backends.hf.model import load_model
from rl.backends.hf.policy import HFPolicy
from rl.backends.hf.sampling import DecodeSettings
from rl.backends.hf.train import make_optimizer, train_on_batch
from rl.backends.interfaces import PolicyVersion
from rl.config import config_from_dict
from rl.model import load_tokenizer
from rl.precision import device_generator
from tests.fake_device import DEVICE, DeviceMismatch, fake_device, move
from tests.helpers import grouped_batch


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    return grouped_batch(8, 12, 5, seed)  # 8 rows of <= 12 tokens, groups of 4 sharing a 5-token prompt


def _on_device(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` on the fake device (inside a :func:`fake_device` block)."""
    return move(copy.deepcopy(model), DEVICE)


def test_the_fake_device_catches_a_host_tensor_meeting_a_device_tensor():
    """The guard itself: the bug CUDA first showed (``arange < input_lengths[:, None]`` with the lengths on the GPU),
    a host generator drawing device numbers, and what it records (a device read, a pinned non-blocking upload)."""
    with fake_device() as dev:
        lengths = torch.tensor([3, 5]).to(DEVICE)
        with pytest.raises(DeviceMismatch, match="device tensors met host tensors of shapes"):
            torch.arange(6)[None, :] < lengths[:, None]
        with pytest.raises(DeviceMismatch, match="a host generator draws device numbers"):
            torch.rand(2, device=DEVICE, generator=torch.Generator().manual_seed(0))
        assert (torch.arange(6, device=DEVICE)[None, :] < lengths[:, None]).sum().item() == 8  # 3 + 5
        torch.ones(4).pin_memory().to(DEVICE, non_blocking=True)
    assert [s.op for s in dev.syncs] == ["aten._local_scalar_dense.default"]
    assert dev.uploads[-1].non_blocking and dev.uploads[-1].pinned and dev.uploads[-1].shape == (4,)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_logprobs_stay_on_the_device_read_once_and_equal_the_cpu(tiny_model_dir, attention):
    """One read per call with either attention (from a 2D padding mask, transformers' SDPA path would read the mask on
    the host every forward: the prefix forward goes without one on a device, causal attention sufficing)."""

    model = load_model(tiny_model_dir, attention, device="cpu")
    b = _batch()
    args = (b["input_ids"], b["input_lengths"], b["token_mask"])
    expected = batched_logprobs(model, *args, batch_size=3, precision="float32")  # [8, 12]
    with fake_device() as dev:
        on_device = _on_device(model)
        got = batched_logprobs(on_device, *args, batch_size=3, precision="float32")
    assert got.device.type == "cpu"
    assert (
        torch.equal(got, expected) if attention == "eager" else torch.allclose(got, expected, atol=1e-5)
    )  # SDPA: causal kernel
    assert len(dev.syncs) == 1 and dev.syncs[0].shape == (8, 12)  # the result, once: three micro-batches, no reads
    plans = [u for u in dev.uploads if "rl/precision.py:" in u.where]
    assert plans and all(u.non_blocking and u.pinned for u in plans)


@pytest.mark.parametrize("updates", [1, 2])
def test_the_update_runs_on_the_device_reads_once_per_step_and_equals_the_cpu(tiny, updates):
    """Loss, metrics and updated weights equal the CPU's (the CPU runs torch's deterministic mode and the row-wise
    embedding gradient, the device neither: same maths, float rounding apart), with one device read per step."""

    model, _ = tiny
    cfg = config_from_dict(
        {
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4},
            "model": {"precision": "float32"},
            "optim": {"lr": 1e-3, "train_micro_batch_size": 2, "train_global_batch_size": 8 // updates},
            "loss": {"use_importance_sampling_correction": True, "seq_logprob_error_threshold": 2.0},
        }
    )
    batch = _batch()
    batch["prev_logprobs"] = -torch.rand(8, 12, generator=torch.Generator().manual_seed(9))
    cpu = copy.deepcopy(model)
    opt, sched = make_optimizer(cpu, cfg)
    expected = train_on_batch(cpu, opt, sched, batch, cfg)
    with fake_device() as dev:
        dev_model = _on_device(model)
        opt, sched = make_optimizer(dev_model, cfg)
        got = train_on_batch(dev_model, opt, sched, batch, cfg)
        syncs = [s.where.split(" ")[-1] for s in dev.syncs]
        move(dev_model, "cpu")
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert math.isclose(got[k], v, rel_tol=1e-5, abs_tol=1e-7) or (math.isnan(v) and math.isnan(got[k])), k
    for (name, a), b in zip(cpu.named_parameters(), dev_model.parameters(), strict=True):
        assert (a - b).abs().max().item() < 1e-6, name
    assert syncs == ["read_step"]  # 4 micro-batches x updates, one read


def test_an_update_without_rows_on_this_rank_keeps_its_gradient_norm_on_the_device(tiny):
    """A rank whose share of a global update is empty has no gradients; ``clip_grad_norm_`` then returns a host 0, which
    must join the step's other figures on the device (CUDA refuses a host tensor in ``torch.stack``, 0-dim or not)."""

    model, _ = tiny
    cfg = config_from_dict({"model": {"precision": "float32"}, "optim": {"train_micro_batch_size": 4}})
    batch = _batch()
    batch["prev_logprobs"] = batch["generation_logprobs"] - 0.1
    with fake_device():
        dev_model = _on_device(model)
        opt, sched = make_optimizer(dev_model, cfg)
        metrics = train_on_batch(dev_model, opt, sched, batch, cfg, update_sizes=[8, 0])
    assert metrics["grad_norm"] > 0 and math.isfinite(metrics["loss"])  # the mean over the two updates' norms


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_decode_samples_on_the_device_with_its_generator(tiny_model_dir, attention):
    """Greedy decode gives the CPU's completions; a seeded device generator gives the same samples twice; the host's
    generator is refused for device sampling; the open rows are read once per ``SYNC_EVERY`` tokens, and nothing else
    is read per token (with a 2D mask, transformers' SDPA path would read the mask every token: one read at prefill)."""

    model, tok = load_model(tiny_model_dir, attention, device="cpu"), load_tokenizer(tiny_model_dir)
    rows = [p for p in ([1, 5, 9, 13], [1, 7, 2]) for _ in range(3)]
    expected = generate(model, tok, rows, max_new_tokens=9, greedy=True)
    with fake_device() as dev:
        on_device = _on_device(model)
        greedy = generate(on_device, tok, rows, max_new_tokens=9, greedy=True)
        reads = [s for s in dev.syncs if s.op == "aten._local_scalar_dense.default"]
        first = generate(on_device, tok, rows, max_new_tokens=9, generator=device_generator(DEVICE, 3))
        again = generate(on_device, tok, rows, max_new_tokens=9, generator=device_generator(DEVICE, 3))
        with pytest.raises(DeviceMismatch, match="host generator"):
            generate(on_device, tok, rows, max_new_tokens=9, generator=torch.Generator().manual_seed(3))
    for a, b in zip(greedy.input_ids, expected.input_ids, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(greedy.generation_logprobs, expected.generation_logprobs, strict=True):
        assert torch.allclose(a, b, atol=1e-3)  # finished rows leave the batch later on a device: float noise
    assert all(torch.equal(a, b) for a, b in zip(first.input_ids, again.input_ids, strict=True))
    assert len(reads) <= -(-9 // SYNC_EVERY) + (attention == "sdpa")  # open-row counts (+ SDPA's prefill mask check)


def test_on_a_device_finished_rows_stay_in_the_batch_until_most_are_done(tiny, monkeypatch):
    """The dynamic loop keeps the batch dimension put on an accelerator: with ``compact_below=0`` no row ever leaves,
    with 1.0 one leaves at the first open-row count after its eos, with the default only once at most half the batch
    is open; the greedy completions are the CPU's in every case."""
    from types import SimpleNamespace

    from transformers import DynamicCache

    from rl.backends.hf.decode import COMPACT_BELOW

    model, tok = tiny
    rows = [p for p in ([1, 5, 9, 13], [1, 7, 2], [1, 4], [1, 9, 9, 6]) for _ in range(2)]  # 8 rows
    free = generate(model, tok, rows, max_new_tokens=12, greedy=True, precision="float32")
    # an "eos" that some rows produce early and others never: the first token of row 0's completion
    eos = free.response_token_ids[0][0]
    ends = SimpleNamespace(pad_token_id=tok.pad_token_id, eos_token_id=eos)
    expected = generate(model, ends, rows, max_new_tokens=12, greedy=True, precision="float32")
    finished = int((~expected.truncated).sum())
    assert 0 < finished < len(rows)
    selects: list[int] = []
    real = DynamicCache.batch_select_indices
    monkeypatch.setattr(
        DynamicCache, "batch_select_indices", lambda self, keep: selects.append(len(keep)) or real(self, keep)
    )
    kept = {}
    with fake_device():
        on_device = _on_device(model)
        for below in (0.0, COMPACT_BELOW, 1.0):
            selects.clear()
            got = generate(
                on_device, ends, rows, max_new_tokens=12, greedy=True, precision="float32", compact_below=below
            )
            assert [x.tolist() for x in got.input_ids] == [x.tolist() for x in expected.input_ids], below
            kept[below] = list(selects)
    assert kept[0.0] == []
    assert kept[1.0] and kept[1.0][-1] >= len(rows) - finished
    assert all(k <= COMPACT_BELOW * len(rows) for k in kept[COMPACT_BELOW])  # compacted only at <= half open


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_static_cache_step_reads_and_copies_nothing_so_a_cuda_graph_can_replay_it(
    tiny_model_dir, attention, monkeypatch
):
    """The static-cache loop (``generation.cuda_graphs``) gives the dynamic loop's greedy completions, and its
    one-token step neither reads the device nor copies from the host: inside a CUDA graph capture either would fail or
    bake a value into the graph. (The capture itself needs CUDA: ``tests/gpu/test_device.py``.)"""

    model, tok = load_model(tiny_model_dir, attention, device="cpu"), load_tokenizer(tiny_model_dir)
    rows = [p for p in ([1, 5, 9, 13], [1, 7, 2]) for _ in range(3)]
    expected = generate(model, tok, rows, max_new_tokens=9, greedy=True, precision="float32")
    per_step = []
    with fake_device() as dev:
        real = static.OneTokenStep._step

        def counted(self):  # noqa: ANN001, ANN202
            before = len(dev.syncs), len(dev.uploads)
            out = real(self)
            per_step.append((len(dev.syncs) - before[0], len(dev.uploads) - before[1]))
            return out

        monkeypatch.setattr(static.OneTokenStep, "_step", counted)
        on_device = _on_device(model)
        got = generate(on_device, tok, rows, max_new_tokens=9, greedy=True, precision="float32", loop="graphs")
        a = generate(
            on_device,
            tok,
            rows,
            max_new_tokens=9,
            precision="float32",
            loop="graphs",
            generator=device_generator(DEVICE, 5),
        )
        b = generate(
            on_device,
            tok,
            rows,
            max_new_tokens=9,
            precision="float32",
            loop="graphs",
            generator=device_generator(DEVICE, 5),
        )
    for x, y in zip(got.input_ids, expected.input_ids, strict=True):
        assert torch.equal(x, y)
    for x, y in zip(got.generation_logprobs, expected.generation_logprobs, strict=True):
        assert torch.allclose(x, y, atol=1e-5)
    assert per_step and set(per_step) == {(0, 0)}
    assert [x.tolist() for x in a.input_ids] == [x.tolist() for x in b.input_ids]
    with pytest.raises(ValueError, match="static-cache decode needs the model stored in its compute dtype"):
        static.decode_static(
            model,
            rows,
            DecodeSettings(
                pad_id=2,
                eos_id=2,
                max_new_tokens=2,
                temperature=1.0,
                top_p=1.0,
                greedy=True,
                precision="bfloat16",
                generator=None,
            ),
            graph=False,
        )


def test_the_back_ends_run_a_rollout_logprobs_update_and_refit_on_the_device(tiny_model_dir):
    """`HFGeneration` and `HFPolicy` end to end on the device: generate, reference and policy logprobs, top-k, an
    update, and a warm refit of the generation copy from the trained weights (device to device)."""

    tok = load_tokenizer(tiny_model_dir)
    cfg = config_from_dict(
        {
            "model": {"precision": "float32"},
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
            "generation": {"max_new_tokens": 5},
            "optim": {"logprob_batch_size": 3, "train_micro_batch_size": 2},
        }
    )
    start = PolicyVersion(step=0, path=tiny_model_dir)
    gen = HFGeneration(cfg, tokenizer=tok, model_path=tiny_model_dir)
    gen.refit(start)
    pol = HFPolicy(cfg, tokenizer=tok, reference_path=tiny_model_dir)
    pol.load_checkpoint(start, with_optimizer=True)
    pol.load_reference_policy()
    with fake_device() as dev:
        for m in (gen._model, pol._model, pol._reference):
            move(m, DEVICE)
        pol._optimizer, pol._scheduler = make_optimizer(pol.model, cfg)  # for the moved parameters
        out = gen.generate([[1, 5, 9], [1, 7]], group_size=2, seed=4)
        lengths = torch.tensor([len(x) for x in out.input_ids])
        width = int(lengths.max())
        batch = {
            "input_ids": torch.stack([torch.nn.functional.pad(x, (0, width - len(x)), value=2) for x in out.input_ids]),
            "input_lengths": lengths,
            "token_mask": torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in out.token_mask]),
            "sample_mask": torch.ones(4, dtype=torch.bool),
            "generation_logprobs": torch.stack(
                [torch.nn.functional.pad(x, (0, width - len(x))) for x in out.generation_logprobs]
            ),
            "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(4, width).contiguous(),
        }
        batch["reference_policy_logprobs"] = pol.get_reference_policy_logprobs(batch)
        prev = pol.get_logprobs(batch)
        top = pol.get_topk_logits(batch, 3)
        pol.prepare_for_training()
        metrics = pol.train(batch)
        pol.finish_training()
        gen.refit(PolicyVersion(step=1, path="unused"), weights=pol.named_weights())
        after = gen.generate([[1, 5, 9]], group_size=2, seed=4)
    assert prev.device.type == "cpu" and prev.shape == batch["input_ids"].shape
    assert torch.allclose(prev[batch["token_mask"]], batch["generation_logprobs"][batch["token_mask"]], atol=1e-4)
    assert top.topk_logits.device.type == "cpu" and top.topk_logits.shape == (4, width - 1, 3)
    assert math.isfinite(metrics["loss"]) and pol.weight_version == 1 and gen.weight_version == 1
    assert len(after.input_ids) == 2
    assert all(u.pinned and u.non_blocking for u in dev.uploads if "rl/precision.py:" in u.where)


def test_a_batch_without_padding_decodes_without_a_mask_on_a_device(tiny, monkeypatch):
    """Prompts of one length leave no key to hide: the device's decode steps pass no mask (transformers then lets SDPA
    take the grouped heads as they are, as its generate does), and give the CPU's greedy completions."""
    import transformers.models.llama.modeling_llama as llama

    model, tok = tiny
    rows = [p for p in ([1, 5, 9, 13], [1, 7, 2, 8]) for _ in range(2)]  # both 4 tokens
    expected = generate(model, tok, rows, max_new_tokens=6, greedy=True, precision="float32")
    masks = []
    real = llama.LlamaModel.forward

    def seen(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        masks.append(kwargs.get("attention_mask"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(llama.LlamaModel, "forward", seen)
    with fake_device():
        got = generate(_on_device(model), tok, rows, max_new_tokens=6, greedy=True, precision="float32")
    assert [x.tolist() for x in got.input_ids] == [x.tolist() for x in expected.input_ids]
    assert masks[0] is not None and all(m is None for m in masks[1:])  # the prefill's padding mask, then none


def test_a_continued_call_reuses_the_kept_kv_on_a_device_and_decodes_as_the_cpu(tiny):
    """A call keeps each row's KV (``kv_out``); a second call whose prompts continue those rows (their tokens, then a
    reply) prefills only the reply (``kv_in``) and gives the greedy completions the CPU gives the whole prompts."""
    from rl.backends.hf.kv_reuse import reusable

    model, tok = tiny
    rows = [[1, 5, 9, 13], [1, 7, 2], [1, 4, 4, 4, 4], [1, 9]]
    with fake_device():
        on_device = _on_device(model)
        kept: list = []
        first = generate(on_device, tok, rows, max_new_tokens=5, greedy=True, precision="float32", kv_out=kept)
        follow = [[*x.tolist(), 3, 8, 6] for x in first.input_ids]  # each row's conversation, then a reply
        assert [reusable(kv, p) for kv, p in zip(kept, follow, strict=True)] == [len(x) - 1 for x in first.input_ids]
        again = generate(on_device, tok, follow, max_new_tokens=5, greedy=True, precision="float32", kv_in=kept)
    expected = generate(model, tok, follow, max_new_tokens=5, greedy=True, precision="float32")
    assert [x.tolist() for x in again.input_ids] == [x.tolist() for x in expected.input_ids]
    for a, b in zip(again.generation_logprobs, expected.generation_logprobs, strict=True):
        assert torch.allclose(a, b, atol=1e-4)
