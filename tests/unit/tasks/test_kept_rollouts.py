"""`tasks.kept_rollouts.keep` against a hand-written step partition, on a local folder and on loopback S3: the file
is plain Parquet (read back with pyarrow / pandas only), one row per sample, replaced when re-kept."""

from __future__ import annotations

import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dataplane import fields as F
from dataplane.client import DataPlane
from dataplane.codec import nested_from_values
from rl.config import config_from_dict
from rl.rollout import STEP_SCHEMA
from tasks import kept_rollouts
from tasks.types import RunInfo

RUN = RunInfo(run_id="run-1", mlflow_run_id="mlflow-1", model_path="unused")
STEP = 7
PROMPTS = [2, 2, 3, 3]  # prompt tokens of the 4 samples (B = 2 prompts x G = 2)
RESPONSE_LOGPROBS = [[-0.5, -1.0, -0.25], [-2.0], [-0.125, -3.0], []]  # nats, per response token (sample 3: empty)
REWARDS = [1.0, 0.0, 0.75, 0.25]
# group means 0.5 and 0.5: advantages r - mean = [0.5, -0.5] and [0.25, -0.25] (every token of a sample carries it)
ADVANTAGES = [0.5, -0.5, 0.25, -0.25]


def _lengths() -> torch.Tensor:
    return torch.tensor([p + len(r) for p, r in zip(PROMPTS, RESPONSE_LOGPROBS)], dtype=torch.int64)  # [5, 3, 5, 3]


def _per_token(per_sample: list[float]) -> torch.Tensor:
    lengths = _lengths()
    return nested_from_values(torch.repeat_interleave(torch.tensor(per_sample), lengths), lengths)  # [N, L_i]


def _put_step(dp: DataPlane):
    """The step partition as the rollout and advantages tasks leave it; returns the joined meta."""
    lengths = _lengths()
    logprobs = torch.cat(
        [torch.cat([torch.zeros(p), torch.tensor(r)]) for p, r in zip(PROMPTS, RESPONSE_LOGPROBS)]
    )  # [T]
    columns = {
        F.INPUT_IDS: nested_from_values(torch.arange(int(lengths.sum()), dtype=torch.int64), lengths),
        F.INPUT_LENGTHS: lengths,
        F.GENERATION_LOGPROBS: nested_from_values(logprobs, lengths),
        F.TOKEN_MASK: nested_from_values(
            torch.cat([torch.arange(n) >= p for p, n in zip(PROMPTS, lengths.tolist())]), lengths
        ),
        F.SAMPLE_MASK: torch.tensor([True, True, True, False]),
        F.REWARDS: torch.tensor(REWARDS, dtype=torch.float32),
        F.TRUNCATED: torch.tensor([False, False, True, False]),
        F.PROMPT_INDEX: torch.tensor([0, 0, 1, 1]),
        F.GENERATION_INDEX: torch.tensor([0, 1, 0, 1]),
        F.WEIGHT_VERSION: torch.full((4,), STEP - 1, dtype=torch.int64),
        F.PROMPT_LENGTHS: torch.tensor(PROMPTS, dtype=torch.int64),
        F.PROMPT_TEXT: ["1 + 2 =", "1 + 2 =", "4 - 1 =", "4 - 1 ="],
        F.RESPONSE_TEXT: ["3", "4", "<answer>3</answer>", ""],
        F.ANSWER_TEXT: ["3", "3", "3", "3"],
        F.TASK_NAME: ["chain_sum"] * 4,
        F.ROW_ID: ["train:0", "train:0", "train:5", "train:5"],
        F.REWARD_COMPONENTS: [{"reasoning_gym": r} for r in REWARDS],
    }
    dp.register_partition(f"step_{STEP:06d}", fields=STEP_SCHEMA)
    meta = dp.put(f"step_{STEP:06d}", columns, group_size=2, task_name="rollout", id_key="rollout")
    return meta.join(dp.write_columns(meta, {F.ADVANTAGES: _per_token(ADVANTAGES)}, task_name="advantages"))


@pytest.fixture
def step(store):
    root, so = store
    dp = DataPlane(root, RUN.run_id, storage_options=so)
    cfg = config_from_dict({"dataplane": {"root": root, "storage_options": so, "keep_rollouts": True}})
    return cfg, dp, _put_step(dp)


