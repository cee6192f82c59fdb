"""Cricsheet match JSON for the cricket recipe: reading real files, per-delivery features, and an
innings simulator that writes files in the same format.

Reading (`parse_match`): one file is one match, `{"meta", "info", "innings"}` as Cricsheet's
`t20s_male_json.zip` holds it (data versions 1.0.0 and 1.1.0). Each regular innings becomes one
record of per-delivery columns; super-over innings are kept apart (counted, never trained on);
a no-result or abandoned match gives no records (its innings were ended by the weather, so runs
"in the next 5 overs" would be wrong). Wides and no-balls are deliveries but not legal balls;
a retired-hurt or retired-not-out batter is not a wicket. A chase's target is the innings'
`target` (1.1.0; revised by DLS) or, where a 1.0.0 file has none, the first innings' total + 1.

Features (`innings_features`): for every delivery, the state before it is bowled (score, wickets,
legal balls, phase, chase, the three actors' innings so far) and the label: runs scored from
that delivery on, while fewer than 5 overs of legal balls have been bowled since, cut at the
innings' end.

`write_dataset` simulates T20 matches ball by ball: outcome probabilities depend on the phase
(powerplay, middle, death), wickets in hand, the venue, and latent batting and bowling skills of
each player, so the runs to come are learnable from who is batting and bowling and the state.
"""

from __future__ import annotations

import json
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import numpy as np

from accel_common.errors import DataError

WINDOW_OVERS = 5
# bit flags of a delivery's `flags` column
WIDE, NOBALL, BYE, LEGBYE, WICKET, RETIRED = 1, 2, 4, 8, 16, 32
NOT_DISMISSED = {"retired hurt", "retired not out"}  # the batter may come back: no wicket
DEFAULT_MATCH_TYPES = ("T20", "IT20")
STATE_DIM, ACTOR_DIM, BALL_DIM = 9, 7, 10
UNKNOWN = 0  # vocabulary index of names not seen (often enough) in the training split


class NotAMatch(Exception):
    """A .json file that is not a Cricsheet match (skipped with a warning, or --strict)."""


def parse_match(path: Path, match_types: tuple[str, ...]) -> tuple[str, list[dict[str, Any]]]:
    """(status, innings records) of one match file. Status: "ok", "match_type" (not among
    `match_types`), "no_result" (no result or abandoned). Raises NotAMatch for a file that is
    not a match, DataError for a match with a malformed delivery."""
    try:
        match = json.loads(Path(path).read_bytes())
    except (UnicodeDecodeError, ValueError) as err:
        raise NotAMatch(f"not valid JSON ({err})") from None
    if not isinstance(match, dict) or not isinstance(match.get("info"), dict):
        raise NotAMatch("no 'info' object, so not a Cricsheet match")
    info = match["info"]
    missing = [k for k in ("teams", "match_type", "outcome") if k not in info]
    if missing or not isinstance(match.get("innings", []), list):
        raise NotAMatch(f"no {', '.join(missing) or 'innings list'} in it")
    if info["match_type"] not in match_types:
        return "match_type", []
    innings = match.get("innings", [])
    if info["outcome"].get("result") == "no result" or not innings:
        return "no_result", []
    registry = info.get("registry", {}).get("people", {})
    teams = list(info["teams"])
    balls_per_over = int(info.get("balls_per_over", 6))
    max_balls = int(info.get("overs", 20)) * balls_per_over
    records, first_total = [], None
    for number, inning in enumerate(innings, start=1):
        where = f"{path}, innings {number}"
        record = _read_innings(inning, where, registry)
        if inning.get("super_over"):
            record["status"] = "super_over"
        else:
            record["status"] = "ok"
            regular = sum(r["status"] == "ok" for r in records) + 1
            record["innings"] = regular
            target = inning.get("target") or {}
            record["target_runs"] = -1
            record["max_balls"] = max_balls
            if regular == 2:
                record["target_runs"] = int(target.get("runs", (first_total or 0) + 1))
                if "overs" in target:
                    record["max_balls"] = round(float(target["overs"]) * balls_per_over)
            if regular == 1:
                first_total = sum(record["runs_total"])
        bowling = [t for t in teams if t != inning.get("team")]
        record |= {
            "batting_team": str(inning.get("team", "")),
            "bowling_team": bowling[0] if bowling else "",
            "venue": str(info.get("venue", "")),
            "date": str((info.get("dates") or [""])[0]),
            "balls_per_over": balls_per_over,
        }
        records.append(record)
    return "ok", records


