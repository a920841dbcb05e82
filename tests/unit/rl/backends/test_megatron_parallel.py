"""The model-parallel maths of the megatron back-end on CPU: the load-balanced context-parallel split and its inverse,
token logprobs, their gradient and the top-k over a vocabulary split across two tensor-parallel gloo ranks (equal to
the unsplit log-softmax and top-k, padded vocabulary rows masked out), and the micro-batches the schedule gets (split
over two context-parallel ranks and put back together they are the batch, shifted to prediction positions).

Ranks are real processes (``torch.multiprocessing.spawn``) with megatron-core's own process groups
(``parallel_state.initialize_model_parallel``) over gloo.
"""

from __future__ import annotations

import pytest
import torch

from rl.backends.megatron.parallel import (
    context_parallel_merge,
    context_parallel_split,
    padded_length,
    vocab_parallel_token_logprobs,
    vocab_parallel_topk,
)
from rl.backends.megatron.policy import _micro_batches
from rl.config import MegatronConfig

pytest.importorskip("megatron.core")

VOCAB, PADDED = 10, 12
"""A real vocabulary of 10 ids padded to 12 (two tensor-parallel ranks of 6: rank 1 holds ids 6-11, 10 and 11
padding)."""


@pytest.mark.parametrize("size", [1, 2, 3])
def test_context_parallel_split_is_load_balanced_and_merges_back(size):
    x = torch.arange(2 * 12).reshape(2, 12)  # [B, S]
    parts = [context_parallel_split(x, rank=r, size=size) for r in range(size)]
    assert torch.equal(context_parallel_merge(parts), x)
    if size == 2:  # 4 chunks of 3: rank 0 takes the first and the last, rank 1 the middle two
        assert parts[0][0].tolist() == [0, 1, 2, 9, 10, 11]
        assert parts[1][0].tolist() == [3, 4, 5, 6, 7, 8]


def test_context_parallel_split_refuses_a_length_it_cannot_chunk():
    with pytest.raises(ValueError, match="length 10 is not a multiple of 4"):
        context_parallel_split(torch.zeros(1, 10), rank=0, size=2)


def test_padded_length():
    assert padded_length(37, context_parallel_size=1, tensor_parallel_size=4, sequence_parallel=False) == 37
    assert padded_length(37, context_parallel_size=2, tensor_parallel_size=1, sequence_parallel=False) == 40
    assert padded_length(37, context_parallel_size=2, tensor_parallel_size=3, sequence_parallel=True) == 48


def _logits() -> tuple[torch.Tensor, torch.Tensor]:
    """[3, 5, 12] logits whose padded columns are the largest (masking matters) and [3, 5] targets."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, PADDED, generator=g)
    logits[..., VOCAB:] = 50.0
    return logits, torch.randint(0, VOCAB, (3, 5), generator=g)


def _tensor_parallel_rank(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        logits, targets = _logits()
        mine = logits[..., rank * 6 : (rank + 1) * 6].clone().requires_grad_(True)  # [3, 5, 6]
        lp = vocab_parallel_token_logprobs(mine, targets, vocab_size=VOCAB, temperature=0.7)  # [3, 5]
        (lp * torch.arange(15.0).reshape(3, 5)).sum().backward()
        values, indices = vocab_parallel_topk(
            logits[..., rank * 6 : (rank + 1) * 6].reshape(15, 6), 4, vocab_size=VOCAB
        )
        torch.save({"lp": lp.detach(), "grad": mine.grad, "values": values, "indices": indices}, f"{out}/rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory) -> list[dict[str, torch.Tensor]]:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("tp")
    mp.spawn(_tensor_parallel_rank, args=(2, str(out / "store"), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow
def test_vocab_parallel_logprobs_and_gradient_equal_the_unsplit_ones(tensor_parallel):
    logits, targets = _logits()
    full = logits[..., :VOCAB].clone().requires_grad_(True)  # the real vocabulary only
    want = torch.log_softmax(full / 0.7, -1).gather(-1, targets[..., None])[..., 0]  # [3, 5]
    (want * torch.arange(15.0).reshape(3, 5)).sum().backward()
    for rank, got in enumerate(tensor_parallel):
        assert torch.allclose(got["lp"], want.detach(), atol=1e-5), rank  # both ranks hold the whole result
    grad = torch.cat([tensor_parallel[0]["grad"], tensor_parallel[1]["grad"]], -1)  # [3, 5, 12]
    assert torch.allclose(grad[..., :VOCAB], full.grad, atol=1e-5)
    assert torch.equal(grad[..., VOCAB:], torch.zeros(3, 5, 2))  # padded rows take no probability and no gradient


@pytest.mark.slow
def test_vocab_parallel_topk_equals_the_unsplit_topk(tensor_parallel):
    logits, _ = _logits()
    want = logits[..., :VOCAB].reshape(15, VOCAB).topk(4, -1)
    for got in tensor_parallel:
        assert torch.equal(got["values"], want.values)
        assert torch.equal(got["indices"], want.indices)


def _context_parallel_rank(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    try:
        batch = _batch()
        n = int(batch["input_lengths"].shape[0])
        micro = _micro_batches(
            batch, [slice(a, min(a + 2, n)) for a in range(0, n, 2)], MegatronConfig(context_parallel_size=2)
        )
        torch.save(micro, f"{out}/rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _batch() -> dict[str, torch.Tensor]:
    """Three rows of lengths 5, 9, 3 (width 9), prompt of 2."""
    lengths = torch.tensor([5, 9, 3])
    live = torch.arange(9)[None, :] < lengths[:, None]  # [3, 9]
    ids = (torch.arange(27).reshape(3, 9) + 100) * live
    mask = live & (torch.arange(9)[None, :] >= 2)
    return {
        "input_ids": ids,
        "input_lengths": lengths,
        "token_mask": mask,
        "sample_mask": torch.tensor([True, False, True]),
        "advantages": torch.arange(27.0).reshape(3, 9) * mask,
    }


@pytest.mark.slow
def test_micro_batches_split_over_context_parallel_ranks_put_back_are_the_shifted_batch(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_context_parallel_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    batch = _batch()
    assert [len(r) for r in ranks] == [2, 2]  # rows 0-1, then row 2
    for i, (rows, width) in enumerate(
        [(slice(0, 2), 12), (slice(2, 3), 4)]
    ):  # each cut to its longest row, a multiple of 4
        mbs = [r[i] for r in ranks]
        assert int(mbs[0]["full_length"]) == width
        whole = {
            k: context_parallel_merge([mb[k] for mb in mbs])
            for k in ("input_ids", "targets", "token_mask", "advantages", "position_ids")
        }
        m = rows.stop - rows.start
        ids = batch["input_ids"][rows]
        assert torch.equal(whole["input_ids"][:, : ids.shape[1]], ids[:, :width])
        assert torch.equal(
            whole["targets"][:, : ids.shape[1] - 1], ids[:, 1 : width + 1]
        )  # entry p: the token at p + 1
        assert torch.equal(whole["token_mask"][:, : ids.shape[1] - 1], batch["token_mask"][rows, 1 : width + 1])
        assert torch.equal(whole["advantages"][:, : ids.shape[1] - 1], batch["advantages"][rows, 1 : width + 1])
        assert not whole["token_mask"][:, ids.shape[1] - 1 :].any()  # padding predicts nothing
        assert torch.equal(whole["position_ids"], torch.arange(width).expand(m, width))
        assert torch.equal(mbs[0]["sample_mask"], batch["sample_mask"][rows])
