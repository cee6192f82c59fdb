"""Cricsheet match JSON for the cricket recipe: reading real files, per-delivery features, the
Arrow cache of both, and the graphs the model reads.

Reading (`parse_match`): one file is one match, `{"meta", "info", "innings"}` as Cricsheet's
`t20s_male_json.zip` holds it (data versions 1.0.0 and 1.1.0). Each regular innings becomes one
record of per-delivery columns; super-over innings are kept apart (counted, never trained on);
a no-result or abandoned match gives no records (its innings were ended by the weather, so runs
"in the next 5 overs" would be wrong). Wides and no-balls are deliveries but not legal balls;
a retired-hurt or retired-not-out batter is not a wicket. A chase's target is the innings'
`target` (1.1.0; revised by DLS) or, where a 1.0.0 file has none, the first innings' total + 1.

Features (`innings_features`): for every delivery, cricketmodel's context and ball features and
its target (recipes/cricket/features.py), and this recipe's earlier per-delivery arrays (legal
balls, score, wickets; the `--target next-balls` label: runs scored from that delivery on, while
fewer than 5 overs of legal balls have been bowled since, cut at the innings' end).

`load_innings` parses a folder of match files and computes these features once, cached as Arrow
with Hugging Face `datasets` (keyed by the files' bytes and the settings), with the split by
match and the training vocabulary; `Deliveries` holds the cached arrays flat in memory and
`CricketGraphs` assembles cricketmodel's heterogeneous graph per sample (and a batch of them
at once) from them. The simulator that
writes example files in this format is in recipes/cricket/example.py.
"""

from __future__ import annotations

import copy
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from torch.utils.data import Dataset

with warnings.catch_warnings():  # PyG's import trips torch's own torch.jit deprecation warning
    warnings.simplefilter("ignore", FutureWarning)
    from torch_geometric.data import HeteroData

from accel_common.data.cache import (
    cache_key,
    cache_root,
    cached,
    code_digest,
    files_digest,
    list_column,
    save_whole,
)
from accel_common.data.paths import require_regular
from accel_common.errors import DataError
from recipes.cricket.features import (
    CTX_DIM,
    KINDS,
    ball_edges,
    ball_features,
    cross_edges,
    innings_context,
    score_ahead,
    static_edges,
    wicket_kind,
)
from recipes.cricket.schema import BALL_FEATURE_DIM, FEATURE_DIMS

WINDOW_OVERS = 5
# bit flags of a delivery's `flags` column
WIDE, NOBALL, BYE, LEGBYE, WICKET, RETIRED = 1, 2, 4, 8, 16, 32
NOT_DISMISSED = {"retired hurt", "retired not out"}  # the batter may come back: no wicket
DEFAULT_MATCH_TYPES = ("T20", "IT20")
STATE_DIM, ACTOR_DIM, BALL_DIM = 9, 7, 10
ORIGINAL_COLUMNS = ("n_wickets", "n_retired", "wicket_kind", "run_out")
VOCAB_FILE = "vocab.json"
FORMAT = 3  # bump when the cached columns change
READER = code_digest(__file__)  # in the cache key: a fixed reader never reuses an old table
UNKNOWN = 0  # vocabulary index of names not seen (often enough) in the training split
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


# --------------------------------------------------------------------------- Arrow cache