def _read_innings(inning: dict, where: str, registry: dict[str, str]) -> dict[str, Any]:
    """Per-delivery columns of one innings; players by their Cricsheet registry id when the
    file has one (two players may share a name), else by name."""
    columns: dict[str, list] = {
        k: [] for k in ("batter", "non_striker", "bowler", "runs_batter", "runs_total", "flags")
    }
    for over in inning.get("overs", []):
        for ball, delivery in enumerate(over.get("deliveries", []), start=1):
            try:
                runs = delivery["runs"]
                names = [delivery[k] for k in ("batter", "non_striker", "bowler")]
                runs_batter, runs_total = int(runs["batter"]), int(runs["total"])
            except (KeyError, TypeError, ValueError) as err:
                raise DataError(
                    f"{where}, over {over.get('over', '?')}, delivery {ball}: malformed "
                    f"delivery (missing or bad {err}); fix or remove this file"
                ) from None
            extras = delivery.get("extras") or {}
            flags = (
                WIDE * ("wides" in extras)
                | NOBALL * ("noballs" in extras)
                | BYE * ("byes" in extras)
                | LEGBYE * ("legbyes" in extras)
            )
            for wicket in delivery.get("wickets") or []:
                flags |= RETIRED if wicket.get("kind") in NOT_DISMISSED else WICKET
            for key, name in zip(("batter", "non_striker", "bowler"), names, strict=True):
                columns[key].append(registry.get(name, name))
            columns["runs_batter"].append(runs_batter)
            columns["runs_total"].append(runs_total)
            columns["flags"].append(flags)
    return columns


# --------------------------------------------------------------------------- features


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


def innings_features(record: dict[str, Any], vocab: dict[str, dict[str, int]]) -> dict[str, Any]:
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
    return {
        "venue_id": vocab["venues"].get(record["venue"], UNKNOWN),
        "batting_id": vocab["teams"].get(record["batting_team"], UNKNOWN),
        "bowling_id": vocab["teams"].get(record["bowling_team"], UNKNOWN),
        "actor_ids": np.stack([ids["batter"], ids["non_striker"], ids["bowler"]], 1).reshape(-1),
        "state_x": state.reshape(-1),
        "actor_x": actors.reshape(-1),
        "ball_x": ball.reshape(-1),
        "y": window_runs(runs_total, legal_before, WINDOW_OVERS * per_over),
        "legal_before": legal_before.astype(np.int32),
        "wickets": wickets.astype(np.int8),
        "score": score.astype(np.int32),
        "sample_pos": np.flatnonzero(legal).astype(np.int32),
    }


# --------------------------------------------------------------------------- synthetic data

SURNAMES = (
    "Ahmed", "Baker", "Clarke", "Dias", "Evans", "Fernando", "Gill", "Hughes", "Iyer", "Jones",
    "Khan", "Lewis", "Mendis", "Nair", "Owens", "Patel", "Quinn", "Rao", "Singh", "Taylor",
    "Usman", "Vaas", "Walker", "Young", "Zaman",
)  # fmt: skip
TEAMS = (
    "Harbour Hawks", "Valley Lions", "Coast Kings", "Plains Riders", "Hill Tigers",
    "River Royals", "Desert Falcons", "Forest Owls", "Island Sharks", "Metro Stars",
)  # fmt: skip
VENUES = (
    "North Oval", "Bay Stadium", "Central Ground", "Lakeside Park", "Fort Arena",
    "Hilltop Ground", "Garden Oval", "Dockside Stadium",
)  # fmt: skip
RUN_VALUES = np.array([0, 1, 2, 3, 4, 6])
RUN_BASE = np.array([0.38, 0.36, 0.08, 0.01, 0.11, 0.06])
DISMISSALS = ("caught", "bowled", "lbw", "run out", "stumped", "caught and bowled")


