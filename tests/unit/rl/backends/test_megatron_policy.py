"""The megatron policy back-end against the transformers back-end, on CPU through ``tests.megatron_cpu``
(megatron-core's hard-coded CUDA placements moved to the CPU; the GPU tests run it unchanged): one rank, two
tensor-parallel ranks and two pipeline stages (tied embeddings: the last stage's copy is kept in sync) give the same
logprobs, top-k, training metrics and weights as the transformers back-end, and a checkpoint resumes training bit for
bit.

Ranks are real gloo processes (``torch.multiprocessing.spawn``); a tiny random Llama (4 heads, 2 key-value heads, tied,
vocabulary 100 padded to 128) keeps each run to seconds.
"""

from __future__ import annotations

import pytest
import torch

from dataplane import fields as F
from dataplane.client import DataPlane
from dataplane.codec import nested_from_values, pad_nested
from rl.backends.dataplane_policy import DataPlanePolicy
from rl.backends.hf.policy import HFPolicy
from rl.backends.interfaces import PolicyVersion
from rl.backends.megatron.policy import MegatronPolicy
from rl.checkpoint import TrainerState
from rl.config import config_from_dict
from rl.model import load_tokenizer
from rl.rollout import STEP_SCHEMA
from tests.megatron_cpu import megatron_on_cpu

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

UPDATES = [4, 4]
"""Two optimizer updates per step, two micro-batches of 3 and 1 rows each."""


class _Tokenizer:
    pad_token_id = 0

    def save_pretrained(self, folder) -> None:
        del folder


def _cfg(root: str, backend: str, tp: int = 1, pp: int = 1, world: int | None = None, loss: dict | None = None):
    policy = {"backend": backend}
    if backend == "megatron":
        policy |= {
            "nproc_per_node": world or tp * pp,
            "megatron_cfg": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
        }
    return config_from_dict(
        {
            "model": {"precision": "float32"},
            "policy": policy,
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4},
            "optim": {"lr": 1e-3, "train_micro_batch_size": 3, "logprob_batch_size": 3, "max_grad_norm": 1.0},
            "loss": {"reference_policy_kl_penalty": 0.1, **(loss or {})},
            "dataplane": {"root": root},
        }
    )


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([14, 9, 12, 6, 14, 11, 8, 10])
    live = torch.arange(14)[None, :] < lengths[:, None]  # [8, 14]
    token_mask = live & (torch.arange(14)[None, :] >= 4)
    return {
        "input_ids": torch.randint(3, 90, (8, 14), generator=g) * live,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": torch.tensor([True, True, True, True, False, True, True, True]),
        "advantages": torch.randn(8, 1, generator=g) * token_mask,
    }


