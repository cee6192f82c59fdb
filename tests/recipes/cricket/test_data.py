"""The cricket recipe's data: Cricsheet files as real ones are, the reader's edge cases (super
overs, extras, retirements, malformed deliveries), the cache, the split and the vocabularies.
"""

from __future__ import annotations

import copy
import json
import os
import re
from datetime import date
from pathlib import Path

import datasets
import numpy as np
import pytest

import recipes.train_cricket as recipe
from accel_common.data.cache import code_digest
from accel_common.errors import DataError
from recipes.cricket import example, loading
from recipes.cricket.innings import innings_features, window_runs
from recipes.cricket.parsing import NESTED_TOO_DEEPLY, NotAMatch, _read_innings, parse_match
from tests.processes import CRICKET, run_recipe
from tests.recipes.cricket.helpers import T20, deliveries

SPLIT = dict(ratios=(0.6, 0.2), split_seed=42, split_by_date=False, min_matches=2, workers=1)


def a_match(seed: int = 0, day: str = "2019-05-01") -> dict:
    sim = example.InningsSimulator(np.random.default_rng(seed))
    return example.simulate_match(sim, 1, date.fromisoformat(day))


def write(path: Path, match: object) -> Path:
    path.write_text(json.dumps(match))
    return path


def test_generated_files_follow_the_cricsheet_format_field_by_field(cricket_data):
    files = sorted(cricket_data.glob("*.json"))
    assert len(files) == 100 and (cricket_data / "README.txt").is_file()
    versions = set()
    for path in files:
        match = json.loads(path.read_text())
        assert set(match) == {"meta", "info", "innings"}
        assert set(match["meta"]) == {"data_version", "created", "revision"}
        versions.add(match["meta"]["data_version"])
        info = match["info"]
        assert {"teams", "venue", "city", "dates", "match_type", "gender", "players", "registry",
                "toss", "outcome", "overs", "balls_per_over", "event"} <= set(info)  # fmt: skip
        assert info["match_type"] == "T20" and info["overs"] == 20 and info["balls_per_over"] == 6
        assert len(info["teams"]) == 2 and set(info["players"]) == set(info["teams"])
        assert all(len(xi) == 11 for xi in info["players"].values())
        people = info["registry"]["people"]
        assert all(re.fullmatch(r"[0-9a-f]{8}", people[p]) for xi in info["players"].values()
                   for p in xi)  # fmt: skip
        assert (
            set(info["toss"]) == {"winner", "decision"} and info["toss"]["winner"] in info["teams"]
        )
        outcome = info["outcome"]
        assert ("winner" in outcome and "by" in outcome) or "result" in outcome
        for number, inning in enumerate(match["innings"]):
            batting = inning["team"]
            bowling = next(t for t in info["teams"] if t != batting)
            assert [o["over"] for o in inning["overs"]] == list(range(len(inning["overs"])))
            if number == 1 and match["meta"]["data_version"] == "1.1.0":
                assert set(inning["target"]) == {"overs", "runs"}
            for over in inning["overs"]:
                legal = 0
                for d in over["deliveries"]:
                    assert {d["batter"], d["non_striker"]} <= set(info["players"][batting])
                    assert d["bowler"] in info["players"][bowling]
                    runs, extras = d["runs"], d.get("extras", {})
                    assert (
                        runs["total"]
                        == runs["batter"] + runs["extras"]
                        == runs["batter"] + sum(extras.values())
                    )
                    assert set(extras) <= {"wides", "noballs", "byes", "legbyes", "penalty"}
                    legal += not {"wides", "noballs"} & set(extras)
                    for w in d.get("wickets", []):
                        assert w["player_out"] in info["players"][batting] and w["kind"]
                        assert all(set(f) == {"name"} for f in w.get("fields", []))
                assert legal <= 6
        assert parse_match(path, T20)[0] in ("ok", "no_result")
    assert versions == {"1.0.0", "1.1.0"}


