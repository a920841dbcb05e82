"""The sliding puzzle: board parsing and rendering, the move rules, the multi-turn environment's rewards, termination
and state carried in metadata, its metrics, and the seeded, solvable puzzles of make_puzzles."""

from __future__ import annotations

import runpy
from collections import deque
from pathlib import Path

import pytest
import torch

from rl.config import load_config
from rl.environments import EnvironmentInterface, weighted_total
from rl.environments.registry import build_environments
from rl.environments.sliding_puzzle import (
    MOVES,
    SlidingPuzzleEnvironment,
    apply_move,
    board_string,
    is_solved,
    make_puzzles,
    parse_board,
    parse_move,
    render_board,
    solved_board,
)

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.timeout(60)


def _log(text: str) -> list[dict]:
    return [{"role": "user", "content": "the board"}, {"role": "assistant", "content": text, "token_ids": [1]}]


def _distance(board: list[list[int]], limit: int) -> int | None:
    """Fewest moves to the solved board by breadth-first search, None beyond ``limit``."""
    goal = board_string(solved_board(len(board)))
    seen, queue = {board_string(board)}, deque([(board, 0)])
    while queue:
        b, d = queue.popleft()
        if board_string(b) == goal:
            return d
        if d == limit:
            continue
        for m in MOVES:
            nb = apply_move(b, m)
            if nb is not None and board_string(nb) not in seen:
                seen.add(board_string(nb))
                queue.append((nb, d + 1))
    return None


# --- the game ---------------------------------------------------------------------------------------------------------
def test_solved_board_and_the_board_forms():
    assert solved_board(3) == [[1, 2, 3], [4, 5, 6], [7, 8, 0]]
    assert solved_board(2) == [[1, 2], [3, 0]]
    assert parse_board("1 2 3/4 5 6/7 8 0") == solved_board(3)
    assert parse_board("1,2\n_,3") == [[1, 2], [0, 3]]
    assert parse_board([[1, 2], [0, 3]], size=2) == [[1, 2], [0, 3]]
    assert board_string([[1, 2], [0, 3]]) == "1 2/0 3"
    assert render_board([[1, 2], [0, 3]]) == "1 2\n_ 3"
    assert render_board(solved_board(4)).splitlines()[3] == "13 14 15  _"
    assert is_solved(solved_board(4)) and not is_solved([[1, 2], [0, 3]])


@pytest.mark.parametrize(
    ("value", "size", "fragment"),
    [
        ("1 2/3 3", None, "does not hold each of 0 .. 3 exactly once"),
        ("1 2 3/4 5 6", None, "is not a square of at least 2 x 2 tiles"),
        ("1 2/3 x", None, "holds a tile that is not an integer"),
        ([[1, 2], [3, 0]], 3, "is 2 x 2 but the environment plays size 3; set size: 2"),
        (12, None, "is a int; give a list of rows of ints"),
    ],
)
def test_parse_board_refuses_malformed_boards(value, size, fragment):
    with pytest.raises(ValueError, match="board") as info:
        parse_board(value, size)
    assert fragment in str(info.value)


def test_a_move_names_the_direction_the_blank_moves():
    board = [[1, 2, 3], [4, 0, 5], [7, 8, 6]]
    assert apply_move(board, "up") == [[1, 0, 3], [4, 2, 5], [7, 8, 6]]
    assert apply_move(board, "down") == [[1, 2, 3], [4, 8, 5], [7, 0, 6]]
    assert apply_move(board, "left") == [[1, 2, 3], [0, 4, 5], [7, 8, 6]]
    assert apply_move(board, "right") == [[1, 2, 3], [4, 5, 0], [7, 8, 6]]
    assert board == [[1, 2, 3], [4, 0, 5], [7, 8, 6]]  # unchanged
    corner = solved_board(3)  # blank bottom right
    assert apply_move(corner, "down") is None and apply_move(corner, "right") is None
    with pytest.raises(KeyError):
        apply_move(corner, "north")


@pytest.mark.parametrize(
    ("text", "move"),
    [
        ("<move>up</move>", "up"),
        ("I think <move> Left </move>", "left"),
        ("first <move>up</move> then <move>down", "down"),  # the last tag; the stop string left out of the text
        ("<move>up</move> and then I'd say right", "up"),  # a tag beats the last word
        ("The blank goes DOWN.", "down"),
        ("<move>diagonal</move>", None),
        ("<move>up</move><move>sideways</move>", None),
        ("I give up?!", "up"),
        ("no idea", None),
        ("", None),
    ],
)
def test_parse_move(text, move):
    assert parse_move(text) == move