PARSED = datasets.Features(
    {
        "file": datasets.Value("string"),
        "status": datasets.Value("string"),
        "note": datasets.Value("string"),
        "date": datasets.Value("string"),
        "innings": datasets.Value("int8"),
        "venue": datasets.Value("string"),
        "batting_team": datasets.Value("string"),
        "bowling_team": datasets.Value("string"),
        "target_runs": datasets.Value("int32"),
        "max_balls": datasets.Value("int32"),
        "balls_per_over": datasets.Value("int32"),
        **{k: datasets.Value("int32") for k in ("file_target", "female")},
        **{k: datasets.Sequence(datasets.Value("string")) for k in ("batter", "non_striker")},
        "bowler": datasets.Sequence(datasets.Value("string")),
        **{k: datasets.Sequence(datasets.Value("int16")) for k in ("runs_batter", "runs_total")},
        "flags": datasets.Sequence(datasets.Value("int8")),
        **{k: datasets.Sequence(datasets.Value("int16")) for k in ("over", "ball_in_over")},
        **{k: datasets.Sequence(datasets.Value("int8")) for k in ORIGINAL_COLUMNS},
    }
)
EMPTY = {"innings": 0, "venue": "", "batting_team": "", "bowling_team": "", "date": ""}
EMPTY |= {"target_runs": -1, "max_balls": 0, "balls_per_over": 6, "file_target": -1, "female": 0}
EMPTY |= {k: [] for k in ("batter", "non_striker", "bowler", "runs_batter", "runs_total", "flags")}
EMPTY |= {k: [] for k in ("over", "ball_in_over", *ORIGINAL_COLUMNS)}
FEATURES = datasets.Features(
    {
        "file": datasets.Value("string"),
        "innings": datasets.Value("int8"),
        "split": datasets.Value("int8"),
        **{k: datasets.Value("int32") for k in ("venue_id", "batting_id", "bowling_id")},
        "actor_ids": datasets.Sequence(datasets.Value("int32")),
        **{k: datasets.Sequence(datasets.Value("float32")) for k in ("state_x", "actor_x")},
        "ball_x": datasets.Sequence(datasets.Value("float32")),
        "y": datasets.Sequence(datasets.Value("float32")),
        **{k: datasets.Sequence(datasets.Value("int32")) for k in ("legal_before", "score")},
        "wickets": datasets.Sequence(datasets.Value("int8")),
        **{k: datasets.Sequence(datasets.Value("int32")) for k in ("sample_pos", "o_pos")},
        # cricketmodel's graph: context features, ball features, target, over, ids, chase
        **{k: datasets.Sequence(datasets.Value("float32")) for k in ("o_ctx", "o_ball", "o_y")},
        "over": datasets.Sequence(datasets.Value("int16")),
        "o_chase": datasets.Value("int8"),
    }
)
SKIPPED = {
    "not_match": "not Cricsheet matches",
    "match_type": "of other match types (--match-types)",
    "no_result": "no result or abandoned",
}


def parse_files(batch: dict[str, list], match_types: list[str]) -> dict[str, list]:
    """Rows of parsed innings for a batch of files; a file that gives no innings leaves one row
    saying why (its status), so the summary can count it."""
    out: dict[str, list] = {k: [] for k in PARSED}
    for raw in batch["path"]:
        path, note = Path(os.fsdecode(raw)), ""
        try:
            status, records = parse_match(path, tuple(match_types))
        except NotAMatch as err:
            status, records, note = "not_match", [], str(err)
        # a name that is no UTF-8 (b"m\xff.json") as Arrow can hold it: m\xff.json, escaped
        name = os.fsencode(path.name).decode("utf-8", "backslashreplace")
        for record in records or [{"status": status}]:
            row = EMPTY | record | {"file": name, "note": note}
            for key in PARSED:
                out[key].append(row[key])
    return out


def add_features(
    row: dict[str, Any], vocab: dict[str, dict[str, int]], retired_is_wicket: bool
) -> dict[str, Any]:
    return innings_features(row, vocab, retired_is_wicket)


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


def split_matches(
    files: list[str], dates: list[str], ratios: tuple[float, float], seed: int, by_date: bool
) -> dict[str, int]:
    """Match file -> 0 (train), 1 (val) or 2 (test): a permutation fixed by `seed`, or with
    `by_date` the earliest matches for training and the latest for testing."""
    if by_date:
        order = sorted(range(len(files)), key=lambda i: (dates[i], files[i]))
    else:
        order = np.random.default_rng(seed).permutation(len(files)).tolist()
    n_train, n_val = int(ratios[0] * len(files)), int(ratios[1] * len(files))
    if min(n_train, n_val, len(files) - n_train - n_val) < 1:
        raise DataError(
            f"{len(files)} usable matches are too few for the split ratios "
            f"{ratios[0]} / {ratios[1]}: give more match files"
        )
    return {files[i]: int(k >= n_train) + int(k >= n_train + n_val) for k, i in enumerate(order)}


def build_vocab(parsed: datasets.Dataset, rows: list[int], min_matches: int) -> dict[str, dict]:
    """Players, venues and teams seen in at least `min_matches` training matches, numbered from
    1; everything else (rarer, or only in validation and test) is index 0, the unknown."""
    seen: dict[str, dict[str, set]] = {k: {} for k in ("players", "venues", "teams")}
    columns = ["file", "batter", "non_striker", "bowler", "venue", "batting_team", "bowling_team"]
    for row in parsed.select(rows).select_columns(columns).iter(batch_size=256):
        for i, file in enumerate(row["file"]):
            names = set(row["batter"][i]) | set(row["non_striker"][i]) | set(row["bowler"][i])
            for kind, keys in (
                ("players", names),
                ("venues", {row["venue"][i]}),
                ("teams", {row["batting_team"][i], row["bowling_team"][i]}),
            ):
                for key in keys:
                    seen[kind].setdefault(key, set()).add(file)
    return {
        kind: {
            key: index
            for index, key in enumerate(
                sorted(k for k, files in found.items() if len(files) >= min_matches), start=1
            )
        }
        for kind, found in seen.items()
    }


