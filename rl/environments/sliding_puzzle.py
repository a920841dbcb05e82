"""A multi-turn sliding puzzle environment (the n-puzzle), after NeMo-RL's sliding puzzle game
(``nemo_rl/environments/games/sliding_puzzle.py``): the model is shown a board and answers one move per turn.

**The board** is ``size x size`` tiles ``1 .. size*size - 1`` and one blank, written ``0``; it is solved when the tiles
read ``1, 2, ...`` row by row with the blank last (``1 2 3/4 5 6/7 8 0``). A row's ``board`` column gives the start,
as a list of rows (``[[1, 2, 3], [4, 5, 6], [7, 8, 0]]``) or a string with rows separated by ``/`` or newlines and
tiles by spaces or commas (``"1 2 3/4 5 6/7 8 0"``). The observation shows it one row per line, the blank as ``_``.

**A move** names the direction in which the *blank* moves: ``up`` swaps the blank with the tile above it (that tile
slides down), ``down`` with the tile below, ``left`` with the tile to its left, ``right`` with the tile to its right.
The move is read from the assistant's last message: the word inside its last ``<move>...</move>`` tag (the closing
tag may be missing, since generation stops at the stop string ``</move>``, which vLLM leaves out of the text by
default), or, when the message has no ``<move>`` tag, its last word; case and surrounding punctuation are ignored.

**An episode** ends (``terminated``) when the board is solved (reward ``solved`` = 1.0), when the message holds no
move or a move that would push the blank off the board (0.0), or after ``max_moves`` moves (0.0). Game state lives in
each sample's metadata (``puzzle_board``: the board as a list of rows, ``puzzle_moves``: the moves so far), so one
environment serves any number of episodes at once; the metadata of a finished sample carries its final state.

Pure game logic (``parse_board``, ``render_board``, ``board_string``, ``apply_move``, ``parse_move``,
``make_puzzles``) is separate from the environment and needs no torch.
"""

from __future__ import annotations

import numbers
import random
import re
from typing import Any

from rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn

__all__ = [
    "MOVES",
    "SlidingPuzzleEnvironment",
    "apply_move",
    "board_string",
    "is_solved",
    "make_puzzles",
    "parse_board",
    "parse_move",
    "render_board",
    "solved_board",
]

Board = list[list[int]]

MOVES: dict[str, tuple[int, int]] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
"""Move name -> (row, column) step of the blank."""

OPPOSITE = {"up": "down", "down": "up", "left": "right", "right": "left"}
STOP = "</move>"
_LAST_TAG = re.compile(r"<move>(?!.*<move>)(.*?)(?:</move>|$)", re.IGNORECASE | re.DOTALL)
_PUNCT = " \t\r\n.,;:!?\"'`*()[]{}<>"


def solved_board(size: int) -> Board:
    """The solved ``size x size`` board: ``1 .. size*size - 1`` row by row, the blank (0) last.

    Raises:
        ValueError: ``size`` < 2.
    """
    if size < 2:
        raise ValueError(f"a sliding puzzle has size >= 2, got {size}")
    return [[(r * size + c + 1) % (size * size) for c in range(size)] for r in range(size)]


def is_solved(board: Board) -> bool:
    """Whether ``board`` is the solved board of its size."""
    return board == solved_board(len(board))


def parse_board(value: Any, size: int | None = None) -> Board:
    """A board from a ``board`` column: a list of rows of ints, or a string (rows split by ``/`` or newlines, tiles by
    spaces or commas; ``_`` is read as the blank).

    Args:
        value: the column's value.
        size: the side the board must have, or None for any.

    Returns:
        ``[size][size]`` ints, a fresh list.

    Raises:
        ValueError: not a square board of that size holding each of ``0 .. size*size - 1`` exactly once.
    """
    if isinstance(value, str):
        rows = [r for r in re.split(r"[/\n]", value.strip()) if r.strip()]
        try:
            board = [[0 if t == "_" else int(t) for t in re.split(r"[\s,]+", r.strip())] for r in rows]
        except ValueError:
            msg = f"board {value!r} holds a tile that is not an integer; write e.g. '1 2 3/4 5 6/7 8 0'"
            raise ValueError(msg) from None
    elif isinstance(value, (list, tuple)) and all(isinstance(r, (list, tuple)) for r in value):
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for r in value for t in r):
            raise ValueError(f"board {value!r} holds a tile that is not an integer; give rows of ints")
        board = [[int(t) for t in r] for r in value]
    else:
        raise ValueError(
            f"board {value!r} is a {type(value).__name__}; give a list of rows of ints or a string like "
            "'1 2 3/4 5 6/7 8 0'"
        )
    n = len(board)
    if n < 2 or any(len(r) != n for r in board):
        raise ValueError(f"board {value!r} is not a square of at least 2 x 2 tiles; give as many rows as columns")
    if size is not None and n != size:
        raise ValueError(f"board {value!r} is {n} x {n} but the environment plays size {size}; set size: {n}")
    if sorted(t for r in board for t in r) != list(range(n * n)):
        raise ValueError(f"board {value!r} does not hold each of 0 .. {n * n - 1} exactly once (0 is the blank)")
    return board