def test_targets_by_data_version_dls_and_no_result(tmp_path):
    match = a_match()
    first_total = sum(d["runs"]["total"] for d in deliveries(match["innings"][0]))
    old = copy.deepcopy(match)
    old["meta"]["data_version"] = "1.0.0"
    old["innings"][1].pop("target", None)  # 1.0.0 files may have no target
    _, records = parse_match(write(tmp_path / "old.json", old), T20)
    assert records[1]["target_runs"] == first_total + 1 and records[1]["max_balls"] == 120
    dls = copy.deepcopy(match)
    dls["innings"][1]["target"] = {"overs": 12, "runs": 97}
    dls["info"]["outcome"]["method"] = "D/L"
    _, records = parse_match(write(tmp_path / "dls.json", dls), T20)
    assert (records[1]["target_runs"], records[1]["max_balls"]) == (97, 72)
    assert [r["innings"] for r in records] == [1, 2]
    rained = copy.deepcopy(match)
    rained["info"]["outcome"] = {"result": "no result"}
    assert parse_match(write(tmp_path / "nr.json", rained), T20) == ("no_result", [])
    odi = copy.deepcopy(match)
    odi["info"]["match_type"] = "ODI"
    assert parse_match(write(tmp_path / "odi.json", odi), T20) == ("match_type", [])
    assert parse_match(tmp_path / "odi.json", ("ODI",))[0] == "ok"


def test_super_overs_are_kept_apart_and_extras_and_retirements_counted_right(tmp_path):
    match = a_match()
    tied = copy.deepcopy(match)
    tied["innings"].append({"team": tied["innings"][1]["team"], "super_over": True,
                            "overs": tied["innings"][0]["overs"][:1]})  # fmt: skip
    _, records = parse_match(write(tmp_path / "so.json", tied), T20)
    assert [r["status"] for r in records] == ["ok", "ok", "super_over"]
    inning = {"team": "A", "overs": [{"over": 0, "deliveries": []}, {"over": 1, "deliveries": []}]}
    ball = {"batter": "x", "bowler": "b", "non_striker": "y"}
    script = [  # over 0: a wide, a no-ball, six legal balls (a retirement, then a wicket)
        ({"batter": 0, "extras": 1, "total": 1}, {"wides": 1}, []),
        ({"batter": 4, "extras": 1, "total": 5}, {"noballs": 1}, []),
        *[({"batter": 1, "extras": 0, "total": 1}, {}, [])] * 4,
        ({"batter": 0, "extras": 0, "total": 0}, {}, [{"kind": "retired hurt", "player_out": "x"}]),
        ({"batter": 0, "extras": 0, "total": 0}, {}, [{"kind": "bowled", "player_out": "z"}]),
    ]
    for runs, extras, wickets in script:
        d = {**ball, "runs": runs} | ({"extras": extras} if extras else {})
        inning["overs"][0]["deliveries"].append(d | ({"wickets": wickets} if wickets else {}))
    inning["overs"][1]["deliveries"] = [{**ball, "runs": {"batter": 2, "extras": 0, "total": 2}}]
    record = _read_innings(inning, "t", {}) | {"balls_per_over": 6, "max_balls": 120}
    record |= {"target_runs": -1, "venue": "v", "batting_team": "A", "bowling_team": "B"}
    features = innings_features(record, {"players": {}, "venues": {}, "teams": {}})
    assert features["legal_before"].tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6]
    assert features["sample_pos"].tolist() == [2, 3, 4, 5, 6, 7, 8]  # no sample at a wide/no-ball
    assert features["wickets"].tolist() == [0] * 8 + [1]  # retired hurt is not a wicket
    # runs in the next 5 overs, truncated at the innings' end: all that follows here
    assert features["y"].tolist() == [12, 11, 6, 5, 4, 3, 2, 2, 2]
    # the original's features count the retirement as a wicket (score state column 1: wickets /
    # 10, before each delivery); --no-retired-is-wicket does not; its target: to the end of over 5
    original = features["o_ctx"].reshape(9, -1)[:, 1]
    assert (original * 10).round().tolist() == [0] * 7 + [1, 2]
    corrected = innings_features(record, {"players": {}, "venues": {}, "teams": {}}, False)
    assert (corrected["o_ctx"].reshape(9, -1)[:, 1] * 10).round().tolist() == [0] * 8 + [1]
    assert features["o_y"].tolist() == [12, 11, 6, 5, 4, 3, 2, 2, 2]


def test_window_runs_stop_after_five_overs_of_legal_balls():
    runs = np.ones(40, dtype=np.int64)
    legal_before = np.array([min(k, 35) for k in range(40)])  # the last 4 deliveries are wides
    y = window_runs(runs, legal_before, 30)
    assert y[:6].tolist() == [30] * 6  # 30 legal balls; the wides after ball 35 are not in it
    assert y[6] == 34 and y[39] == 1  # later windows reach the innings' end: truncated