def _train_batch(logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    batch = _batch()
    return {
        **batch,
        "prev_logprobs": logprobs,
        "reference_policy_logprobs": logprobs - 0.05 * batch["token_mask"],
        "generation_logprobs": logprobs,
    }


def _steps(policy, batch, n: int) -> list[dict[str, float]]:
    out = []
    for _ in range(n):
        policy.prepare_for_training()
        out.append(policy.train(batch, update_sizes=UPDATES))
        policy.finish_training()
    return out


def _megatron_rank(rank: int, world: int, tp: int, pp: int, model_dir: str, folder: str, prev: torch.Tensor) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    with megatron_on_cpu():
        cfg = _cfg(folder, "megatron", tp, pp)
        policy = MegatronPolicy(cfg, tokenizer=_Tokenizer(), reference_path=model_dir)
        policy.load_checkpoint(PolicyVersion(0, model_dir), with_optimizer=True)
        batch = _batch()
        report = {
            "writes": policy.writes_outputs(),
            "logprobs": policy.get_logprobs(batch),
            "topk": policy.get_topk_logits(batch, 4),
        }
        report["reference"] = policy.get_reference_policy_logprobs(batch)
        report["metrics"] = _steps(policy, _train_batch(prev), 2)
        policy.prepare_checkpoint(with_trainer_state=True)
        if rank == 0:
            report["weights"] = dict(policy.named_weights())
            policy.save_checkpoint(f"{folder}/ckpt", trainer_state=TrainerState(step=2, mlflow_run_id="r", extra={}))
        if world > 1:
            dist.barrier()
        resumed = MegatronPolicy(cfg, tokenizer=_Tokenizer(), reference_path=model_dir)
        resumed.load_checkpoint(PolicyVersion(2, f"{folder}/ckpt"), with_optimizer=True)
        for p in (policy, resumed):
            _steps(p, _train_batch(prev), 1)
            p.prepare_checkpoint(with_trainer_state=False)
        if rank == 0:
            report["continued"], report["resumed"] = dict(policy.named_weights()), dict(resumed.named_weights())
    torch.save(report, f"{folder}/rank{rank}.pt")
    if world > 1:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("tiny") / "model"
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def transformers_backend(model_dir, tmp_path_factory) -> dict:
    """The reference: the transformers back-end on the same batch and updates, in this process."""

    policy = HFPolicy(
        _cfg(str(tmp_path_factory.mktemp("hf")), "transformers"), tokenizer=_Tokenizer(), reference_path=model_dir
    )
    policy.load_checkpoint(PolicyVersion(0, model_dir), with_optimizer=True)
    batch = _batch()
    out = {"logprobs": policy.get_logprobs(batch), "topk": policy.get_topk_logits(batch, 4)}
    out["metrics"] = _steps(policy, _train_batch(out["logprobs"]), 2)
    out["weights"] = dict(policy.named_weights())
    return out


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)])
def test_megatron_matches_the_transformers_backend_and_resumes_exactly(
    model_dir, transformers_backend, tmp_path, tp, pp
):
    import torch.multiprocessing as mp

    hf = transformers_backend
    world = tp * pp
    mp.spawn(_megatron_rank, args=(world, tp, pp, model_dir, str(tmp_path), hf["logprobs"]), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    writers = [r for r in ranks if r["writes"]]
    assert len(writers) == 1  # one rank writes the replica's logprobs: tensor-parallel rank 0 of the last stage
    mine = writers[0]
    assert (
        torch.allclose(mine["logprobs"], hf["logprobs"], atol=1e-5)
        and (mine["logprobs"][~_batch()["token_mask"]] == 0).all()
    )
    assert torch.equal(mine["reference"], mine["logprobs"])  # step 0: the policy is the reference policy
    assert torch.allclose(mine["topk"].topk_logits, hf["topk"].topk_logits, atol=1e-5)
    assert torch.equal(mine["topk"].topk_indices, hf["topk"].topk_indices)
    for r in ranks:  # every rank reports the step's metrics
        for got, want in zip(r["metrics"], hf["metrics"], strict=True):
            assert got.keys() == want.keys()
            assert (
                got["global_valid_toks"] == want["global_valid_toks"] == 52 - 10
            )  # lengths - 4 prompt tokens; row 4 (10) is masked
            for key in ("loss", "grad_norm", "kl_penalty", "probs_ratio", "approx_entropy", "lr"):
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), key
    weights = ranks[0]["weights"]
    assert weights.keys() == hf["weights"].keys()  # HF names, lm_head.weight beside the tied embeddings
    assert max(float((weights[k] - hf["weights"][k]).abs().max()) for k in weights) < 1e-4  # 4 AdamW updates at lr 1e-3
    moved = max(float((weights[k] - _initial(model_dir)[k]).abs().max()) for k in _initial(model_dir))
    assert moved > 3e-3  # the updates moved the weights: the comparison is not between untouched models
    assert all(
        torch.equal(ranks[0]["continued"][k], ranks[0]["resumed"][k]) for k in weights
    )  # the checkpoint resumes exactly


VARIANT_LOSSES = {
    "gspo_reverse_k1_corrected": {
        "loss_type": "grpo",
        "importance_sampling_level": "sequence",
        "ratio_clip_min": 3e-4,
        "ratio_clip_max": 4e-4,
        "reference_policy_kl_type": "k1",
        "reference_policy_kl_gradient": "reverse_kl",
        "use_importance_sampling_correction": True,
    },
    "cispo": {"loss_type": "cispo", "ratio_clip_min": 1.0, "ratio_clip_max": 0.01},
    "dr_grpo": {"loss_type": "dr_grpo"},
}