def board_string(board: Board) -> str:
    """The ``board`` column form: ``"1 2 3/4 5 6/7 8 0"``."""
    return "/".join(" ".join(str(t) for t in row) for row in board)


def render_board(board: Board) -> str:
    """The board as the model sees it: one row per line, tiles right-aligned and space-separated, the blank ``_``."""
    width = len(str(len(board) ** 2 - 1))
    return "\n".join(" ".join(("_" if t == 0 else str(t)).rjust(width) for t in row) for row in board)


def _blank(board: Board) -> tuple[int, int]:
    for r, row in enumerate(board):
        for c, t in enumerate(row):
            if t == 0:
                return r, c
    raise ValueError(f"board {board!r} has no blank (0)")


def apply_move(board: Board, move: str) -> Board | None:
    """The board after the blank moves one step in direction ``move`` (``MOVES``), or None where that would leave the
    board. ``board`` is not changed.

    Raises:
        KeyError: ``move`` is not one of ``MOVES``.
    """
    dr, dc = MOVES[move]
    r, c = _blank(board)
    nr, nc = r + dr, c + dc
    if not (0 <= nr < len(board) and 0 <= nc < len(board)):
        return None
    out = [list(row) for row in board]
    out[r][c], out[nr][nc] = out[nr][nc], 0
    return out


def parse_move(text: str) -> str | None:
    """The move of an assistant message (module docstring): the word of its last ``<move>`` tag (closing tag
    optional), else its last word; lower-cased, or None when that is not one of ``MOVES``."""
    m = _LAST_TAG.search(text)
    if m is not None:
        word = m.group(1).strip(_PUNCT).lower()
    else:
        words = text.split()
        word = words[-1].strip(_PUNCT).lower() if words else ""
    return word if word in MOVES else None


def make_puzzles(n: int, size: int, scramble_moves: int, seed: int) -> list[dict[str, Any]]:
    """``n`` puzzles made by scrambling the solved board with ``scramble_moves`` random legal moves of the blank (none
    undoing the one before), so each is solvable in at most ``scramble_moves`` moves; a scramble that lands on the
    solved board gets one more move (then it is one move from solved). Deterministic for a ``seed``.

    Returns:
        ``n`` dicts ``{"board": "1 2 3/4 5 0/7 8 6", "scramble": ["up", ...]}``: the board in the ``board`` column form,
        and the blank's moves that made it (reversed and each replaced by its opposite, they solve it).

    Raises:
        ValueError: ``n`` < 0, ``size`` < 2 or ``scramble_moves`` < 1.
    """
    if n < 0 or scramble_moves < 1:
        raise ValueError(
            f"make_puzzles needs n >= 0 and scramble_moves >= 1, got n={n}, scramble_moves={scramble_moves}"
        )
    rng = random.Random(seed)
    start = solved_board(size)
    out = []
    for _ in range(n):
        board, moves = start, []
        while len(moves) < scramble_moves or is_solved(board):
            legal = [m for m in MOVES if apply_move(board, m) is not None and (not moves or m != OPPOSITE[moves[-1]])]
            move = rng.choice(legal)
            board = apply_move(board, move)
            moves.append(move)
        out.append({"board": board_string(board), "scramble": moves})
    return out


