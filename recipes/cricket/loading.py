"""The Arrow cache of a folder of match files: `load_innings` parses them and computes every
innings' features once, cached with Hugging Face `datasets` (keyed by the files' bytes, the
settings and the code that builds the tables), with the split by match and the training
vocabulary.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import datasets

from accel_common import DataError
from accel_common.data import cache_key, cache_root, cached, code_digest, files_digest, save_whole
from recipes.cricket.innings import innings_features
from recipes.cricket.parsing import (
    ORIGINAL_COLUMNS,
    NotAMatch,
    match_files,
    match_registries,
    parse_match,
)
from recipes.cricket.split import split_matches
from recipes.cricket.vocab import VOCAB_FILE, build_vocab, keyed_by_registry

FORMAT = 3  # bump when the cached columns change
# the modules whose code builds the tables, in the cache key: a fixed reader never reuses an
# old table. features.py computes the original's columns (o_ctx, o_ball, o_y; parsing's
# wicket_kind) and schema.py sizes them (FEATURE_DIMS, BALL_FEATURE_DIM)
BUILDERS = (
    "parsing.py", "innings.py", "features.py", "schema.py", "split.py", "vocab.py", "loading.py",
)  # fmt: skip
READER = cache_key(*(code_digest(Path(__file__).with_name(name)) for name in BUILDERS))

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
    every = list(dict.fromkeys(status["file"]))  # every .json file, in the folder's name order
    split = split_matches(every, used, dates, ratios, split_seed, split_by_date)
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
    # the members of each split, digested: part of the run's identity (a resume on other
    # members, another version's split, is refused)
    info = {"vocab": vocab, "summary": summary, "split_members": cache_key(sorted(split.items()))}
    save_whole(rows, target, {VOCAB_FILE: json.dumps(info)})
    return info
