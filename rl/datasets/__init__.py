"""Prompt datasets from the user's files (JSON Lines, JSON, Parquet, CSV on any fsspec filesystem; ``datasets``
``save_to_disk`` folders; Hugging Face Hub datasets): described (`describe_source`), checked and prepared once per
run as a Parquet copy (`prepare_split`, `open_split`), and streamed in a seeded order (`PromptStream`,
`first_rows`). Flyte-free; rows come out as `rl.data.Problem`."""

from rl.datasets.errors import DatasetError
from rl.datasets.prepare import PreparedSplit, open_split, prepare_split
from rl.datasets.rows import ColumnKeys
from rl.datasets.sources import SourceInfo, describe_source
from rl.datasets.stream import PromptStream, first_rows

__all__ = [
    "ColumnKeys",
    "DatasetError",
    "PreparedSplit",
    "PromptStream",
    "SourceInfo",
    "describe_source",
    "first_rows",
    "open_split",
    "prepare_split",
]
