"""Stop strings in the transformers decode loop: a row ends at the first token that completes one of its stop
strings, the stop string kept in the completion (vLLM's ``SamplingParams(stop=..., include_stop_str_in_output=True)``;
the multi-turn loop's ``next_stop_strings``, `rl.multi_turn`).

The check runs on the host from the decoded tail of each open row's tokens, only for rows that have stop strings, at
the loop's open-row reads (every step on the CPU, every :data:`rl.backends.hf.sampling.SYNC_EVERY` steps on a GPU);
a row that completed a stop string between two reads is cut back to the token that completed it.
"""

from __future__ import annotations

from typing import Any

import torch

from rl.backends.hf.sampling import Completions

SLACK = 4
"""Tokens decoded beyond the longest stop string's length in characters (a token decodes to at least one character,
except a byte of a multi-byte character, which the slack covers)."""


class StopStrings:
    """The stop strings of a decode batch's rows.

    Args:
        tokenizer: decodes token ids (``decode``), special tokens included.
        stops: [n] per chunk row its stop strings, or None (empty strings are ignored).
    """

    def __init__(self, tokenizer: Any, stops: list[list[str] | None]) -> None:
        self.tokenizer = tokenizer
        self.stops = [tuple(s for s in row or () if s) for row in stops]
        longest = max((len(s) for row in self.stops for s in row), default=0)
        self.window = longest + SLACK  # tokens decoded per check

    @property
    def any(self) -> bool:
        """Whether any row has a stop string."""
        return any(self.stops)

    def _hit(self, tokens: list[int], i: int) -> bool:
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        return any(s in text for s in self.stops[i])

    def close(self, out: Completions, rows: torch.Tensor, live: torch.Tensor, t: int, since: int) -> torch.Tensor:
        """Close the open rows that completed a stop string at tokens ``since..t``: their length becomes that of the
        first token that completed it, later tokens become pad (logprob 0), and they count as finished.

        Args:
            out: the batch's buffers (``tokens`` [n, T] int64, on the device).
            rows: [m] int64, the chunk rows in the batch.
            live: [m] bool, the batch rows still open.
            t: the last token index recorded.
            since: the first token index not checked yet.

        Returns:
            ``live`` without the rows closed here.
        """
        if not self.any:
            return live
        index, open_ = torch.stack([rows, live.long()]).cpu().tolist()  # one device read
        picked = [(j, i) for j, i in enumerate(index) if open_[j] and self.stops[i]]
        if not picked:
            return live
        lo = max(0, since - self.window)  # a stop string completed at since or later starts here or later
        which = torch.tensor([i for _, i in picked], device=out.tokens.device)
        tails = out.tokens[which, lo : t + 1].cpu().tolist()  # one device read
        closed = []
        for (j, i), tail in zip(picked, tails, strict=True):
            if not self._hit(tail, i):
                continue
            k = next(k for k in range(lo, t + 1) if self._hit(tail[: k + 1 - lo], i))  # the completing token
            out.tokens[i, k + 1 :] = out.pad_id
            out.logprobs[i, k + 1 :] = 0.0
            out.lengths[i] = k + 1
            out.finished[i] = True
            closed.append(j)
        if closed:
            live = live.clone()
            live[torch.tensor(closed, device=live.device)] = False
        return live