def test_make_puzzles_is_seeded_and_every_puzzle_is_solvable_within_its_scramble():
    puzzles = make_puzzles(20, 3, 6, seed=7)
    assert puzzles == make_puzzles(20, 3, 6, seed=7)
    assert puzzles != make_puzzles(20, 3, 6, seed=8)
    for p in puzzles:
        board = parse_board(p["board"], 3)
        assert not is_solved(board)
        assert 1 <= _distance(board, 6) <= 6 <= len(p["scramble"])
        for move in reversed(p["scramble"]):  # undoing the scramble solves it
            board = apply_move(board, {"up": "down", "down": "up", "left": "right", "right": "left"}[move])
        assert is_solved(board)
    # 2 x 2: the 12-move scramble without reversals comes back to the solved board, and gets one more move
    for p in make_puzzles(10, 2, 12, seed=0):
        assert len(p["scramble"]) == 13 and _distance(parse_board(p["board"]), 13) == 1
    with pytest.raises(ValueError, match="scramble_moves >= 1"):
        make_puzzles(1, 3, 0, seed=0)


# --- the environment --------------------------------------------------------------------------------------------------
def test_a_solving_move_gives_reward_1_and_terminates():
    env = SlidingPuzzleEnvironment(size=2, max_moves=6)
    assert isinstance(env, EnvironmentInterface) and env.reward_weights == {"solved": 1.0}
    md = [{"board": "1 2/0 3", "row_id": "a"}, {"board": "1 2/0 3", "row_id": "b"}]
    # the blank moving up leaves sample 0 unsolved; moving right solves sample 1 (the tile 3 slides left)
    out = env.step([_log("<move>up"), _log("<move>right</move>")], md)
    assert out.rewards["solved"].dtype == torch.float32 and out.rewards["solved"].tolist() == [0.0, 1.0]
    assert out.terminateds.tolist() == [False, True]
    assert out.next_stop_strings == [["</move>"], None]
    assert out.answers == ["up", "right"]
    assert out.observations[0] == {"role": "user", "content": "_ 2\n1 3\n\nYour move?"}
    assert out.observations[1] == {"role": "user", "content": "Solved in 1 moves.\n\n1 2\n3 _"}
    assert out.metadata[1] == {"board": "1 2/0 3", "row_id": "b", "puzzle_board": [[1, 2], [3, 0]], "puzzle_moves": 1}
    assert weighted_total(out.rewards, env.reward_weights).tolist() == [0.0, 1.0]


def test_an_invalid_or_missing_move_terminates_with_0_and_is_counted():
    env = SlidingPuzzleEnvironment(size=2, max_moves=6)
    md = [{"board": [[1, 2], [3, 0]]}, {"board": [[1, 2], [3, 0]]}]
    out = env.step([_log("<move>down</move>"), _log("I am not sure")], md)
    assert out.rewards["solved"].tolist() == [0.0, 0.0] and out.terminateds.tolist() == [True, True]
    assert out.observations[0]["content"].startswith("Invalid move (the blank cannot move down). Game over.")
    assert out.observations[1]["content"].startswith("Invalid move (no move found). Game over.")
    assert out.next_stop_strings == [None, None] and out.answers == ["down", None]
    _, metrics = env.global_post_process_and_metrics({"x": 1})
    assert metrics == {
        "episodes": 2.0,
        "solved": 0.0,
        "invalid": 2.0,
        "out_of_moves": 0.0,
        "unfinished": 0.0,
        "solved_fraction": 0.0,
        "mean_moves": 0.0,
    }
    _, again = env.global_post_process_and_metrics({})  # reset after each call
    assert again == {"episodes": 0.0, "solved": 0.0, "invalid": 0.0, "out_of_moves": 0.0, "unfinished": 0.0}


def test_metrics_count_the_episodes_the_rollout_cut_off():
    env = SlidingPuzzleEnvironment(size=2, max_moves=6)
    out = env.step([_log("<move>right</move>"), _log("<move>up</move>")], [{"board": "1 2/0 3"}] * 2)
    assert out.terminateds.tolist() == [True, False]  # the second episode is cut off by the loop after this turn
    batch = {"rewards": torch.tensor([1.0, 0.0, 0.0]), "metadata": [*out.metadata, {"board": "1 2/0 3"}]}
    returned, metrics = env.global_post_process_and_metrics(batch)
    assert returned is batch
    assert metrics["episodes"] == 3.0 and metrics["unfinished"] == 2.0 and metrics["solved"] == 1.0
    assert metrics["solved_fraction"] == pytest.approx(1 / 3) and metrics["mean_moves"] == 1.0