def _variant_batch(logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Generation logprobs off the trainer's: the importance weights and (in the second update) the ratios move."""
    g = torch.Generator().manual_seed(1)
    batch = _train_batch(logprobs)
    return {
        **batch,
        "generation_logprobs": logprobs + 0.05 * torch.randn(logprobs.shape, generator=g) * batch["token_mask"],
    }


def _variant_rank(rank: int, world: int, model_dir: str, folder: str, prev: torch.Tensor, loss: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    with megatron_on_cpu():
        policy = MegatronPolicy(
            _cfg(folder, "megatron", tp=2, loss=loss), tokenizer=_Tokenizer(), reference_path=model_dir
        )
        policy.load_checkpoint(PolicyVersion(0, model_dir), with_optimizer=True)
        metrics = _steps(policy, _variant_batch(prev), 1)
        policy.prepare_checkpoint(with_trainer_state=False)
        torch.save(
            {"metrics": metrics, "weights": dict(policy.named_weights()) if rank == 0 else None},
            f"{folder}/rank{rank}.pt",
        )
    dist.destroy_process_group()


@pytest.mark.parametrize("variant", sorted(VARIANT_LOSSES))
def test_megatron_trains_the_loss_variants_as_the_transformers_backend(
    model_dir, transformers_backend, tmp_path, variant
):
    """GSPO with NeMo-RL's KL gradient and the off-policy correction, CISPO with its weight clipped, Dr. GRPO: two
    tensor-parallel ranks make the transformers back-end's update (two optimizer updates, the second off-policy)."""
    import torch.multiprocessing as mp

    loss = VARIANT_LOSSES[variant]
    prev = transformers_backend["logprobs"]
    hf = HFPolicy(
        _cfg(str(tmp_path / "hf"), "transformers", loss=loss), tokenizer=_Tokenizer(), reference_path=model_dir
    )
    hf.load_checkpoint(PolicyVersion(0, model_dir), with_optimizer=True)
    (want,) = _steps(hf, _variant_batch(prev), 1)
    mp.spawn(_variant_rank, args=(2, model_dir, str(tmp_path), prev, loss), nprocs=2, join=True)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    for key in (
        "loss",
        "grad_norm",
        "kl_penalty",
        "probs_ratio",
        "sampling_importance_ratio",
        "clip_fraction/low",
        "clip_fraction/high",
        "approx_entropy",
    ):
        assert got["metrics"][0][key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), key
    assert abs(want["probs_ratio"] - 1) > 1e-3  # the second update ran off-policy (its ratios left GSPO's clip range)
    weights = dict(hf.named_weights())
    assert max(float((got["weights"][k] - weights[k]).abs().max()) for k in weights) < 1e-4


def _initial(model_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()


def _data_plane_rank(rank: int, world: int, model_dir: str, folder: str) -> None:
    """Two replicas of two tensor-parallel ranks: the step's rows go through the data-plane entry points."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    dp = DataPlane(f"{folder}/dp", "run")
    box = [None]
    if rank == 0:
        batch = _train_batch(torch.load(f"{folder}/prev.pt"))
        lengths = batch[F.INPUT_LENGTHS]

        def nested(x: torch.Tensor):
            return nested_from_values(torch.cat([row[:n] for row, n in zip(x, lengths.tolist())]), lengths)

        dp.register_partition("step_000001", fields=STEP_SCHEMA)
        box = [
            dp.put(
                "step_000001",
                {
                    **{
                        k: nested(batch[k])
                        for k in (
                            F.INPUT_IDS,
                            F.TOKEN_MASK,
                            F.GENERATION_LOGPROBS,
                            F.REFERENCE_POLICY_LOGPROBS,
                            F.ADVANTAGES,
                        )
                    },
                    F.INPUT_LENGTHS: lengths,
                    F.SAMPLE_MASK: batch[F.SAMPLE_MASK],
                },
                group_size=1,
            )
        ]
    dist.broadcast_object_list(box, src=0)
    meta = box[0]
    with megatron_on_cpu():
        policy = MegatronPolicy(
            _cfg(folder, "megatron", tp=2, world=4), tokenizer=_Tokenizer(), reference_path=model_dir
        )
        policy.load_checkpoint(PolicyVersion(0, model_dir), with_optimizer=True)
        on_dataplane = DataPlanePolicy(policy, dp)
        prev = on_dataplane.get_logprobs_from_meta(meta)
        metrics = on_dataplane.train_from_meta(meta.join(prev), fields=F.DP_TRAIN_FIELDS, rows_per_update=4)
    torch.save(
        {"data_parallel": policy.data_parallel(), "writes": policy.writes_outputs(), "metrics": metrics, "prev": prev},
        f"{folder}/rank{rank}.pt",
    )
    dist.destroy_process_group()


def test_replicas_shard_the_step_and_model_parallel_ranks_share_a_shard(model_dir, transformers_backend, tmp_path):
    import torch.multiprocessing as mp

    hf = transformers_backend
    torch.save(hf["logprobs"], tmp_path / "prev.pt")
    mp.spawn(_data_plane_rank, args=(4, model_dir, str(tmp_path)), nprocs=4, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    assert [r["data_parallel"] for r in ranks] == [
        (0, 2),
        (0, 2),
        (1, 2),
        (1, 2),
    ]  # order tp-cp-dp-pp: ranks 0, 1 are replica 0
    assert [r["writes"] for r in ranks] == [True, False, True, False]
    written = DataPlane(str(tmp_path / "dp"), "run").read(ranks[0]["prev"], [F.PREV_LOGPROBS], layout="jagged")[
        F.PREV_LOGPROBS
    ]
    assert torch.allclose(pad_nested(written, 0.0), hf["logprobs"], atol=1e-5)  # every row written once, by its replica
    want = hf["metrics"][0]  # the same two updates (rows 0-3, 4-7) on one rank
    for r in ranks:
        got = r["metrics"]
        assert (
            got["total_num_tokens"] == float(_batch()["input_lengths"].sum()) == 84
        )  # each replica's tokens counted once
        assert got["global_valid_toks"] == want["global_valid_toks"]
        for key in ("loss", "grad_norm", "kl_penalty", "probs_ratio"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), key


def _bf16_pipeline_rank(rank: int, world: int, model_dir: str, folder: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    cfg = config_from_dict({**_cfg(folder, "megatron", pp=2).to_dict(), "model": {"precision": "bfloat16"}})
    with megatron_on_cpu():
        policy = MegatronPolicy(cfg, tokenizer=_Tokenizer(), reference_path=model_dir)
        policy.load_checkpoint(PolicyVersion(0, model_dir), with_optimizer=False)
        torch.save(
            {"writes": policy.writes_outputs(), "logprobs": policy.get_logprobs(_batch())}, f"{folder}/rank{rank}.pt"
        )
    dist.destroy_process_group()


def test_bf16_pipeline_stages_exchange_bf16_activations(model_dir, tmp_path):
    """Under bf16 autocast megatron-core's residual stream is bf16, so that is what the stages send
    (``pipeline_dtype``); the logprobs stay close to the transformers back-end's bf16 ones (its residual stream is
    float32, both heads are)."""
    import torch.multiprocessing as mp

    mp.spawn(_bf16_pipeline_rank, args=(2, model_dir, str(tmp_path)), nprocs=2, join=True)
    last = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert last["writes"] and not torch.load(tmp_path / "rank0.pt", weights_only=False)["writes"]
    hf = HFPolicy(
        config_from_dict({**_cfg(str(tmp_path), "transformers").to_dict(), "model": {"precision": "bfloat16"}}),
        tokenizer=_Tokenizer(),
        reference_path=model_dir,
    )
    hf.load_checkpoint(PolicyVersion(0, model_dir), with_optimizer=False)
    want = hf.get_logprobs(_batch())
    mask = _batch()["token_mask"]
    diff = (last["logprobs"] - want).abs()[mask]
    assert float(diff.max()) < 0.02 and float(diff.mean()) < 0.005, (float(diff.max()), float(diff.mean()))


def _real_model_rank(rank: int, model_dir: str, folder: str) -> None:
    del rank
    torch.set_num_threads(2)
    with megatron_on_cpu():
        policy = MegatronPolicy(_cfg(folder, "megatron"), tokenizer=load_tokenizer(model_dir), reference_path=model_dir)
        policy.load_checkpoint(PolicyVersion(0, model_dir), with_optimizer=False)
        torch.save(policy.get_logprobs(torch.load(f"{folder}/batch.pt")), f"{folder}/logprobs.pt")


def test_megatron_matches_the_transformers_backend_on_the_real_model(real_model_dir, tmp_path):
    """SmolLM2-135M-Instruct (30 layers, 9 heads in 3 key-value groups, tied) through megatron-core's GPTModel,
    float32."""
    import torch.multiprocessing as mp

    tok = load_tokenizer(real_model_dir)
    rows = [
        tok(t)["input_ids"]
        for t in ("What is 4 + 3? The answer is 7.", "Name a prime number: seven, because it has no divisors.")
    ]
    lengths = torch.tensor([len(r) for r in rows])
    ids = torch.tensor([r + [tok.pad_token_id] * (int(lengths.max()) - len(r)) for r in rows])
    mask = (torch.arange(ids.shape[1])[None, :] >= 4) & (torch.arange(ids.shape[1])[None, :] < lengths[:, None])
    batch = {
        "input_ids": ids,
        "input_lengths": lengths,
        "token_mask": mask,
        "sample_mask": torch.ones(2, dtype=torch.bool),
    }
    torch.save(batch, tmp_path / "batch.pt")
    mp.spawn(_real_model_rank, args=(real_model_dir, str(tmp_path)), nprocs=1, join=True)
    hf = HFPolicy(_cfg(str(tmp_path), "transformers"), tokenizer=tok, reference_path=real_model_dir)
    hf.load_checkpoint(PolicyVersion(0, real_model_dir), with_optimizer=False)
    diff = (torch.load(tmp_path / "logprobs.pt") - hf.get_logprobs(batch)).abs()[mask]
    print(
        f"\n[megatron vs transformers, SmolLM2-135M, float32, CPU] {int(mask.sum())} tokens: max |diff| "
        f"{float(diff.max()):.1e}, mean {float(diff.mean()):.1e} nats"
    )
    assert float(diff.max()) < 2e-4 and float(diff.mean()) < 5e-5
