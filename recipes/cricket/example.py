"""Synthetic example data for the cricket recipe, in Cricsheet's match JSON format.

`write_dataset` simulates T20 matches ball by ball: outcome probabilities depend on the phase
(powerplay, middle, death), wickets in hand, the venue, and latent batting and bowling skills of
each player, so the runs to come are learnable from who is batting and bowling and the state.
The files are read by recipes/cricket/parsing.py as a real download is. `accel-recipes make-data
cricket DIR` runs it.
"""

from __future__ import annotations

import json
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import numpy as np

# dismissal kinds after which the batter may come back (the reader's NOT_DISMISSED; not imported
# from recipes/cricket/parsing.py, so that writing example files loads no torch, PyG or datasets)
NOT_DISMISSED = {"retired hurt", "retired not out"}
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
SQUAD = 16  # players per team
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
                     for k in range(SQUAD)]  # fmt: skip
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