ENTITIES = ("players", "venues", "teams")


def vocab_sizes(vocab: dict[str, Any]) -> dict[str, int]:
    """Embedding rows (less the unknown's) a vocabulary needs: its highest index of each kind."""
    return {kind: max(vocab[kind].values(), default=0) for kind in ENTITIES}


def keyed_by_registry(vocab: dict[str, Any], registries: list[dict[str, str]]) -> dict[str, Any]:
    """A vocabulary whose players are keyed by name (the original's: `"player_key": "name"`) as
    this recipe keys them, by Cricsheet registry id, through the matches' registries (name ->
    id): their indices and bowling types; the names stay too, for files without a registry.
    Others are returned as they are."""
    if vocab.get("player_key") != "name":
        return vocab
    keyed = dict(vocab, player_key="registry")
    for kind in ("players", "player_bowling_types"):
        by_name = vocab.get(kind, {})
        keyed[kind] = dict(by_name)
        for registry in registries:
            keyed[kind] |= {person: by_name[name] for name, person in registry.items()
                            if name in by_name}  # fmt: skip
    return keyed


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


def load_innings(
    folder: Path,
    *,
    match_types: list[str],
    strict: bool,
    ratios: tuple[float, float],
    split_seed: int,
    split_by_date: bool,
    min_matches: int,
    workers: int,
    cache_dir: Path | None = None,
    retired_is_wicket: bool = True,
    vocab: dict[str, Any] | None = None,
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """The featurised innings of every usable match in `folder` (column `split`: 0 train, 1
    val, 2 test) and what the run needs beside them (vocabulary, summary, seconds, cached).
    `vocab`: a given vocabulary (a model's to fine-tune) instead of the training split's."""
    start = time.perf_counter()
    files = match_files(folder)
    cache_dir = cache_root(cache_dir)
    parse_key = cache_key(files_digest(files), sorted(match_types), FORMAT, READER)
    if vocab is not None:
        vocab = keyed_by_registry(vocab, match_registries(files))
    given = json.dumps(vocab, sort_keys=True) if vocab is not None else min_matches
    key = cache_key(parse_key, ratios, split_seed, split_by_date, given, retired_is_wicket)
    target = cache_dir / f"cricket-{key}"
    was_cached = (target / VOCAB_FILE).is_file()
    num_proc = workers if workers > 1 else None
    parsed = cached(
        cache_dir / f"cricket-parse-{parse_key}",
        lambda: datasets.Dataset.from_dict({"path": [os.fsencode(f) for f in files]}).map(
            parse_files,
            batched=True,
            batch_size=8,
            fn_kwargs={"match_types": list(match_types)},
            remove_columns=["path"],
            features=PARSED,
            num_proc=num_proc,
            new_fingerprint=parse_key,
            desc=f"reading {folder}",
        ),
    )
    status = parsed.select_columns(["file", "status", "note"]).to_dict()
    not_matches = [(f, n) for f, s, n in zip(*status.values(), strict=True) if s == "not_match"]
    if not_matches and strict:
        file, note = not_matches[0]
        raise DataError(f"{folder / file}: {note}; remove it, or leave out --strict to skip it")
    if not was_cached:
        info = build_features(parsed, status, target, ratios, split_seed, split_by_date,
                              min_matches, num_proc, retired_is_wicket, vocab)  # fmt: skip
    else:
        info = json.loads((target / VOCAB_FILE).read_text())
    rows = datasets.load_from_disk(str(target))
    info |= {"seconds": time.perf_counter() - start, "cached": was_cached}
    info["not_matches"] = not_matches
    info["files"] = files  # every file read (the run's data fingerprint)
    return rows, info


def build_features(
    parsed: datasets.Dataset,
    status: dict[str, list],
    target: Path,
    ratios: tuple[float, float],
    split_seed: int,
    split_by_date: bool,
    min_matches: int,
    num_proc: int | None,
    retired_is_wicket: bool = True,
    vocab: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Split the usable matches, build the vocabulary from the training split (unless one is
    given), and compute every innings' features into the cache folder `target` (with the
    vocabulary and summary)."""
    ok = [i for i, s in enumerate(status["status"]) if s == "ok"]
    if not ok:
        raise DataError(
            "no usable T20 innings in --data (see the counts above); check --match-types"
        )
    dates = dict(zip(parsed["file"], parsed["date"], strict=True))
    used = sorted({status["file"][i] for i in ok})
    split = split_matches(used, [dates[f] for f in used], ratios, split_seed, split_by_date)
    if vocab is None:
        vocab = build_vocab(parsed, [i for i in ok if split[status["file"][i]] == 0], min_matches)
    usable = parsed.select(ok)
    usable = usable.add_column("split", [split[status["file"][i]] for i in ok])
    names = [c for c in PARSED if c not in ("file", "innings")]
    rows = usable.map(
        add_features,
        fn_kwargs={"vocab": vocab, "retired_is_wicket": retired_is_wicket},
        remove_columns=names,
        features=FEATURES,
        num_proc=num_proc,
        new_fingerprint=target.name,
        desc="features",
    )
    per_file = {}
    for file, state in zip(status["file"], status["status"], strict=True):
        per_file.setdefault(file, state)
    summary = {
        "files": len(per_file),
        "matches": len(used),
        "innings": len(ok),
        "super_over_innings": status["status"].count("super_over"),
        **{k: list(per_file.values()).count(k) for k in SKIPPED},
    }
    info = {"vocab": vocab, "summary": summary}
    save_whole(rows, target, {VOCAB_FILE: json.dumps(info)})
    return info


# --------------------------------------------------------------------------- samples and graphs


class PhaseBaseline:
    """Mean runs in the next 5 overs by over number and wickets down, from the training split;
    a cell no training delivery reached falls back to its over's mean, then the overall mean."""

    def __init__(self, table: np.ndarray, mean: float) -> None:
        self.table, self.mean = np.asarray(table, dtype=np.float32), mean

    @classmethod
    def fit(cls, over: np.ndarray, wickets: np.ndarray, y: np.ndarray) -> PhaseBaseline:
        mean = float(y.mean())
        cells = np.clip(over, 0, 19) * 11 + np.clip(wickets, 0, 10)
        count = np.bincount(cells, minlength=220)
        total = np.bincount(cells, weights=y, minlength=220)
        over_count = count.reshape(20, 11).sum(1)
        over_mean = np.where(
            over_count > 0, total.reshape(20, 11).sum(1) / np.maximum(over_count, 1), mean
        )
        return cls(
            np.where(count > 0, total / np.maximum(count, 1), np.repeat(over_mean, 11)), mean
        )

    def __call__(self, over: np.ndarray, wickets: np.ndarray) -> np.ndarray:
        return self.table[np.clip(over, 0, 19) * 11 + np.clip(wickets, 0, 10)]


TARGETS = ("original", "next-balls")


class Deliveries:
    """Every delivery's arrays, flat in memory (one copy out of Arrow, shared by the splits),
    and every sample as its row, position and flat index, with its label, over and wickets down.
    `target` "original": cricketmodel's samples (every delivery after the first, wides too) and
    target (runs to an over boundary); "next-balls": this recipe's (every legal delivery; runs
    in the next 5 overs of legal balls)."""

    def __init__(
        self, rows: datasets.Dataset, balls_per_over: int = 6, target: str = "original"
    ) -> None:
        if target not in TARGETS:
            raise DataError(f"--target {target}: one of {', '.join(TARGETS)}")
        original = target == "original"
        positions, sample_offsets = list_column(rows, "o_pos" if original else "sample_pos")
        self.y_all, offsets = list_column(rows, "o_y" if original else "y")
        self.row = np.repeat(np.arange(len(rows)), np.diff(sample_offsets))
        self.pos = positions.astype(np.int64)
        self.flat = offsets[self.row] + self.pos
        self.y = self.y_all[self.flat]
        self.over_all = list_column(rows, "over")[0].astype(np.int64)
        if original:
            self.over = self.over_all[self.flat]
        else:
            self.over = list_column(rows, "legal_before")[0][self.flat] // balls_per_over
        self.wickets = list_column(rows, "wickets")[0][self.flat].astype(np.int64)
        self.split = rows.data.column("split").to_numpy()[self.row]
        self.rank = np.arange(len(self.row)) - sample_offsets[self.row]  # sample number
        self.ctx = list_column(rows, "o_ctx")[0].reshape(-1, CTX_DIM)
        self.ball = list_column(rows, "o_ball")[0].reshape(-1, BALL_FEATURE_DIM)
        self.actor_ids = list_column(rows, "actor_ids")[0].reshape(-1, 3).astype(np.int64)
        self.context = np.stack(
            [rows.data.column(k).to_numpy() for k in ("venue_id", "batting_id", "bowling_id")], 1
        ).astype(np.int64)
        self.chase = rows.data.column("o_chase").to_numpy().astype(bool)


FEATURE_SLICES = {}
_at = 0
for _kind, _dim in FEATURE_DIMS.items():
    FEATURE_SLICES[_kind] = slice(_at, _at + _dim)
    _at += _dim


class CricketGraphs(Dataset):
    """One HeteroData per sample of a split, cricketmodel's graph of the delivery
    (hetero_data_builder.create_hetero_data), assembled from the flat delivery arrays: at most
    `history` earlier deliveries of the innings as ball nodes (the original: all of them)."""

    def __init__(
        self,
        deliveries: Deliveries,
        keep: np.ndarray,
        history: int,
        baseline: PhaseBaseline,
        unknown_player_team: bool = False,
    ) -> None:
        self.d = deliveries
        self.index = np.flatnonzero(keep)
        self.history = history
        self.unknown_player_team = unknown_player_team
        self.baseline = baseline(deliveries.over[keep], deliveries.wickets[keep])
        self.template = HeteroData()  # the edges every graph has; copied per sample (cheaper)
        for edge, edge_index in static_edges().items():
            self.template[edge].edge_index = edge_index
        self.template["query"].x = torch.zeros((1, 1))

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, index: int) -> int:
        """The sample's number: `collate` assembles a batch of them at once."""
        return index

    def collate(self, indices: list[int]) -> HeteroData:
        """A batch of graphs as one HeteroData, equal to PyG's batching of `graph(i)` for each
        (tests/recipes/cricket/), built at once: the 167 edge types of one-node context edges
        make PyG's per-graph batching about 7 ms a graph."""
        index = np.asarray(indices, dtype=np.int64)
        baseline = self.baseline[index].astype(np.float32)
        return batch_graphs(
            self.d, self.index[index], self.history, baseline, self.unknown_player_team
        )

    def graph(self, index: int) -> HeteroData:
        """One sample's graph, as cricketmodel's create_hetero_data builds it."""
        d, k = self.d, int(self.index[index])
        flat, row = int(d.flat[k]), int(d.row[k])
        graph = copy.copy(self.template)
        fill_graph(graph, d, flat, min(int(d.pos[k]), self.history), row, self.unknown_player_team)
        graph.y = torch.tensor([float(d.y[k])])
        graph.baseline = torch.tensor([float(self.baseline[index])])
        return graph


