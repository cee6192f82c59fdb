"""Reading Cricsheet match files: one match JSON into per-delivery records of its innings, the
folder's match files, and each match's player registry.

`parse_match`: one file is one match, `{"meta", "info", "innings"}` as Cricsheet's
`t20s_male_json.zip` holds it (data versions 1.0.0 and 1.1.0). Each regular innings becomes one
record of per-delivery columns; super-over innings are kept apart (counted, never trained on);
a no-result or abandoned match gives no records (its innings were ended by the weather, so runs
"in the next 5 overs" would be wrong). Wides and no-balls are deliveries but not legal balls;
a retired-hurt or retired-not-out batter is not a wicket. A chase's target is the innings'
`target` (1.1.0; revised by DLS) or, where a 1.0.0 file has none, the first innings' total + 1.
The simulator that writes example files in this format is in recipes/cricket/example.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from accel_common import DataError
from accel_common.data import require_regular
from recipes.cricket.features import KINDS, wicket_kind

# bit flags of a delivery's `flags` column
WIDE, NOBALL, BYE, LEGBYE, WICKET, RETIRED = 1, 2, 4, 8, 16, 32
NOT_DISMISSED = {"retired hurt", "retired not out"}  # the batter may come back: no wicket
DEFAULT_MATCH_TYPES = ("T20", "IT20")
ORIGINAL_COLUMNS = ("n_wickets", "n_retired", "wicket_kind", "run_out")
# bounds of a match's counts, beyond which a file is malformed (and the int16/int32 columns would
# overflow): no delivery scores 100 runs (a no-ball hit for six with 5 penalty runs is 12), no
# innings lasts 1000 overs (the longest Test innings had 271), no over has 13 balls by law
MAX_RUNS, MAX_OVERS, MAX_BALLS_PER_OVER = 100, 1000, 12


class NotAMatch(Exception):
    """A .json file that is not a Cricsheet match (skipped with a warning, or --strict)."""


NESTED_TOO_DEEPLY = "JSON nested too deeply to read (a Cricsheet match is about ten levels deep)"


def count(value: Any, what: str, where: str, low: int, high: int) -> int:
    """A whole number of a match file in [low, high], else one line naming the file, the place
    and the value: a fraction or a string is not silently cut, an absurd count not overflowed."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise DataError(
            f"{where}: {what} is {value!r}; give a whole number from {low} to {high} (fix or "
            "remove this file)"
        )
    return value


def listed(value: Any, what: str, where: str, kind: type = dict) -> list:
    """A list of `kind` (overs, deliveries, wickets), else one line naming the file."""
    if not isinstance(value, list) or not all(isinstance(v, kind) for v in value):
        raise DataError(
            f"{where}: {what} is not a list of {kind.__name__}s ({value!r:.60}); fix or remove "
            "this file"
        )
    return value


def parse_match(path: Path, match_types: tuple[str, ...]) -> tuple[str, list[dict[str, Any]]]:
    """(status, innings records) of one match file. Status: "ok", "match_type" (not among
    `match_types`), "no_result" (no result or abandoned). Raises NotAMatch for a file that is
    not a match, DataError for a match with a malformed delivery."""
    try:
        match = json.loads(Path(path).read_bytes())
    except (UnicodeDecodeError, ValueError) as err:
        raise NotAMatch(f"not valid JSON ({err})") from None
    except RecursionError:  # json's reader follows about a thousand levels
        raise NotAMatch(NESTED_TOO_DEEPLY) from None
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
    listed(innings, "innings", str(path))
    bpo = info.get("balls_per_over", 6)
    balls_per_over = count(bpo, "info.balls_per_over", str(path), 1, MAX_BALLS_PER_OVER)
    max_balls = count(info.get("overs", 20), "info.overs", str(path), 1, MAX_OVERS) * balls_per_over
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
            # the chase as cricketmodel sees it: only a target the file gives (1.1.0)
            if not isinstance(target, dict):
                raise DataError(
                    f"{where}: target is {target!r:.60}, not an object; fix or remove it"
                )
            record["file_target"] = int(target.get("runs", -1)) if regular == 2 else -1
            record["max_balls"] = max_balls
            if regular == 2:
                runs = target.get("runs", (first_total or 0) + 1)
                record["target_runs"] = count(runs, "target.runs", where, 0, MAX_RUNS * max_balls)
                if "overs" in target:
                    overs = target["overs"]
                    if not isinstance(overs, int | float) or not 0 < overs <= MAX_OVERS:
                        count(overs, "target.overs", where, 1, MAX_OVERS)  # refuses it
                    record["max_balls"] = round(float(overs) * balls_per_over)
            if regular == 1:
                first_total = sum(record["runs_total"])
        if inning.get("team") not in teams:  # the bowling side would be a guess
            team = inning.get("team")
            raise DataError(f"{where}: team {team!r} is not one of info.teams {teams}")
        bowling = [t for t in teams if t != inning.get("team")]
        record |= {
            "batting_team": str(inning.get("team", "")),
            "bowling_team": bowling[0] if bowling else "",
            "venue": str(info.get("venue", "")),
            "date": str((info.get("dates") or [""])[0]),
            "balls_per_over": balls_per_over,
            "female": int(info.get("gender", "male") == "female"),
        }
        records.append(record)
    return "ok", records