class InningsSimulator:
    """Ball-by-ball T20 outcomes from the phase, wickets in hand, venue and player skills."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.skill: dict[str, tuple[float, float]] = {}  # player -> (batting, bowling)
        self.squads: dict[str, list[str]] = {}
        self.registry: dict[str, str] = {}
        for t, team in enumerate(TEAMS):
            names = [f"{chr(65 + (t + k) % 26)}{chr(65 + k)} {SURNAMES[(3 * t + k) % 25]}"
                     for k in range(16)]  # fmt: skip
            self.squads[team] = names
            for k, name in enumerate(names):
                # batters first, bowlers last; everyone has both skills
                self.skill[name] = (rng.normal(0.6 - 0.1 * k, 0.6), rng.normal(-0.6 + 0.1 * k, 0.6))
                self.registry[name] = f"{rng.integers(16**8):08x}"
        self.venue = {v: rng.normal(0.0, 0.4) for v in VENUES}

    def innings(
        self, batting: list[str], bowling: list[str], venue: str, max_balls: int,
        target: int | None, stop_after: int | None = None,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """Overs of one innings (Cricsheet's `overs` list); ends at `max_balls` legal balls,
        10 wickets, a reached target, or `stop_after` legal balls (rain)."""
        rng = self.rng
        order = list(batting)
        striker, partner, next_in = order[0], order[1], 2
        bowlers = sorted(bowling, key=lambda p: -self.skill[p][1])[:5]
        spells = dict.fromkeys(bowlers, 0)
        overs, score, wickets, legal, last = [], 0, 0, 0, None
        limit = max_balls if stop_after is None else min(max_balls, stop_after)
        while legal < limit and wickets < 10 and (target is None or score < target):
            bowler = next(
                b for b in sorted(bowlers, key=lambda b: (spells[b], rng.uniform()))
                if b != last and spells[b] < max(4, max_balls // 30)
            )  # fmt: skip
            spells[bowler] += 1
            last, deliveries, in_over = bowler, [], 0
            while in_over < 6 and legal < limit and wickets < 10:
                ball = self._ball(striker, bowler, venue, legal // 6, wickets)
                delivery: dict[str, Any] = {"batter": striker, "bowler": bowler}
                if ball["extras"]:
                    delivery["extras"] = ball["extras"]
                delivery["non_striker"] = partner
                extras = sum(ball["extras"].values())
                delivery["runs"] = {
                    "batter": ball["runs"],
                    "extras": extras,
                    "total": ball["runs"] + extras,
                }
                score += ball["runs"] + extras
                legal_ball = not ({"wides", "noballs"} & ball["extras"].keys())
                in_over += legal_ball
                legal += legal_ball
                if ball["runs"] % 2 or ball["extras"].get("byes", 0) % 2:
                    striker, partner = partner, striker
                if ball["out"] is not None and next_in < len(order):
                    kind = ball["out"]
                    wicket = {"player_out": striker, "kind": kind}
                    if kind in ("caught", "run out", "stumped"):
                        wicket["fielders"] = [{"name": str(rng.choice(bowling))}]
                    delivery["wickets"] = [wicket]
                    wickets += kind not in NOT_DISMISSED
                    striker, next_in = order[next_in], next_in + 1
                deliveries.append(delivery)
                if target is not None and score >= target:
                    break
            overs.append({"over": len(overs), "deliveries": deliveries})
            striker, partner = partner, striker
        return overs

    def _ball(self, batter: str, bowler: str, venue: str, over: int, wickets: int) -> dict:
        """One delivery's runs, extras and dismissal (None when not out)."""
        rng = self.rng
        u = rng.uniform()
        if u < 0.035:
            return {"runs": 0, "extras": {"wides": 1 + (rng.uniform() < 0.05) * 4}, "out": None}
        extras = {"noballs": 1} if u < 0.042 else {}
        phase = 0.35 if over < 6 else (-0.1 if over < 15 else 0.6)
        caution = 0.12 * max(wickets - 5, 0)  # few wickets in hand: fewer risks
        bat, _ = self.skill[batter]
        _, bowl = self.skill[bowler]
        attack = phase + 0.55 * bat - 0.45 * bowl + self.venue[venue] - caution
        if not extras and rng.uniform() < 0.045 * np.exp(0.35 * phase - 0.5 * bat + 0.5 * bowl):
            kind = "retired hurt" if rng.uniform() < 0.01 else str(rng.choice(DISMISSALS))
            return {"runs": 0, "extras": extras, "out": kind}
        weights = RUN_BASE * np.exp(attack * RUN_VALUES / 3)
        runs = int(rng.choice(RUN_VALUES, p=weights / weights.sum()))
        if runs in (1, 2) and not extras and rng.uniform() < 0.08:
            return {"runs": 0, "extras": {str(rng.choice(["byes", "legbyes"])): runs}, "out": None}
        return {"runs": runs, "extras": extras, "out": None}


def simulate_match(sim: InningsSimulator, number: int, day: date) -> dict[str, Any]:
    """One match in Cricsheet's JSON layout; 1.0.0 files (before 2018) have no `target`; a few
    matches are rained off (no result), decided by DLS (a revised target), or tied and followed
    by a super over."""
    rng = sim.rng
    home, away = (str(t) for t in rng.choice(TEAMS, size=2, replace=False))
    venue = str(rng.choice(VENUES))
    xi = {t: list(sim.squads[t][:9]) + list(rng.choice(sim.squads[t][9:], 2, replace=False))
          for t in (home, away)}  # fmt: skip
    toss_winner = home if rng.uniform() < 0.5 else away
    first, second = (home, away) if rng.uniform() < 0.5 else (away, home)
    version = "1.0.0" if day.year < 2018 else "1.1.0"
    weather = rng.uniform()
    first_overs = sim.innings(xi[first], xi[second], venue, 120, None)
    total = sum(d["runs"]["total"] for o in first_overs for d in o["deliveries"])
    innings = [{"team": first, "overs": first_overs}]
    outcome: dict[str, Any]
    max_balls, target = 120, total + 1
    if weather < 0.04:  # rain during the chase: no result
        chase = sim.innings(xi[second], xi[first], venue, 120, target, int(rng.integers(6, 60)))
        innings.append({"team": second, "overs": chase})
        outcome = {"result": "no result"}
    else:
        method = None
        if weather < 0.09:  # a shortened chase with a DLS target
            overs = int(rng.integers(8, 18))
            max_balls, target, method = overs * 6, int(total * overs / 20 * 1.08) + 1, "D/L"
        chase = sim.innings(xi[second], xi[first], venue, max_balls, target)
        innings.append({"team": second, "overs": chase})
        runs = sum(d["runs"]["total"] for o in chase for d in o["deliveries"])
        if runs >= target:
            out = sum("wickets" in d for o in chase for d in o["deliveries"])
            outcome = {"winner": second, "by": {"wickets": 10 - out}}
        elif runs == target - 1:
            outcome = {"result": "tie", "eliminator": first}
            for bat, bowl in ((second, first), (first, second)):
                over = sim.innings(xi[bat][:3], xi[bowl], venue, 6, None)
                innings.append({"team": bat, "overs": over, "super_over": True})
        else:
            outcome = {"winner": first, "by": {"runs": target - 1 - runs}}
        if method:
            outcome["method"] = method
    if version == "1.1.0" or method_given(outcome):
        innings[1]["target"] = {"overs": max_balls / 6, "runs": target}
    people = {p: sim.registry[p] for t in (home, away) for p in xi[t]}
    info = {
        "balls_per_over": 6,
        "city": venue.split()[0],
        "dates": [day.isoformat()],
        "event": {"name": "Synthetic T20 League", "match_number": number},
        "gender": "male",
        "match_type": "T20",
        "match_type_number": number,
        "outcome": outcome,
        "overs": 20,
        "players": {t: xi[t] for t in (home, away)},
        "registry": {"people": people},
        "season": str(day.year),
        "team_type": "club",
        "teams": [home, away],
        "toss": {"decision": "bat" if toss_winner == first else "field", "winner": toss_winner},
        "venue": venue,
    }
    meta = {"data_version": version, "created": day.isoformat(), "revision": 1}
    return {"meta": meta, "info": info, "innings": innings}


def method_given(outcome: dict[str, Any]) -> bool:
    """Whether a result came with a method (D/L): its revised target is always written."""
    return "method" in outcome


def write_dataset(out_dir: Path, *, matches: int = 200, seed: int = 0) -> Path:
    """Write `matches` simulated matches as Cricsheet JSON (one file per match, named by match
    id as Cricsheet does) and a README.txt, as in Cricsheet's zip."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sim = InningsSimulator(np.random.default_rng(seed))
    start = date(2016, 1, 1)
    for number in range(matches):
        day = start + timedelta(days=int(number * 2900 / max(matches, 1)))
        match = simulate_match(sim, number + 1, day)
        (out_dir / f"{1000001 + number}.json").write_text(json.dumps(match, indent=2))
    (out_dir / "README.txt").write_text(
        f"{matches} simulated T20 matches in Cricsheet's JSON format (accel-recipes make-data "
        "cricket); see https://cricsheet.org/format/json/\n"
    )
    return out_dir