def player_teams(ids: torch.Tensor, teams: torch.Tensor, unknown_player_team: bool) -> torch.Tensor:
    """The team ids of players' fallback embeddings (read only for a player outside the
    vocabulary, id 0): the team they play for here; for an unknown player, with
    `unknown_player_team` off, none (0), as the original's `get_player_team_id` gives a player
    its mapper does not hold."""
    return teams if unknown_player_team else torch.where(ids == UNKNOWN, 0, teams)


def fill_graph(
    graph: HeteroData,
    d: Deliveries,
    flat: int,
    balls: int,
    row: int,
    unknown_player_team: bool = False,
) -> None:
    """The nodes and the history's edges of the graph before delivery `flat`."""
    venue, batting, bowling = (torch.tensor([[int(v)]]) for v in d.context[row])
    graph["venue"].x, graph["batting_team"].x, graph["bowling_team"].x = venue, batting, bowling
    ids = d.actor_ids[flat]
    roles = torch.zeros((1, 1), dtype=torch.long)  # no player roles: all unknown
    for slot, (kind, team) in enumerate(
        (("striker_identity", batting), ("nonstriker_identity", batting),
         ("bowler_identity", bowling))
    ):  # fmt: skip
        graph[kind].x = torch.tensor([[int(ids[slot])]])
        graph[kind].team_id = player_teams(graph[kind].x, team, unknown_player_team)
        graph[kind].role_id = roles
    ctx = torch.from_numpy(d.ctx[flat]).view(1, -1)
    for kind, cols in FEATURE_SLICES.items():
        graph[kind].x = ctx[:, cols]
    start = flat - balls
    history = d.actor_ids[start:flat]
    graph["ball"].x = torch.from_numpy(d.ball[start:flat])
    graph["ball"].bowler_ids = torch.from_numpy(history[:, 2])
    graph["ball"].batsman_ids = torch.from_numpy(history[:, 0])
    graph["ball"].nonstriker_ids = torch.from_numpy(history[:, 1])
    for rel, (edge_index, attr) in ball_edges(
        history[:, 2], history[:, 0], d.over_all[start:flat]
    ).items():
        graph["ball", rel, "ball"].edge_index = edge_index
        if attr is not None:
            graph["ball", rel, "ball"].edge_attr = attr
    bat, part, bowl = history[:, 0], history[:, 1], history[:, 2]
    cross = cross_edges(bat, bowl, part, int(ids[0]), int(ids[2]), int(ids[1]), balls)
    for edge, edge_index in cross.items():
        graph[edge].edge_index = edge_index
    graph.is_chase = torch.tensor([bool(d.chase[row])])