def _read_innings(inning: dict, where: str, registry: dict[str, str]) -> dict[str, Any]:
    """Per-delivery columns of one innings; players by their Cricsheet registry id when the
    file has one (two players may share a name), else by name."""
    columns: dict[str, list] = {
        k: [] for k in ("batter", "non_striker", "bowler", "runs_batter", "runs_total", "flags")
    }
    # what cricketmodel's features read besides (recipes/cricket/features.py)
    for key in ("over", "ball_in_over", *ORIGINAL_COLUMNS):
        columns[key] = []
    overs = listed(inning.get("overs", []), "overs", where)
    if not overs:  # no delivery: no sample, and features of nothing
        raise DataError(
            f"{where}: no overs (an innings without deliveries); fix or remove this file"
        )
    for over in overs:
        at = f"{where}, over {over.get('over', '?')}"
        number = count(over.get("over", 0), "the over number", at, 0, MAX_OVERS)
        for ball, delivery in enumerate(listed(over.get("deliveries"), "deliveries", at), 1):
            try:
                runs = delivery["runs"]
                names = [delivery[k] for k in ("batter", "non_striker", "bowler")]
                runs_batter, runs_total = runs["batter"], runs["total"]
                runs_extras = runs.get("extras", 0)
            except (KeyError, TypeError, ValueError) as err:
                raise DataError(
                    f"{at}, delivery {ball}: malformed delivery (missing or bad {err}); fix or "
                    "remove this file"
                ) from None
            counted = [
                count(value, f"runs.{key}", f"{at}, delivery {ball}", 0, MAX_RUNS)
                for key, value in (("batter", runs_batter), ("extras", runs_extras),
                                   ("total", runs_total))
            ]  # fmt: skip
            runs_batter, runs_total = counted[0], counted[2]
            extras = delivery.get("extras") or {}
            flags = (
                WIDE * ("wides" in extras)
                | NOBALL * ("noballs" in extras)
                | BYE * ("byes" in extras)
                | LEGBYE * ("legbyes" in extras)
            )
            wickets = listed(delivery.get("wickets") or [], "wickets", f"{at}, delivery {ball}")
            for wicket in wickets:
                flags |= RETIRED if wicket.get("kind") in NOT_DISMISSED else WICKET
            first = wickets[0] if wickets and isinstance(wickets[0], dict) else {}
            out = first.get("player_out", "")
            kind = wicket_kind(first.get("kind")) if wickets else 0
            columns["over"].append(number)
            columns["ball_in_over"].append(ball - 1)
            columns["n_wickets"].append(len(wickets))
            columns["n_retired"].append(sum(w.get("kind") in NOT_DISMISSED for w in wickets))
            columns["wicket_kind"].append(kind)
            run_out = kind == KINDS["run out"]
            columns["run_out"].append(
                (1 if out == names[0] else 2 if out == names[1] else 0) if run_out else 0
            )
            for key, name in zip(("batter", "non_striker", "bowler"), names, strict=True):
                columns[key].append(registry.get(name, name))
            columns["runs_batter"].append(runs_batter)
            columns["runs_total"].append(runs_total)
            columns["flags"].append(flags)
    return columns


def match_files(folder: Path) -> list[Path]:
    """The folder's `*.json` files, as the original globs them (README.txt is not one); a
    FIFO or device among them is refused before anything reads it (it would block forever)."""
    files = sorted(folder.glob("*.json"))
    for path in files:
        require_regular(path, expected="; remove it from --data, which holds match files")
    if not files:
        raise DataError(
            f"--data {folder}: no .json files; unzip Cricsheet's t20s_male_json.zip into it"
        )
    return files


def match_registries(files: list[Path]) -> list[dict[str, str]]:
    """Each match file's `info.registry.people` (name -> Cricsheet id); {} where it has none or
    is not a match (the reader reports those)."""
    registries = []
    for path in files:
        try:
            info = json.loads(Path(path).read_bytes()).get("info", {})
            registries.append(dict(info.get("registry", {}).get("people", {})))
        except (UnicodeDecodeError, ValueError, AttributeError, RecursionError):
            registries.append({})
    return registries
