"""The features of one innings record, one cached row: for every delivery, cricketmodel's
context and ball features and its target (recipes/cricket/features.py), and this recipe's own
per-delivery arrays (legal balls, score, wickets, the state and actor nodes; the `--target
next-balls` label: runs scored from that delivery on, while fewer than 5 overs of legal balls
have been bowled since, cut at the innings' end), with the vocabulary indices of its players
and context.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from recipes.cricket.features import ball_features, innings_context, score_ahead
from recipes.cricket.parsing import BYE, LEGBYE, NOBALL, WICKET, WIDE
from recipes.cricket.vocab import UNKNOWN

WINDOW_OVERS = 5
STATE_DIM, ACTOR_DIM, BALL_DIM = 9, 7, 10


def _actor_stats(
    record: dict[str, Any], runs_batter: list[int], runs_total: list[int], flags: list[int]
) -> np.ndarray:
    """Before each delivery: the striker's and non-striker's innings so far (runs, balls faced,
    boundaries) and the bowler's spell so far (legal balls, runs conceded, wickets), (n, 9).
    Byes and leg byes are not the bowler's runs; a wide is not a ball faced."""
    batting: dict[str, tuple[int, int, int]] = {}
    bowling: dict[str, tuple[int, int, int]] = {}
    none = (0, 0, 0)
    rows = []
    for i, (hit, total, flag) in enumerate(zip(runs_batter, runs_total, flags, strict=True)):
        batter, bowler = record["batter"][i], record["bowler"][i]
        before = bowling.get(bowler, none)
        rows.append((*batting.get(batter, none), *batting.get(record["non_striker"][i], none)))
        rows[-1] += before
        runs, faced, boundaries = batting.get(batter, none)
        batting[batter] = (runs + hit, faced + (not flag & WIDE), boundaries + (hit >= 4))
        conceded = hit if flag & (BYE | LEGBYE) else total
        bowling[bowler] = (
            before[0] + (not flag & (WIDE | NOBALL)),
            before[1] + conceded,
            before[2] + bool(flag & WICKET),
        )
    return np.asarray(rows, dtype=np.float32).reshape(len(flags), 9)


def window_runs(runs_total: np.ndarray, legal_before: np.ndarray, window: int) -> np.ndarray:
    """Runs from each delivery on, over the deliveries bowled before `window` more legal balls
    are complete (a wide after the last of them belongs to the next window); cut at the
    innings' end."""
    cum = np.concatenate([[0], np.cumsum(runs_total)])
    end = np.searchsorted(legal_before, legal_before + window, side="left")
    return (cum[end] - cum[: len(runs_total)]).astype(np.float32)


