"""Write the sliding puzzle example dataset: one row per puzzle, as JSON Lines with the columns ``prompt`` (the rules
and the start board), ``board`` (the start board, ``"1 2/0 3"``: rows split by ``/``, 0 the blank, what
``rl.environments.sliding_puzzle.SlidingPuzzleEnvironment`` reads) and ``answer`` (the scramble's length: an upper
bound on the moves the puzzle needs, logged beside each completion, unused by the reward).

    python examples/sliding_puzzle/make_dataset.py        # -> runs/examples/sliding_puzzle.jsonl: 2 x 2, 512 rows
    python examples/sliding_puzzle/make_dataset.py --size 3 --scramble-moves 6 --rows 64 --out /tmp/p.jsonl

Deterministic: the same rows for the same arguments (``rl.environments.sliding_puzzle.make_puzzles``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rl.environments.sliding_puzzle import make_puzzles, parse_board, render_board, solved_board

RULES = (
    "Solve the sliding puzzle. The board has {size} rows of {size} tiles; _ is the blank. Each turn, move the blank "
    "one step by answering exactly one move in tags: <move>up</move>, <move>down</move>, <move>left</move> or "
    "<move>right</move> (up swaps the blank with the tile above it). Moving the blank off the board ends the game. "
    "The puzzle is solved when the board reads:\n\n{goal}\n\nThe board:\n\n{board}\n\nYour move?"
)


def rows(n: int, size: int, scramble_moves: int, seed: int) -> list[dict[str, str]]:
    """``n`` rows of ``size x size`` puzzles, each solvable in at most ``scramble_moves`` moves."""
    goal = render_board(solved_board(size))
    out = []
    for p in make_puzzles(n, size, scramble_moves, seed):
        board = render_board(parse_board(p["board"], size))
        out.append(
            {
                "prompt": RULES.format(size=size, goal=goal, board=board),
                "board": p["board"],
                "answer": str(len(p["scramble"])),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--scramble-moves", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/examples/sliding_puzzle.jsonl")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = rows(args.rows, args.size, args.scramble_moves, args.seed)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in data))
    tmp.replace(out)  # never a torn file
    print(f"wrote {len(data)} rows to {out}; first board: {data[0]['board']}")


if __name__ == "__main__":
    main()