def test_keep_writes_one_plain_parquet_row_per_sample(step):
    cfg, dp, meta = step
    url = kept_rollouts.keep(cfg, RUN, dp, meta, STEP)
    assert url == f"{cfg.dataplane.root}/run-1/rollouts/step_000007.parquet"
    with fsspec.open(url, "rb", **cfg.dataplane.storage_options) as f:
        table = pq.read_table(f)
    assert table.schema.types == [
        pa.int64(),
        pa.string(),
        pa.int64(),
        pa.int64(),
        pa.int64(),
        pa.string(),
        pa.string(),
        pa.string(),
        pa.string(),  # task_name
        pa.string(),  # row_id
        pa.float32(),
        pa.float32(),
        pa.bool_(),
        pa.bool_(),
        pa.int64(),
        pa.int64(),
        pa.list_(pa.float32()),
    ]
    rows = table.to_pylist()
    assert len(rows) == 4
    assert [r["sample_id"] for r in rows] == meta.sample_ids
    assert rows[0] == {
        "step": 7,
        "sample_id": meta.sample_ids[0],
        "prompt_index": 0,
        "generation_index": 0,
        "weight_version": 6,
        "prompt": "1 + 2 =",
        "response": "3",
        "answer": "3",
        "task_name": "chain_sum",
        "row_id": "train:0",
        "rewards": 1.0,
        "advantages": 0.5,
        "sample_mask": True,
        "truncated": False,
        "prompt_lengths": 2,
        "response_lengths": 3,
        "generation_logprobs": [-0.5, -1.0, -0.25],  # the response tokens only: the 2 prompt zeros are left out
    }
    assert [r["prompt_index"] for r in rows] == [0, 0, 1, 1]
    assert [r["response"] for r in rows] == ["3", "4", "<answer>3</answer>", ""]
    assert [r["rewards"] for r in rows] == REWARDS
    assert [r["advantages"] for r in rows] == ADVANTAGES
    assert [r["sample_mask"] for r in rows] == [True, True, True, False]
    assert [r["truncated"] for r in rows] == [False, False, True, False]
    assert [r["response_lengths"] for r in rows] == [3, 1, 2, 0]
    assert [r["generation_logprobs"] for r in rows] == RESPONSE_LOGPROBS


def test_pandas_reads_it_by_url(step):
    cfg, dp, meta = step
    url = kept_rollouts.keep(cfg, RUN, dp, meta, STEP)
    df = pd.read_parquet(url, storage_options=cfg.dataplane.storage_options or None)
    assert df.shape == (4, 17)
    assert df.groupby("prompt_index")["rewards"].mean().tolist() == [0.5, 0.5]  # (1 + 0) / 2, (0.75 + 0.25) / 2
    assert df.loc[2, "generation_logprobs"].tolist() == [-0.125, -3.0]


def test_keeping_again_replaces_the_file(step):
    cfg, dp, meta = step
    url = kept_rollouts.keep(cfg, RUN, dp, meta, STEP)
    dp.write_columns(
        meta, {F.ADVANTAGES: _per_token([1.0, -1.0, 2.0, -2.0])}, task_name="advantages"
    )  # a retried write
    assert kept_rollouts.keep(cfg, RUN, dp, meta, STEP) == url
    with fsspec.open(url, "rb", **cfg.dataplane.storage_options) as f:
        table = pq.read_table(f)
    assert table.num_rows == 4
    assert table.column("advantages").to_pylist() == [1.0, -1.0, 2.0, -2.0]
    fs, folder = fsspec.core.url_to_fs(url.rsplit("/", 1)[0], **cfg.dataplane.storage_options)
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(folder, detail=False)] == [
        "step_000007.parquet"
    ]  # no temporary file left


def test_off_writes_nothing(tmp_path):
    root = str(tmp_path / "dp")
    dp = DataPlane(root, RUN.run_id)
    meta = _put_step(dp)
    cfg = config_from_dict({"dataplane": {"root": root}})
    assert cfg.dataplane.keep_rollouts is False
    assert kept_rollouts.keep(cfg, RUN, dp, meta, STEP) is None
    assert not (tmp_path / "dp" / "run-1" / "rollouts").exists()


def test_wrong_step_and_varying_advantages_are_refused(tmp_path):
    root = str(tmp_path / "dp")
    dp = DataPlane(root, RUN.run_id)
    meta = _put_step(dp)
    cfg = config_from_dict({"dataplane": {"root": root, "keep_rollouts": True}})
    with pytest.raises(ValueError, match=r"keep_rollouts of step 8 got a meta of partition 'step_000007'"):
        kept_rollouts.keep(cfg, RUN, dp, meta, 8)
    lengths = _lengths()
    per_token = torch.repeat_interleave(torch.tensor(ADVANTAGES), lengths)  # [16]
    per_token[6] = 9.0  # the second token of sample 1 (sample 0 has 5 tokens)
    dp.write_columns(meta, {F.ADVANTAGES: nested_from_values(per_token, lengths)}, task_name="advantages")
    with pytest.raises(
        ValueError, match=rf"the advantage of samples \['{meta.sample_ids[1]}'\] varies across their tokens"
    ):
        kept_rollouts.keep(cfg, RUN, dp, meta, STEP)
    assert not (tmp_path / "dp" / "run-1" / "rollouts").exists()
