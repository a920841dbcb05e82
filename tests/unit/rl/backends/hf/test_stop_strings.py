"""Stop strings in the transformers decode loop (`rl.backends.hf.stop_strings`): a row ends at the token that completes
its first stop string, the string kept, on the CPU (checked every step) and on a device (checked every
``SYNC_EVERY`` steps, then cut back), and its kept KV covers the cut completion."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from rl.backends.hf.decode import generate
from rl.backends.hf.model import load_model
from rl.backends.hf.sampling import Completions
from rl.backends.hf.stop_strings import StopStrings
from rl.model import load_tokenizer
from tests.fake_device import DEVICE, fake_device, move

CHARS = SimpleNamespace(decode=lambda ids, skip_special_tokens=False: "".join(chr(i) for i in ids))
"""A tokenizer whose token i is the character chr(i)."""


def _buffers(rows: list[str]) -> Completions:
    out = Completions(len(rows), 6, pad_id=0, eos_id=1, device=torch.device("cpu"))
    for i, text in enumerate(rows):
        out.tokens[i, : len(text)] = torch.tensor([ord(c) for c in text])
        out.logprobs[i, : len(text)] = -0.5
    return out


def test_a_row_closes_at_the_token_that_completes_its_stop_string_even_when_checked_later():
    """Rows "ab</m>": with stop "</" the row ends at token 3 ("</" completed by "/"), though the check (a device's,
    every 4 tokens) ran at token 5; a row without stop strings, or whose stop string is absent, stays open."""
    out = _buffers(["ab</m>", "ab</m>", "ab</m>"])
    stops = StopStrings(CHARS, [["</"], None, ["zz", ""]])
    live = stops.close(out, torch.tensor([0, 1, 2]), torch.tensor([True, True, True]), t=5, since=2)
    assert live.tolist() == [False, True, True]
    assert out.lengths.tolist() == [4, 6, 6] and out.finished.tolist() == [True, False, False]
    assert out.tokens[0].tolist() == [ord("a"), ord("b"), ord("<"), ord("/"), 0, 0]  # pad after the completing token
    assert out.logprobs[0].tolist() == [-0.5, -0.5, -0.5, -0.5, 0.0, 0.0]
    assert not StopStrings(CHARS, [None, [""]]).any


def test_only_open_rows_of_the_batch_are_checked():
    """Batch positions map to chunk rows (``rows``); a closed row is left as it is."""
    out = _buffers(["xx", "a</", "b</"])
    stops = StopStrings(CHARS, [["</"], ["</"], ["</"]])
    live = stops.close(out, torch.tensor([2, 1]), torch.tensor([True, False]), t=2, since=2)
    assert live.tolist() == [False, False]
    assert out.lengths.tolist() == [6, 6, 3]  # chunk row 2 closed; row 1 was not open, so untouched


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


def _first_completing(tok, ids: list[int], stop: str) -> int:  # noqa: ANN001
    return next(k for k in range(len(ids)) if stop in tok.decode(ids[: k + 1], skip_special_tokens=False))


@pytest.mark.parametrize("where", ["cpu", "device"])
def test_the_decode_loop_stops_a_row_at_its_stop_string_and_keeps_the_kv_of_the_cut_completion(tiny, where):
    """Greedy rows with and without a stop string: the row with one equals the free completion up to the token that
    completes the string (finished, not truncated); the others are unchanged; its kept KV covers the cut tokens."""
    model, tok = tiny
    torch.manual_seed(0)
    rows = [[1, 5, 9, 13], [1, 7, 2], [1, 4, 4, 4, 4]]
    free = generate(model, tok, rows, max_new_tokens=10, greedy=True, precision="float32")
    ids = [int(x) for x in free.input_ids[0][len(rows[0]) :]]
    stop = tok.decode(ids[4:6], skip_special_tokens=False)
    k = _first_completing(tok, ids, stop)
    assert k < len(ids) - 1  # the string ends the completion early

    def run(m):  # noqa: ANN001, ANN202
        kept: list = []
        got = generate(
            m, tok, rows, max_new_tokens=10, greedy=True, precision="float32", stop_strings=[[stop], None, None],
            kv_out=kept,
        )  # fmt: skip
        return got, kept

    if where == "cpu":
        got, kept = run(model)
    else:
        with fake_device():
            got, kept = run(move(copy.deepcopy(model), DEVICE))
    assert got.input_ids[0].tolist() == [*rows[0], *ids[: k + 1]]
    assert not bool(got.truncated[0]) and int(got.response_lengths[0]) == k + 1
    for i in (1, 2):
        assert got.input_ids[i].tolist() == free.input_ids[i].tolist()
    assert kept[0].tokens == [*rows[0], *ids[:k]]  # prompt and completion but its last token
    assert kept[0].layers[0][0].shape[1] == len(rows[0]) + k