class SlidingPuzzleEnvironment(EnvironmentInterface):
    """The sliding puzzle as a multi-turn environment (module docstring for the board, the moves and the rewards).

    Runs in the process that calls ``step`` (no worker processes). Needs the multi-turn rollout loop: a single-turn
    rollout scores the first move only.

    Args:
        size: the board's side; every row's ``board`` must have it.
        max_moves: the moves an episode may take before it ends unsolved.

    Attributes:
        reward_weights: ``{"solved": 1.0}``.

    Raises:
        ValueError: ``size`` < 2 or ``max_moves`` < 1.
    """

    reward_weights = {"solved": 1.0}

    def __init__(self, size: int = 3, max_moves: int = 12) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise ValueError(f"SlidingPuzzleEnvironment size is {size!r}; give an int >= 2 (3 for the 8-puzzle)")
        if isinstance(max_moves, bool) or not isinstance(max_moves, int) or max_moves < 1:
            raise ValueError(f"SlidingPuzzleEnvironment max_moves is {max_moves!r}; give an int >= 1")
        self.size = size
        self.max_moves = max_moves
        self.reward_weights = {"solved": 1.0}
        self._counts = dict.fromkeys(("solved", "invalid", "out_of_moves", "moves"), 0)

    def _board(self, md: dict, i: int) -> Board:
        if "puzzle_board" in md:
            return parse_board(md["puzzle_board"], self.size)
        if "board" not in md:
            raise ValueError(
                f"sample {i} of the batch (row_id {md.get('row_id')!r}) has no 'board' column (its columns: "
                f"{sorted(md)}); give each row of the puzzle task its start board, e.g. '1 2 3/4 5 0/7 8 6'"
            )
        try:
            return parse_board(md["board"], self.size)
        except ValueError as err:
            raise ValueError(f"sample {i} of the batch (row_id {md.get('row_id')!r}): {err}") from None

    def step(self, message_log_batch: list[list[dict]], metadata: list[dict]) -> EnvironmentReturn:
        """Apply each sample's move and end the episodes that are solved, failed or out of moves.

        Args:
            message_log_batch: ``[B]`` message logs, each ending with the assistant's message.
            metadata: ``[B]`` each sample's metadata: its row's columns (``board``) and, after the first turn, the
                ``puzzle_board`` and ``puzzle_moves`` this method returned.

        Returns:
            ``rewards`` ``{"solved": [B] float32}`` (1.0 for a sample solved by this move, else 0.0), ``terminateds``
            ``[B]`` bool, ``observations`` ``{"role": "user", "content": <board> + "\\n\\nYour move?"}`` for a live
            sample and the outcome for a finished one, ``next_stop_strings`` ``["</move>"]`` for a live sample (None
            for a finished one), ``metadata`` with the new state, ``answers`` the parsed move (None if none).

        Raises:
            ValueError: the batch and metadata differ in length, a log does not end with the assistant's message, or a
                sample's board is missing or malformed (naming the sample and its row id).
        """
        import torch

        if len(message_log_batch) != len(metadata):
            raise ValueError(f"{len(message_log_batch)} message logs but {len(metadata)} metadata; give one per sample")
        observations, new_md, stops, answers = [], [], [], []
        rewards, done = [], []
        for i, (log, md) in enumerate(zip(message_log_batch, metadata, strict=True)):
            last = log[-1] if log else {}
            if last.get("role") != "assistant" or not isinstance(last.get("content"), str):
                raise ValueError(
                    f"message log {i} of the batch does not end with an assistant message (its last message: "
                    f"{last!r}); the rollout must append the model's turn before calling step"
                )
            board = self._board(md, i)
            moves = int(md.get("puzzle_moves", 0))
            move = parse_move(last["content"])
            after = apply_move(board, move) if move is not None else None
            if after is None:
                why = "no move found" if move is None else f"the blank cannot move {move}"
                text = f"Invalid move ({why}). Game over.\n\n{render_board(board)}"
                reward, finished, outcome = 0.0, True, "invalid"
            else:
                board, moves = after, moves + 1
                if is_solved(board):
                    text = f"Solved in {moves} moves.\n\n{render_board(board)}"
                    reward, finished, outcome = 1.0, True, "solved"
                elif moves >= self.max_moves:
                    text = f"Out of moves ({self.max_moves}). Game over.\n\n{render_board(board)}"
                    reward, finished, outcome = 0.0, True, "out_of_moves"
                else:
                    text = f"{render_board(board)}\n\nYour move?"
                    reward, finished, outcome = 0.0, False, ""
            if finished:
                self._counts[outcome] += 1
                self._counts["moves"] += moves
            observations.append({"role": "user", "content": text})
            new_md.append({**md, "puzzle_board": board, "puzzle_moves": moves})
            stops.append(None if finished else [STOP])
            answers.append(move)
            rewards.append(reward)
            done.append(finished)
        return EnvironmentReturn(
            observations=observations,
            metadata=new_md,
            next_stop_strings=stops,
            rewards={"solved": torch.tensor(rewards, dtype=torch.float32).reshape(len(rewards))},
            terminateds=torch.tensor(done, dtype=torch.bool).reshape(len(done)),
            answers=answers,
        )

    def global_post_process_and_metrics(self, batch: dict) -> tuple[dict, dict[str, float]]:
        """The batch as is, and counts over the episodes of the rollout that ``batch`` closes: those that ended
        (counted by ``step`` since the last call, then reset) and, when ``batch["metadata"]`` lists one entry per
        episode of the rollout (as the rollout loops pass it), those that did not end (cut off by the turn or length
        limit of the loop, or still live after a single-turn rollout's one move).

        Returns:
            ``episodes``, ``solved``, ``invalid`` (no move or an illegal one), ``out_of_moves``, ``unfinished`` and,
            with at least one episode, ``solved_fraction`` = solved / episodes; with at least one ended episode,
            ``mean_moves`` (valid moves per ended episode). Concurrent rollouts on one instance mix their counts.
        """
        c, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        ended = c["solved"] + c["invalid"] + c["out_of_moves"]
        listed = batch.get("metadata") if isinstance(batch, dict) else None
        episodes = max(ended, len(listed)) if isinstance(listed, list) else ended
        metrics = {k: float(c[k]) for k in ("solved", "invalid", "out_of_moves")}
        metrics.update(episodes=float(episodes), unfinished=float(episodes - ended))
        if episodes:
            metrics["solved_fraction"] = c["solved"] / episodes
        if ended:
            metrics["mean_moves"] = c["moves"] / ended
        return batch, metrics