def test_a_malformed_delivery_names_file_innings_over_and_delivery(tmp_path):
    match = a_match()
    del match["innings"][1]["overs"][2]["deliveries"][3]["runs"]["total"]
    path = write(tmp_path / "bad.json", match)
    with pytest.raises(DataError, match=r"bad.json, innings 2, over 2, delivery 4: malformed"):
        parse_match(path, T20)


@pytest.mark.parametrize("key", ["batter", "extras", "total"])
def test_negative_runs_name_the_match_innings_over_and_delivery(tmp_path, key):
    """Negative runs would train as a score going down: refused, naming where they are."""
    match = a_match()
    runs = match["innings"][0]["overs"][3]["deliveries"][1]["runs"]
    runs[key] = -runs["total"] - 1
    path = write(tmp_path / "negative.json", match)
    expected = (
        f"{path}, innings 1, over 3, delivery 2: runs.{key} is {runs[key]}; give a whole "
        "number from 0 to 100 (fix or remove this file)"
    )
    with pytest.raises(DataError) as raised:
        parse_match(path, T20)
    assert str(raised.value) == expected


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Path:
    """12 matches with the oddities of a real download: a README, a .json that is no match, an
    ODI, a no-result match and a tied match with a super over."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    root = example.write_dataset(tmp_path / "matches", matches=12)
    write(root / "notes.json", {"comment": "not a match"})
    odi = a_match(1)
    odi["info"]["match_type"] = "ODI"
    write(root / "odi.json", odi)
    rained = a_match(2)
    rained["info"]["outcome"] = {"result": "no result"}
    write(root / "rain.json", rained)
    tied = a_match(3, "2030-01-01")  # the latest date: in the test split when split by date
    tied["innings"].append({"team": tied["innings"][0]["team"], "super_over": True,
                            "overs": tied["innings"][0]["overs"][:1]})  # fmt: skip
    write(root / "tied.json", tied)
    return root


def test_summary_counts_skips_and_strict_stops_at_a_non_match(folder):
    rows, info = loading.load_innings(folder, match_types=list(T20), strict=False, **SPLIT)
    summary = info["summary"]
    assert summary["files"] == 16 and summary["super_over_innings"] == 1
    assert (summary["not_match"], summary["match_type"]) == (1, 1)
    assert summary["no_result"] == 1 + sum(  # the simulator's own rained-off matches
        json.loads(p.read_text())["info"]["outcome"].get("result") == "no result"
        for p in folder.glob("10*.json")
    )
    assert info["not_matches"] == [("notes.json", "no 'info' object, so not a Cricsheet match")]
    assert len(rows) == 2 * summary["matches"] and not info["cached"]
    with pytest.raises(DataError, match=r"notes.json: no 'info' object.*leave out --strict"):
        loading.load_innings(folder, match_types=list(T20), strict=True, **SPLIT)


@pytest.mark.slow
def test_the_cli_with_strict_stops_at_a_non_match_with_one_line_naming_it(folder, tmp_path):
    """The command line as a user runs it: exit code 2 at data reading, before any training,
    and one line naming the file (no traceback)."""
    out = tmp_path / "out"
    args = ["--data", str(folder), "--strict", "--output-dir", str(out)]
    result = run_recipe(args, cwd=tmp_path, script=CRICKET, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        f"error: {folder / 'notes.json'}: no 'info' object, so not a Cricsheet match; "
        "remove it, or leave out --strict to skip it"
    ], result.stderr
    assert "Traceback" not in result.stderr
    assert "optimizer steps" not in result.stdout and not (out / "model").exists()


def test_a_match_with_negative_runs_stops_the_reading_of_the_folder(folder):
    """Through the reader the training command uses (not skipped as a non-match)."""
    path = sorted(folder.glob("1*.json"))[0]
    match = json.loads(path.read_text())
    match["innings"][1]["overs"][0]["deliveries"][0]["runs"]["batter"] = -4
    write(path, match)
    expected = f"{path}, innings 2, over 0, delivery 1: runs.batter is -4; give a whole number"
    with pytest.raises(DataError, match="^" + re.escape(expected)):
        loading.load_innings(folder, match_types=list(T20), strict=False, **SPLIT)


def test_cache_is_reused_until_a_file_or_a_setting_changes(folder):
    options = dict(match_types=list(T20), strict=False)
    first, info = loading.load_innings(folder, **options, **SPLIT)
    again, info = loading.load_innings(folder, **options, **SPLIT)
    assert info["cached"] and again["y"] == first["y"]
    _, info = loading.load_innings(folder, **options, **{**SPLIT, "split_seed": 1})
    assert not info["cached"]
    write(folder / "tied.json", a_match(4))
    _, info = loading.load_innings(folder, **options, **SPLIT)
    assert not info["cached"]


def test_a_changed_reader_builds_its_tables_again(folder, monkeypatch):
    """A table the reader built before a fix (one that now refuses an innings) was reused."""
    options = dict(match_types=list(T20), strict=False)
    loading.load_innings(folder, **options, **SPLIT)
    assert loading.load_innings(folder, **options, **SPLIT)[1]["cached"]
    monkeypatch.setattr(loading, "READER", code_digest(__file__))  # other code, same data
    assert not loading.load_innings(folder, **options, **SPLIT)[1]["cached"]


def modules_building_the_tables() -> list[str]:
    """The recipe's modules that loading.py imports, directly or through one another (ast)."""
    import ast

    here = Path(loading.__file__).parent
    found, todo = {"loading.py"}, ["loading.py"]
    while todo:
        for node in ast.walk(ast.parse((here / todo.pop()).read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "recipes.cricket."
            ):
                name = node.module.rsplit(".", 1)[1] + ".py"
                if name not in found:
                    found.add(name)
                    todo.append(name)
    return sorted(found)


@pytest.mark.parametrize("module", modules_building_the_tables())
def test_an_edit_to_any_module_that_builds_the_tables_changes_the_cache_key(module, monkeypatch):
    """READER digested parsing, innings, split, vocab and loading but not features.py (which
    computes the original's cached columns o_ctx, o_ball, o_y and parsing's wicket_kind) nor
    schema.py (which sizes them): an edit there reused tables the old code built. loading.py is
    run afresh, under another name, with that one module's digest changed."""
    import importlib.util

    import accel_common.data

    digest = accel_common.data.code_digest

    def reader(edited: str) -> str:
        monkeypatch.setattr(
            accel_common.data,
            "code_digest",
            lambda path: "edited" if Path(path).name == edited else digest(path),
        )
        spec = importlib.util.spec_from_file_location("loading_edited", loading.__file__)
        fresh = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fresh)
        return fresh.READER

    assert reader("graphs.py") == loading.READER  # not a builder: the same key
    assert reader(module) != loading.READER


