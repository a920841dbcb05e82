"""Data parallelism in the back-end: two gloo ranks, each training on its token-balanced shard of the step, make the
update one rank makes on the whole step (float64, so that only the order of sums differs), and log the same metrics.

Ranks are real processes (``torch.multiprocessing.spawn``) joined through a file store; a tiny random Llama with the
real tokenizer keeps each under a few seconds.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dataplane.meta import KVBatchMeta
from dataplane.sharding import shard_meta_for_dp, shard_updates_for_dp
from rl import distributed
from rl.backends.hf.train import make_optimizer, train_on_batch
from rl.config import config_from_dict

LENGTHS = [5, 40, 7, 33, 6, 21, 9]
"""Seven rows (odd: the ranks get 4 and 3) of very different lengths."""
PROMPT = 4
ROWS_PER_UPDATE = 3
"""Three optimizer updates per step: rows 0-2, 3-5, then row 6 alone (one rank has no rows in it)."""

pytestmark = pytest.mark.slow  # real processes: a few seconds


def _cfg():
    return config_from_dict(
        {
            "model": {"precision": "auto"},  # auto leaves the float64 test model in float64 (rl.precision.autocast)
            "grpo": {"num_prompts_per_step": 1, "num_generations_per_prompt": 7},
            "optim": {"lr": 1e-3, "train_micro_batch_size": 2, "max_grad_norm": 0.5},
            "loss": {"reference_policy_kl_penalty": 0.1},
        }
    )


def _batch() -> dict[str, torch.Tensor]:
    """The step's rows: random tokens, prompt of 4, float64 logprobs near the model's, random advantages."""
    g = torch.Generator().manual_seed(0)
    n, s = len(LENGTHS), max(LENGTHS)
    lengths = torch.tensor(LENGTHS)
    live = torch.arange(s)[None, :] < lengths[:, None]  # [N, S]
    mask = live & (torch.arange(s)[None, :] >= PROMPT)
    ids = torch.randint(3, 1000, (n, s), generator=g) * live  # [N, S]
    lp = -torch.rand(n, s, generator=g, dtype=torch.float64) * 3 * mask  # [N, S]
    return {
        "input_ids": ids,
        "input_lengths": lengths,
        "token_mask": mask,
        "sample_mask": torch.tensor([True, True, True, False, True, True, True]),
        "generation_logprobs": lp,
        "prev_logprobs": lp + 0.01 * mask,
        "reference_policy_logprobs": lp - 0.02 * mask,
        "advantages": (torch.randn(n, 1, generator=g, dtype=torch.float64) * mask),
    }


def _meta() -> KVBatchMeta:
    return KVBatchMeta(
        partition_id="p", sample_ids=[f"s{i}" for i in range(len(LENGTHS))], sequence_lengths=list(LENGTHS)
    )


LORA = SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, peft_target_modules="all-linear")
"""A LoRA adapter on every linear layer (`rl.lora.wrap` reads these attributes of ``policy.lora``)."""


def _update(
    model_dir: str, rank: int, world: int, *, lora: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, float], list[int]]:
    """One step's updates of this rank on its shard; returns the weights, the metrics and the shard's rows. With
    ``lora``, the model trains a LoRA adapter (`rl.lora`) and the weights are the adapter's."""
    from tensordict import TensorDict
    from transformers import AutoModelForCausalLM

    from rl.lora import wrap

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="eager")
    if lora:
        model = wrap(model, LORA, seed=0).get_base_model()
    opt, sched = make_optimizer(model, _cfg())
    shard, sizes = shard_updates_for_dp(_meta(), dp_world=world, rank=rank, rows_per_update=ROWS_PER_UPDATE)
    rows = [int(i[1:]) for i in shard.sample_ids]
    full = TensorDict(_batch(), batch_size=[len(LENGTHS)])
    metrics = train_on_batch(model, opt, sched, full[torch.tensor(rows, dtype=torch.int64)], _cfg(), update_sizes=sizes)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if not lora or ".lora_" in k}
    return weights, metrics, rows