def batch_graphs(
    d: Deliveries,
    samples: np.ndarray,
    history: int,
    baseline: np.ndarray,
    unknown_player_team: bool = False,
) -> HeteroData:
    """The graphs of `samples` batched, as PyG's Batch of `CricketGraphs.graph` holds them."""
    n = len(samples)
    flats, rows = d.flat[samples], d.row[samples]
    balls = np.minimum(d.pos[samples], history)
    graph = HeteroData()
    arange = torch.arange(n)
    pairs = torch.stack([arange, arange])
    for edge in static_edges():
        graph[edge].edge_index = pairs
    context = torch.from_numpy(d.context[rows])
    for col, kind in enumerate(("venue", "batting_team", "bowling_team")):
        graph[kind].x = context[:, col : col + 1]
    ids = torch.from_numpy(d.actor_ids[flats])
    roles = torch.zeros((n, 1), dtype=torch.long)
    for slot, (kind, team) in enumerate(
        (("striker_identity", 1), ("nonstriker_identity", 1), ("bowler_identity", 2))
    ):
        graph[kind].x = ids[:, slot : slot + 1]
        graph[kind].team_id = player_teams(
            graph[kind].x, context[:, team : team + 1], unknown_player_team
        )
        graph[kind].role_id = roles
    ctx = torch.from_numpy(d.ctx[flats])
    for kind, cols in FEATURE_SLICES.items():
        graph[kind].x = ctx[:, cols]
    graph["query"].x = torch.zeros((n, 1))
    starts = flats - balls
    ball_index = np.concatenate([np.arange(a, b) for a, b in zip(starts, flats, strict=True)])
    history_ids = d.actor_ids[ball_index]
    graph["ball"].x = torch.from_numpy(d.ball[ball_index])
    graph["ball"].bowler_ids = torch.from_numpy(history_ids[:, 2])
    graph["ball"].batsman_ids = torch.from_numpy(history_ids[:, 0])
    graph["ball"].nonstriker_ids = torch.from_numpy(history_ids[:, 1])
    offsets = np.concatenate([[0], np.cumsum(balls)])
    edges: dict = {}
    attrs: dict = {}
    for b in range(n):
        lo, hi = offsets[b], offsets[b + 1]
        h = history_ids[lo:hi]
        for rel, (edge_index, attr) in ball_edges(
            h[:, 2], h[:, 0], d.over_all[ball_index[lo:hi]]
        ).items():
            edges.setdefault(("ball", rel, "ball"), []).append(edge_index + int(lo))
            if attr is not None:
                attrs.setdefault(("ball", rel, "ball"), []).append(attr)
        cross = cross_edges(h[:, 0], h[:, 2], h[:, 1], *(int(v) for v in ids[b, [0, 2, 1]]),
                            int(hi - lo))  # fmt: skip
        for edge, edge_index in cross.items():
            edges.setdefault(edge, []).append(edge_index + torch.tensor([[int(lo)], [b]]))
    for edge, parts in edges.items():
        graph[edge].edge_index = torch.cat(parts, 1)
    for edge, parts in attrs.items():
        graph[edge].edge_attr = torch.cat(parts, 0)
    for kind in graph.node_types:
        graph[kind].batch = arange
    graph["ball"].batch = torch.repeat_interleave(arange, torch.from_numpy(balls))
    graph.y = torch.from_numpy(d.y[samples].astype(np.float32))
    graph.baseline = torch.from_numpy(baseline)
    graph.is_chase = torch.from_numpy(d.chase[rows])
    return graph