def test_split_by_match_and_by_date_and_vocabulary_from_training_only(folder):
    options = dict(match_types=list(T20), strict=False)
    rows, info = loading.load_innings(folder, **options, **{**SPLIT, "split_by_date": True})
    table = rows.select_columns(["file", "split"]).to_pandas()
    assert (table.groupby("file")["split"].nunique() == 1).all()  # never inside a match
    dates = {f: json.loads((folder / f).read_text())["info"]["dates"][0] for f in set(table.file)}
    table["date"] = table["file"].map(dates)
    assert table.groupby("split")["date"].max()[0] <= table.groupby("split")["date"].min()[2]
    assert table.loc[table.file == "tied.json", "split"].iloc[0] == 2
    # tied.json is a test match: its players, as unseen in training, are the unknown index
    tied = json.loads((folder / "tied.json").read_text())["info"]
    registry = tied["registry"]["people"]
    players = info["vocab"]["players"]
    train_files = set(table.loc[table.split == 0, "file"])
    train_ids = set()
    for name in train_files:
        train_ids |= set(
            json.loads((folder / name).read_text())["info"]["registry"]["people"].values()
        )
    assert set(players) <= train_ids and 0 not in players.values()
    row = next(i for i, f in enumerate(rows["file"]) if f == "tied.json")
    ids = np.asarray(rows[row]["actor_ids"])
    expected = [players.get(registry[n], 0) for n in tied["players"][tied["teams"][0]]]
    assert set(ids.tolist()) <= {0, *expected, *players.values()}


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda m: m["innings"][0].pop("overs"), "innings 1: no overs"),
        (lambda m: m["innings"][0].__setitem__("overs", None), "innings 1: overs is not a list"),
        (lambda m: first_runs(m).update(total=10**30), "runs.total is 1" + "0" * 30),
        (lambda m: first_runs(m).update(batter=40000, total=40000), "runs.batter is 40000"),
        (lambda m: first_runs(m).update(total=1.5), "runs.total is 1.5"),
        (lambda m: m["innings"][0]["overs"][0].__setitem__("over", 99999), "over number is 99999"),
        (lambda m: m["info"].__setitem__("overs", 10**12), "info.overs is 1000000000000"),
        (lambda m: m.__setitem__("innings", [1, 2]), "innings is not a list of dicts"),
        # fault-injection pass: a batting team outside info.teams trained with a guessed bowler
        (lambda m: m["innings"][0].__setitem__("team", "Nobody FC"), "team 'Nobody FC' is not"),
    ],
)
def test_an_innings_without_overs_or_an_absurd_count_is_one_line_naming_the_file(
    folder, edit, says
):
    """Issue 43: an innings with no overs, or a run count past the int16 column, ended in a
    traceback (bitwise_and on an empty array, ArrowInvalid, OverflowError); 1.5 runs was cut to
    1 without a word. One line naming the file, the innings and the value."""
    path = sorted(folder.glob("1*.json"))[0]
    match = json.loads(path.read_text())
    edit(match)
    write(path, match)
    with pytest.raises(DataError) as refused:
        loading.load_innings(folder, match_types=list(T20), strict=False, **SPLIT)
    assert str(refused.value).startswith(f"{path}") and says in str(refused.value)
    assert "\n" not in str(refused.value)