def _rank_main(rank: int, world: int, store: str, model_dir: str, out: str, lora: bool = False) -> None:
    import torch.distributed as dist

    reduced: list[int] = []  # elements of every gradient bucket this rank all-reduced
    bucket = distributed._reduce_bucket
    distributed._reduce_bucket = lambda grads, group: (
        reduced.append(sum(g.numel() for g in grads)),
        bucket(grads, group),
    )
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.save((*_update(model_dir, rank, world, lora=lora), sum(reduced)), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _spawn_ranks(model_dir: str, out, *, lora: bool = False) -> list[tuple]:
    import torch.multiprocessing as mp

    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        mp.spawn(_rank_main, args=(2, str(out / "store"), model_dir, str(out), lora), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory) -> list[tuple[dict[str, torch.Tensor], dict[str, float], list[int]]]:
    return [r[:3] for r in _spawn_ranks(tiny_model_dir, tmp_path_factory.mktemp("ranks"))]


def test_two_ranks_train_a_lora_adapter_as_one_rank_reducing_only_its_gradients(tiny_model_dir, tmp_path):
    ranks = _spawn_ranks(tiny_model_dir, tmp_path, lora=True)
    one_weights, one_metrics, _ = _update(tiny_model_dir, 0, 1, lora=True)
    adapter = sum(v.numel() for v in one_weights.values())
    assert len(one_weights) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    for weights, metrics, _, reduced in ranks:
        assert max(float((one_weights[k] - weights[k]).abs().max()) for k in weights) < 1e-8
        assert metrics["loss"] == pytest.approx(one_metrics["loss"], rel=1e-9)
        assert reduced == adapter * 3  # three updates, each all-reducing the adapter's gradients and nothing else
    moved = [k for k in one_weights if ".lora_B." in k and one_weights[k].abs().max() > 1e-4]
    assert len(moved) == 2 * 7  # every B left zero: the adapter trained


def test_two_ranks_make_the_update_of_one_rank(tiny_model_dir, two_ranks):
    one_weights, one_metrics, one_rows = _update(tiny_model_dir, 0, 1)
    assert one_rows == list(range(7)) and sorted(two_ranks[0][2] + two_ranks[1][2]) == list(range(7))
    assert {len(two_ranks[0][2]), len(two_ranks[1][2])} == {3, 4}  # odd: uneven shards
    for weights, metrics, _ in two_ranks:  # every rank holds the same weights and reports the same metrics
        # the update moves weights by ~2e-3; the ranks' sums run in another order (and their micro-batches have other
        # widths), which Adam's m / sqrt(v) turns into ~1e-9 where a gradient entry is near its eps: 6 orders below
        differs = max(float((one_weights[k] - weights[k]).abs().max()) for k in weights)
        assert differs < 1e-8, differs
        assert max(float((weights[k] - two_ranks[0][0][k]).abs().max()) for k in weights) == 0.0
        assert metrics.keys() == one_metrics.keys()
        for key, value in one_metrics.items():
            assert metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert one_metrics["global_valid_toks"] == sum(
        n - PROMPT for i, n in enumerate(LENGTHS) if i != 3
    )  # row 3 is masked
    step = max(float((one_weights[k] - _initial(tiny_model_dir)[k]).abs().max()) for k in one_weights)
    assert step > 1e-3  # the update moved the weights: the comparison above is not between two untouched models


def _initial(model_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).state_dict()


def test_each_update_is_split_across_ranks_token_balanced():
    meta = _meta()
    shards = [shard_updates_for_dp(meta, dp_world=2, rank=r, rows_per_update=ROWS_PER_UPDATE) for r in range(2)]
    # update g of all ranks is exactly update g of one rank
    for g, a in enumerate(range(0, 7, ROWS_PER_UPDATE)):
        rows = set(range(a, min(a + ROWS_PER_UPDATE, 7)))
        got = set()
        for shard, sizes in shards:
            start = sum(sizes[:g])
            got |= {int(i[1:]) for i in shard.sample_ids[start : start + sizes[g]]}
        assert got == rows
    # the first update's tokens (5, 40, 7): the longest alone, the two short ones together
    first = [sorted(LENGTHS[int(i[1:])] for i in shard.sample_ids[: sizes[0]]) for shard, sizes in shards]
    assert sorted(first) == [[5, 7], [40]]
    assert sorted(sizes[2] for _, sizes in shards) == [0, 1]  # the last update's single row: one rank has none
    # every shard pads to the step's one sequence length
    assert {shard.global_forward_pad_seqlen() for shard, _ in shards} == {40}


def test_shards_of_fewer_rows_than_ranks_are_empty_and_named():
    meta = _meta().slice(0, 3)
    shards, unsorted = shard_meta_for_dp(meta, dp_world=4)
    assert [s.size() for s in shards] == [1, 1, 1, 0]
    flat = [i for s in shards for i in s.sample_ids]
    assert [flat[unsorted[i]] for i in range(3)] == meta.sample_ids  # the inverse permutation restores the order
    shard, sizes = shard_updates_for_dp(meta, dp_world=4, rank=3, rows_per_update=3)
    assert shard.size() == 0 and sizes == [0]
    with pytest.raises(ValueError, match=r"rank 4 is not in \[0, 4\)"):
        shard_updates_for_dp(meta, dp_world=4, rank=4, rows_per_update=3)


def test_without_a_process_group_the_collectives_are_the_identity():
    t = torch.tensor([1.5, 2.0])
    assert distributed.world_size() == 1 and distributed.rank() == 0
    assert torch.equal(distributed.all_reduce(t), t.double())
    assert distributed.sum_scalars({"a": 2.0}) == {"a": 2.0}
    assert distributed.gather_objects("x") == ["x"]
    with distributed.process_group() as world:
        assert world == 1


def test_the_update_sizes_must_cover_the_batch(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    opt, sched = make_optimizer(model, _cfg())
    with pytest.raises(ValueError, match=r"update_sizes \[4, 4\] add up to 8 rows, but the batch has 7"):
        train_on_batch(model, opt, sched, _batch(), _cfg(), update_sizes=[4, 4])
    batch = {k: v for k, v in _batch().items() if k != "prev_logprobs"}
    with pytest.raises(ValueError, match="prev_logprobs are missing but the step makes several optimizer updates"):
        train_on_batch(model, opt, sched, batch, _cfg(), update_sizes=[4, 3])