def innings_features(
    record: dict[str, Any], vocab: dict[str, dict[str, int]], retired_is_wicket: bool = True
) -> dict[str, Any]:
    """Features of every delivery of one innings record (the state before it is bowled), the
    label, and the vocabulary indices of its players and context."""
    runs_total = np.asarray(record["runs_total"], dtype=np.int64)
    runs_batter = np.asarray(record["runs_batter"], dtype=np.int64)
    flags = np.asarray(record["flags"], dtype=np.int64)
    n = len(runs_total)
    per_over = record["balls_per_over"]
    legal = (flags & (WIDE | NOBALL)) == 0
    legal_before = np.cumsum(legal) - legal
    score = np.cumsum(runs_total) - runs_total
    dismissed = (flags & WICKET) > 0
    wickets = np.cumsum(dismissed) - dismissed
    max_balls = max(int(record["max_balls"]), 1)
    balls_left = np.maximum(max_balls - legal_before, 0)
    over = legal_before // per_over

    state = np.zeros((n, 4, STATE_DIM), dtype=np.float32)
    state[:, :, :4] = np.eye(4, dtype=np.float32)  # which state node: score, wickets, phase, chase
    rate = np.where(legal_before > 0, score * per_over / np.maximum(legal_before, 1), 0.0)
    last_wicket = np.maximum.accumulate(np.where(dismissed, np.arange(n), -1))
    since_wicket = np.arange(n) - np.concatenate([[-1], last_wicket[:-1]])
    state[:, 0, 4:7] = np.stack([score / 100, legal_before / 120, rate / 10], axis=1)
    state[:, 1, 4:7] = np.stack([wickets / 10, (10 - wickets) / 10, since_wicket / 120], axis=1)
    phase = np.stack([over < 6, (over >= 6) & (over < 15), over >= 15], axis=1)
    state[:, 2, 4:7] = phase
    state[:, 2, 7] = balls_left / 120
    state[:, 2, 8] = (legal_before % per_over) / per_over
    if record["target_runs"] > 0:
        needed = record["target_runs"] - score
        required = np.where(balls_left > 0, needed * per_over / np.maximum(balls_left, 1), 36.0)
        state[:, 3, 4] = 1.0
        state[:, 3, 5] = needed / 200
        state[:, 3, 6] = np.clip(required, -36, 36) / 20
        state[:, 3, 7] = record["target_runs"] / 250

    actors = np.zeros((n, 3, ACTOR_DIM), dtype=np.float32)
    actors[:, :, :3] = np.eye(3, dtype=np.float32)  # striker, non-striker, bowler
    stats = _actor_stats(record, runs_batter.tolist(), runs_total.tolist(), flags.tolist())
    striker, partner, bowler = stats[:, 0:3], stats[:, 3:6], stats[:, 6:9]
    for slot, (runs, balls, boundaries) in enumerate((striker.T, partner.T)):
        actors[:, slot, 3:] = np.stack(
            [runs / 100, balls / 60, runs / np.maximum(balls, 1) / 3, boundaries / 10], axis=1
        )
    balls, conceded, taken = bowler.T
    actors[:, 2, 3:] = np.stack(
        [balls / 24, conceded / 50, taken / 5, conceded / np.maximum(balls, 1)], axis=1
    )

    ball = np.stack(
        [
            runs_batter / 6,
            runs_total / 7,
            runs_total == 0,
            runs_batter == 4,
            runs_batter == 6,
            (flags & WIDE) > 0,
            (flags & NOBALL) > 0,
            (flags & (BYE | LEGBYE)) > 0,
            dismissed,
            legal_before / 120,
        ],
        axis=1,
    ).astype(np.float32)
    players = vocab["players"]
    ids = {
        key: [players.get(name, UNKNOWN) for name in record[key]]
        for key in ("batter", "non_striker", "bowler")
    }
    venue = vocab["venues"].get(record["venue"], UNKNOWN)
    teams = [vocab["teams"].get(record[k], UNKNOWN) for k in ("batting_team", "bowling_team")]
    if not retired_is_wicket:  # the corrected count: a retired batter may come back
        fell = np.asarray(record["n_wickets"]) - np.asarray(record["n_retired"])
        kind = np.where(fell > 0, np.asarray(record["wicket_kind"]), 0)
        record = record | {"n_wickets": fell.tolist(), "wicket_kind": kind.tolist()}
    number = int(record.get("innings", 0))  # a super-over record has none: no chase
    chase = record.get("file_target", -1) > 0 and number == 2
    over_col = np.asarray(record["over"], dtype=np.int64)
    target = int(record["file_target"]) if chase else None
    context = innings_context(record, number, target, vocab.get("player_bowling_types"))
    return {
        "o_ctx": context.reshape(-1),
        "o_ball": ball_features(record).reshape(-1),
        "o_y": score_ahead(runs_total, over_col),
        "over": over_col.astype(np.int16),
        "o_chase": int(chase),
        "venue_id": venue,
        "batting_id": teams[0],
        "bowling_id": teams[1],
        "actor_ids": np.stack([ids["batter"], ids["non_striker"], ids["bowler"]], 1).reshape(-1),
        "state_x": state.reshape(-1),
        "actor_x": actors.reshape(-1),
        "ball_x": ball.reshape(-1),
        "y": window_runs(runs_total, legal_before, WINDOW_OVERS * per_over),
        "legal_before": legal_before.astype(np.int32),
        "wickets": wickets.astype(np.int8),
        "score": score.astype(np.int32),
        "sample_pos": np.flatnonzero(legal).astype(np.int32),
        "o_pos": np.arange(1, n, dtype=np.int32),
    }