def first_runs(match: dict) -> dict:
    return match["innings"][0]["overs"][0]["deliveries"][0]["runs"]


@pytest.mark.timeout(30)  # before: training waited on the FIFO with no output until killed
def test_a_fifo_among_the_match_files_is_refused_naming_it_before_anything_reads(tmp_path):
    write(tmp_path / "1.json", a_match())
    fifo = tmp_path / "2.json"
    os.mkfifo(fifo)
    with pytest.raises(DataError) as error:
        loading.load_innings(tmp_path, match_types=list(T20), strict=False, **SPLIT)
    assert str(error.value) == (
        f"{fifo}: is a FIFO (named pipe), not a regular file; remove it from --data, which "
        "holds match files"
    )


def test_predict_on_a_folder_says_it_is_one_and_what_it_takes(tmp_path):
    out = tmp_path / "out.csv"
    with pytest.raises(DataError) as error:
        recipe.predict(match=tmp_path, out=out, model_dir=tmp_path / "model")
    assert str(error.value) == (
        f"--match {tmp_path}: is a folder, not a regular file; give one Cricsheet match .json file"
    )
    assert not out.exists()


def test_a_match_file_nested_too_deeply_is_a_non_match_named_in_one_line(folder):
    """Before: json's RecursionError came out of training and `predict` as a traceback."""
    deep = folder / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(NotAMatch) as error:  # predict names the file with it (--match)
        parse_match(deep, T20)
    assert str(error.value) == NESTED_TOO_DEEPLY
    info = loading.load_innings(folder, match_types=list(T20), strict=False, **SPLIT)[1]
    assert ("deep.json", NESTED_TOO_DEEPLY) in info["not_matches"]
    with pytest.raises(DataError) as error:
        loading.load_innings(folder, match_types=list(T20), strict=True, **SPLIT)
    assert str(error.value) == (
        f"{deep}: {NESTED_TOO_DEEPLY}; remove it, or leave out --strict to skip it"
    )


def test_a_match_file_whose_name_is_not_utf8_is_read_and_named_escaped(folder):
    """A file named b'm\\xff.json' stopped the table build with Arrow's UnicodeEncodeError: the
    paths travel as bytes, the name as m\\xff.json."""
    source = sorted(folder.glob("*.json"))[0]
    os.rename(source, os.fsencode(folder) + b"/m\xff.json")
    rows, info = loading.load_innings(folder, match_types=list(T20), strict=False, **SPLIT)
    assert info["summary"]["files"] == 16
    assert os.fsencode(folder) + b"/m\xff.json" in map(os.fsencode, info["files"])
    assert "m\\xff.json" in set(rows["file"])
