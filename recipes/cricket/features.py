"""cricketmodel's features, target and edges (lyndonkl/cricketmodel @a97d68e, src/data/
feature_utils.py, edge_builder.py, hetero_data_builder.py), computed once per innings in one
pass (the original recomputes each feature from the whole history for every delivery) and
assembled into the original's graph per sample.

For delivery i of an innings the graph is the state before it: the 19 context nodes' features
from deliveries 0..i-1, one ball node per earlier delivery (wides and no-balls included) and the
target, the runs from delivery i up to an over boundary (the end of over 5 in the first five
overs, of over 20 from over 15 on, else 5 overs on; `score_ahead`). The original's choices are
kept where they differ from this recipe's reader, so that outputs are comparable: any entry in
a delivery's `wickets` (a retired-hurt batter too) counts as a wicket, the chase is the file's
`target` (a data-version 1.0.0 file has none: its second innings is not a chase), the phase and
the dynamics count deliveries (wides included) where the score state counts legal balls.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from recipes.cricket.schema import (
    ATTR_RELATIONS,
    BALL_FEATURE_DIM,
    BALL_RELATIONS,
    FEATURE_DIMS,
    LAYER_NODES,
    STATIC_EDGES,
)

WIDE, NOBALL, BYE, LEGBYE = 1, 2, 4, 8
# the first wicket's kind, as compute_ball_features groups them
KINDS = {"bowled": 1, "caught": 2, "caught and bowled": 2, "lbw": 3, "run out": 4, "stumped": 5}
OTHER_KIND = 6
CTX_DIM = sum(FEATURE_DIMS.values())  # 59: the 13 numeric context nodes, in FEATURE_DIMS order
LOOKBACK = 12  # compute_dynamics' window, and the balls that `inform` the dynamics nodes


def wicket_kind(kind: Any) -> int:
    return KINDS.get(str(kind if kind is not None else "other").lower(), OTHER_KIND)


def score_ahead(runs_total: np.ndarray, over: np.ndarray, lookahead: int = 5) -> np.ndarray:
    """compute_score_ahead_target for every delivery: runs from it up to the over boundary."""
    boundary = np.where(over < lookahead, lookahead, np.where(over >= 20 - lookahead, 20, over + 5))
    before = np.cumsum(runs_total) - runs_total
    # runs of all deliveries with over < boundary (the overs are in order within an innings)
    upto = np.concatenate([[0], np.cumsum(runs_total)])[np.searchsorted(over, boundary, "left")]
    return (upto - before).astype(np.float32)


def _batter(stats: dict, name: str, last: dict, n: int) -> list[float]:
    runs, faced, dots, fours = stats.get(name, (0, 0, 0, 0))
    rate = runs / faced * 100 if faced else 0.0
    since = 1.0 if name not in last else min((n - last[name] - 1) / 12.0, 1.0)
    return [
        min(runs / 100.0, 1.0), min(faced / 60.0, 1.0), min(rate / 200.0, 1.0),
        dots / faced if faced else 0.0, float(faced > 10), min(fours / 10.0, 1.0),
        float(faced == 0), since,
    ]  # fmt: skip


def innings_context(
    rec: dict[str, Any],
    innings_num: int,
    target: int | None,
    bowling_types: dict[str, str] | None = None,
) -> np.ndarray:
    """The 59 context features before every delivery (n, CTX_DIM), in FEATURE_DIMS order.
    `bowling_types`: a bowler's 'pace' or 'spin' (the original's LLM classification, in an
    imported vocabulary); any other, or none, is unknown: neither, as the original offline."""
    bowling_types = bowling_types or {}
    batter, partner, bowler = rec["batter"], rec["non_striker"], rec["bowler"]
    runs_batter, runs_total, flags = rec["runs_batter"], rec["runs_total"], rec["flags"]
    n_wickets = rec["n_wickets"]
    womens = float(rec.get("female", 0))
    chasing = innings_num == 2 and target is not None
    out = np.zeros((len(runs_total), CTX_DIM), dtype=np.float32)
    runs = wickets = legal = 0
    batting: dict = {}
    bowling: dict = {}
    last_faced: dict = {}
    pairs: dict = {}  # partnership runs and legal balls since the last wicket, per pair
    last_wicket, last_boundary = -1, -1
    recent: list[tuple[int, int]] = []  # (runs total, has wickets) of the last 12 deliveries
    for i in range(len(runs_total)):
        n = i  # deliveries before this one
        row: list[float] = [min(runs / 250.0, 1.0), wickets / 10.0, min(legal / 120.0, 1.0)]
        row += [1.0 if innings_num == 2 else 0.0, womens]
        if chasing:
            needed = max(target - runs, 0)
            rate = needed / (max(120 - legal, 1) / 6.0)
            difficulty = next((d for lim, d in ((6, 0.0), (8, .25), (10, .5), (12, .75))
                               if rate < lim), 1.0)  # fmt: skip
            row += [min(needed / 250.0, 1.0), min(rate / 20.0, 1.0), 1.0, min(rate / 12.0, 1.0)]
            row += [difficulty, max(120 - legal, 1) / 120.0, (10 - wickets) / 10.0]
        else:
            row += [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
        over = n // 6
        row += [float(over < 6), float(6 <= over < 16), float(over >= 16), (n % 6) / 6.0]
        row += [float(n == 0), 0.0]  # is_super_over: super overs are not samples here
        left = max(120 - n, 0)
        urgency = 0.0
        if chasing and left > 0:
            urgency = min(max(max(target - runs, 0) / left * 6 - 8.0, 0.0) / 12.0, 1.0)
        row += [left / 120.0, urgency, float(over >= 19)]
        row += [(10 - wickets) / 10.0, float(10 - wickets < 3)]
        row += _batter(batting, batter[i], last_faced, n)
        row += _batter(batting, partner[i], last_faced, n)
        conceded, balls, taken, dots = bowling.get(bowler[i], (0, 0, 0, 0))
        economy = conceded / (balls / 6.0) if balls else 0.0
        threat = 0.0
        if balls:
            threat = min(taken / (balls / 6.0) * 0.5 + max(1.0 - economy / 10.0, 0.0) * 0.5, 1.0)
        row += [min(balls / 24.0, 1.0), min(conceded / 50.0, 1.0), min(taken / 5.0, 1.0)]
        kind = bowling_types.get(bowler[i], "unknown")
        row += [min(economy / 15.0, 1.0), dots / balls if balls else 0.0, threat]
        row += [float(kind == "pace"), float(kind == "spin")]
        p_runs, p_balls = pairs.get(frozenset((batter[i], partner[i])), (0, 0))
        p_rate = p_runs / (p_balls / 6.0) if p_balls else 0.0
        row += [min(p_runs / 100.0, 1.0), min(p_balls / 60.0, 1.0), min(p_rate / 10.0, 1.0)]
        row += [min(p_balls / 30.0, 1.0)]
        row += _dynamics(recent, n, runs, wickets, target if chasing else None)
        row += _dot_pressure(recent, n, last_boundary, last_wicket)
        out[i] = row
        # this delivery joins the history
        hit, total, flag, fell = runs_batter[i], runs_total[i], flags[i], n_wickets[i]
        is_legal = not flag & (WIDE | NOBALL)
        r, f, d, b = batting.get(batter[i], (0, 0, 0, 0))
        if flag & WIDE:
            batting[batter[i]] = (r + hit, f, d, b)
        else:
            batting[batter[i]] = (r + hit, f + 1, d + (hit == 0), b + (hit in (4, 6)))
        last_faced[batter[i]] = i
        c, bl, t, dt = bowling.get(bowler[i], (0, 0, 0, 0))
        bowling[bowler[i]] = (c + total, bl + is_legal, t + fell, dt + (is_legal and total == 0))
        if fell:
            pairs, last_wicket = {}, i
        else:
            key = frozenset((batter[i], partner[i]))
            pr, pb = pairs.get(key, (0, 0))
            pairs[key] = (pr + total, pb + is_legal)
        if hit in (4, 6):
            last_boundary = i
        runs, wickets, legal = runs + total, wickets + fell, legal + is_legal
        recent = [*recent[-(LOOKBACK - 1) :], (total, fell > 0)]
    return out


def _dynamics(recent, n: int, runs: int, wickets: int, target: int | None) -> list[float]:
    if not recent:
        return [0.0, 0.0, 0.0]
    rate = sum(t for t, _ in recent) / (len(recent) / 6.0)
    over = n // 6
    expected = 7.5 if over < 6 else 8.0 if over < 16 else 10.0
    momentum = max(min(rate / expected - 1.0, 1.0), -1.0)
    if target is not None:
        rrr = max(target - runs, 0) / (max(120 - n, 1) / 6.0)
        pressure = min(rrr / 15.0, 1.0) * 0.4 + wickets / 10.0 * 0.3 + n / 120.0 * 0.3
    else:
        pressure = wickets / 10.0 * 0.5
    return [momentum, -momentum, min(pressure, 1.0)]


def _dot_pressure(recent, n: int, last_boundary: int, last_wicket: int) -> list[float]:
    if not recent:
        return [0.0, 0.0, 1.0, 0.0, 0.0]
    dots = 0
    for total, _ in reversed(recent):
        if total:
            break
        dots += 1
    since_boundary = n - last_boundary - 1  # n when no boundary yet (last_boundary -1)
    since_wicket = n if last_wicket < 0 else n - last_wicket - 1
    accumulated = trend = 0.0
    if len(recent) >= 6:
        pressures = []
        for total, fell in recent:
            p = 1.0 if total == 0 else 0.5 if total == 1 else 0.0
            pressures.append(min(p + 0.5, 1.0) if fell else p)
        weights = [0.7 ** (len(pressures) - k - 1) for k in range(len(pressures))]
        accumulated = sum(p * w for p, w in zip(pressures, weights, strict=True)) / sum(weights)
        mid = len(pressures) // 2
        early = sum(pressures[:mid]) / mid
        late = sum(pressures[mid:]) / (len(pressures) - mid)
        trend = max(min(late - early, 1.0), -1.0)
    return [min(dots / 6.0, 1.0), min(since_boundary / 12.0, 1.0), min(since_wicket / 30.0, 1.0),
            accumulated, trend]  # fmt: skip


def ball_features(rec: dict[str, Any]) -> np.ndarray:
    """compute_ball_features of every delivery, (n, 18)."""
    runs_total = np.asarray(rec["runs_total"], dtype=np.float32)
    runs_batter = np.asarray(rec["runs_batter"])
    flags = np.asarray(rec["flags"])
    over = np.asarray(rec["over"], dtype=np.float32)
    kind = np.asarray(rec["wicket_kind"])
    run_out = np.asarray(rec["run_out"])
    out = np.zeros((len(runs_total), BALL_FEATURE_DIM), dtype=np.float32)
    out[:, 0] = runs_total / 6.0
    out[:, 1] = np.asarray(rec["n_wickets"]) > 0
    out[:, 2] = over / 20.0
    out[:, 3] = np.asarray(rec["ball_in_over"], dtype=np.float32) / 6.0
    out[:, 4] = (runs_batter == 4) | (runs_batter == 6)
    for col, bit in enumerate((WIDE, NOBALL, BYE, LEGBYE), start=5):
        out[:, col] = (flags & bit) > 0
    for code in range(1, 7):
        out[:, 8 + code] = kind == code
    out[:, 15] = run_out == 1
    out[:, 16] = run_out == 2
    out[:, 17] = over % 2
    return out


# --------------------------------------------------------------------------- edges


def _pairs(members: np.ndarray, causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """Edges within one group, (i<j) in order; both directions interleaved unless causal."""
    i, j = np.triu_indices(len(members), 1)
    src, dst = members[i], members[j]
    if causal:
        return src, dst
    return np.stack([src, dst], 1).reshape(-1), np.stack([dst, src], 1).reshape(-1)


def _groups(keys: np.ndarray) -> list[np.ndarray]:
    """Indices of each distinct key, groups in order of first appearance (a dict's order)."""
    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    return [np.flatnonzero(inverse == g) for g in np.argsort(first)]


def ball_edges(bowler: np.ndarray, batter: np.ndarray, over: np.ndarray) -> dict:
    """The ball-to-ball edges of a history (edge_builder.build_temporal_edges): {relation:
    (edge_index (2, E), edge_attr (E, 1) or None)}."""
    n = len(bowler)
    if n == 0:
        empty = torch.zeros((2, 0), dtype=torch.long)
        return {r: (empty, torch.zeros((0, 1)) if r in ATTR_RELATIONS else None)
                for r in BALL_RELATIONS}  # fmt: skip
    edges = {}
    i, j = np.triu_indices(n, 1)
    gap = j - i
    recent, medium = gap <= 6, (gap > 6) & (gap <= 24)
    distant = (gap > 24) & (gap % 6 == 0)
    edges["recent_precedes"] = (i[recent], j[recent], gap[recent] / 6.0)
    edges["medium_precedes"] = (i[medium], j[medium], (gap[medium] - 6) / 18.0)
    edges["distant_precedes"] = (i[distant], j[distant], (gap[distant] - 24) / 120.0)
    for rel, keys, window in (("same_bowler", bowler, 24.0), ("same_batsman", batter, 60.0)):
        parts = [_pairs(g, causal=False) for g in _groups(keys) if len(g) > 1]
        src = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
        dst = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
        edges[rel] = (src, dst, np.abs(dst - src) / window)
    parts = [_pairs(g, True) for g in _groups(np.stack([bowler, batter], 1)) if len(g) > 1]
    src = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
    dst = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
    edges["same_matchup"] = (src, dst, None)
    parts, attrs = [], []
    for g in _groups(over):
        if len(g) > 1:
            a, b = np.triu_indices(len(g), 1)
            parts.append((g[a], g[b]))
            attrs.append(np.minimum(b / 5.0, 1.0))  # the later ball's position in its over
    src = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
    dst = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
    edges["same_over"] = (src, dst, np.concatenate(attrs) if attrs else np.zeros(0))
    out = {}
    for rel in BALL_RELATIONS:
        src, dst, attr = edges[rel]
        index = torch.from_numpy(np.stack([src, dst]).astype(np.int64)).view(2, -1)
        if rel in ATTR_RELATIONS:
            out[rel] = (index, torch.as_tensor(np.asarray(attr), dtype=torch.float32).view(-1, 1))
        else:
            out[rel] = (index, None)
    return out


def static_edges() -> dict:
    """The context edges every graph has: one node to one node."""
    one = torch.zeros(2, 1, dtype=torch.long)
    return {edge: one for edge in STATIC_EDGES}


def cross_edges(bat, bowl, part, striker: int, bowler: int, partner: int, n: int) -> dict:
    """Ball -> current actor (faced_by, partnered_by, bowled_by), the last 12 balls -> each
    dynamics node (informs), every ball -> query (attends)."""

    def to_node(mask: np.ndarray) -> torch.Tensor:
        src = torch.from_numpy(np.flatnonzero(mask).astype(np.int64))
        return torch.stack([src, torch.zeros_like(src)])

    out = {
        ("ball", "faced_by", "striker_identity"): to_node(bat == striker),
        ("ball", "partnered_by", "nonstriker_identity"): to_node(
            (part == partner) | (bat == partner)
        ),
        ("ball", "bowled_by", "bowler_identity"): to_node(bowl == bowler),
    }  # fmt: skip
    recent = np.zeros(n, dtype=bool)
    recent[max(0, n - LOOKBACK) :] = True
    for node in LAYER_NODES["dynamics"]:
        out[("ball", "informs", node)] = to_node(recent)
    out[("ball", "attends", "query")] = to_node(np.ones(n, dtype=bool))
    return out