def test_metadata_carries_the_state_between_turns_until_max_moves():
    env = SlidingPuzzleEnvironment(size=3, max_moves=3)
    md = [{"board": "1 2 3/4 5 6/7 0 8", "row_id": "r"}]
    # left, right, left: never solved; the third move uses up max_moves
    out = env.step([_log("<move>left</move>")], md)
    assert out.metadata[0]["puzzle_board"] == [[1, 2, 3], [4, 5, 6], [0, 7, 8]]
    assert out.metadata[0]["puzzle_moves"] == 1 and not out.terminateds[0]
    out = env.step([_log("right")], out.metadata)
    assert out.metadata[0]["puzzle_board"] == [[1, 2, 3], [4, 5, 6], [7, 0, 8]] and out.metadata[0]["puzzle_moves"] == 2
    assert out.metadata[0]["board"] == "1 2 3/4 5 6/7 0 8"  # the row's column stays as it was
    out = env.step([_log("<move>left</move>")], out.metadata)
    assert out.terminateds.tolist() == [True] and out.rewards["solved"].tolist() == [0.0]
    assert out.observations[0]["content"] == "Out of moves (3). Game over.\n\n1 2 3\n4 5 6\n_ 7 8"
    # one more episode solved on its second move, through the carried state
    out = env.step([_log("<move>up</move>")], [{"board": "1 2 3/4 5 6/7 8 0"}])
    out = env.step([_log("<move>down</move>")], out.metadata)
    assert out.rewards["solved"].tolist() == [1.0] and out.metadata[0]["puzzle_moves"] == 2
    _, metrics = env.global_post_process_and_metrics({})
    assert metrics["episodes"] == 2.0 and metrics["solved"] == 1.0 and metrics["out_of_moves"] == 1.0
    assert metrics["unfinished"] == 0.0
    assert metrics["solved_fraction"] == 0.5 and metrics["mean_moves"] == 2.5


def test_the_environment_refuses_bad_rows_and_settings():
    env = SlidingPuzzleEnvironment(size=3)
    with pytest.raises(ValueError, match=r"sample 0 of the batch \(row_id 'r'\) has no 'board' column"):
        env.step([_log("up")], [{"row_id": "r", "prompt": "p"}])
    with pytest.raises(ValueError, match=r"sample 0 of the batch \(row_id None\): board '1 2/3 0' is 2 x 2 but"):
        env.step([_log("up")], [{"board": "1 2/3 0"}])
    with pytest.raises(ValueError, match="does not end with an assistant message"):
        env.step([[{"role": "user", "content": "q"}]], [{"board": "1 2 3/4 5 6/7 8 0"}])
    with pytest.raises(ValueError, match="size is 1; give an int >= 2"):
        SlidingPuzzleEnvironment(size=1)
    with pytest.raises(ValueError, match="max_moves is 0; give an int >= 1"):
        SlidingPuzzleEnvironment(max_moves=0)


# --- the example ------------------------------------------------------------------------------------------------------
def test_the_example_dataset_and_config_play_a_whole_episode():
    make = runpy.run_path(str(ROOT / "examples/sliding_puzzle/make_dataset.py"))
    rows = make["rows"](4, 2, 3, 0)
    assert rows == make["rows"](4, 2, 3, 0) and [sorted(r) for r in rows] == [["answer", "board", "prompt"]] * 4
    puzzles = make_puzzles(4, 2, 3, 0)
    assert [r["board"] for r in rows] == [p["board"] for p in puzzles]
    assert rows[0]["prompt"].endswith(f"The board:\n\n{render_board(parse_board(rows[0]['board']))}\n\nYour move?")
    cfg = load_config(str(ROOT / "examples/sliding_puzzle/config.yaml"))
    assert cfg.grpo.max_rollout_turns == 6 and cfg.default_task == "puzzle"
    envs = build_environments(cfg.task_specs(), num_workers=1, timeout_s=5.0, reasoning_gym_defaults={})
    env = envs["puzzle"]
    # undo the scramble one move per turn, each reply in the prompt's format, the metadata carried as the loop does
    md = [{"board": rows[0]["board"], "answer": rows[0]["answer"], "row_id": "train:0", "task_name": "puzzle"}]
    undo = [{"up": "down", "down": "up", "left": "right", "right": "left"}[m] for m in reversed(puzzles[0]["scramble"])]
    for turn, move in enumerate(undo, 1):
        out = env.step([_log(f"I will move the blank {move}: <move>{move}</move>")], md)
        md = out.metadata
        if out.terminateds[0]:
            break
    assert out.rewards["solved"].tolist() == [1.0] and md[0]["puzzle_moves"] == turn <= 3
    assert is_solved(md[0]["puzzle_board"])
