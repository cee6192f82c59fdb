"""The names recipes/cricket/data.py defined before it was split, re-exported from the modules
that hold them now, so that `from recipes.cricket.data import X` keeps working; the recipe, its
tests and its benchmarks import from those modules:

    parsing.py   Cricsheet match files read: parse_match, NotAMatch, count, listed, match_files,
                 match_registries, the delivery flags (WIDE ... RETIRED), DEFAULT_MATCH_TYPES
    innings.py   one innings record's per-delivery features: innings_features, window_runs
    vocab.py     the vocabulary: build_vocab, vocab_sizes, keyed_by_registry, UNKNOWN, VOCAB_FILE
    split.py     the split by match: split_matches
    loading.py   the Arrow cache: load_innings, build_features, parse_files, PARSED, FEATURES,
                 SKIPPED, READER (patch it there: this module's READER is a copy)
    baseline.py  PhaseBaseline, the phase baseline
    samples.py   Deliveries (the cached arrays flat in memory, the samples), TARGETS
    graphs.py    cricketmodel's graph of a sample: CricketGraphs, fill_graph, batch_graphs

cricketmodel's features and edges are in features.py, its graph's schema in schema.py.
"""

from __future__ import annotations

from recipes.cricket.baseline import PhaseBaseline
from recipes.cricket.graphs import (
    FEATURE_SLICES,
    CricketGraphs,
    batch_graphs,
    fill_graph,
    player_teams,
)
from recipes.cricket.innings import (
    ACTOR_DIM,
    BALL_DIM,
    STATE_DIM,
    WINDOW_OVERS,
    _actor_stats,
    innings_features,
    window_runs,
)
from recipes.cricket.loading import (
    EMPTY,
    FEATURES,
    FORMAT,
    PARSED,
    READER,
    SKIPPED,
    add_features,
    build_features,
    load_innings,
    parse_files,
)
from recipes.cricket.parsing import (
    BYE,
    DEFAULT_MATCH_TYPES,
    LEGBYE,
    MAX_BALLS_PER_OVER,
    MAX_OVERS,
    MAX_RUNS,
    NESTED_TOO_DEEPLY,
    NOBALL,
    NOT_DISMISSED,
    ORIGINAL_COLUMNS,
    RETIRED,
    WICKET,
    WIDE,
    NotAMatch,
    _read_innings,
    count,
    listed,
    match_files,
    match_registries,
    parse_match,
)
from recipes.cricket.samples import TARGETS, Deliveries
from recipes.cricket.split import split_matches
from recipes.cricket.vocab import (
    ENTITIES,
    UNKNOWN,
    VOCAB_FILE,
    build_vocab,
    keyed_by_registry,
    vocab_sizes,
)

__all__ = [
    "ACTOR_DIM",
    "BALL_DIM",
    "BYE",
    "DEFAULT_MATCH_TYPES",
    "EMPTY",
    "ENTITIES",
    "FEATURES",
    "FEATURE_SLICES",
    "FORMAT",
    "LEGBYE",
    "MAX_BALLS_PER_OVER",
    "MAX_OVERS",
    "MAX_RUNS",
    "NESTED_TOO_DEEPLY",
    "NOBALL",
    "NOT_DISMISSED",
    "ORIGINAL_COLUMNS",
    "PARSED",
    "READER",
    "RETIRED",
    "SKIPPED",
    "STATE_DIM",
    "TARGETS",
    "UNKNOWN",
    "VOCAB_FILE",
    "WICKET",
    "WIDE",
    "WINDOW_OVERS",
    "CricketGraphs",
    "Deliveries",
    "NotAMatch",
    "PhaseBaseline",
    "_actor_stats",
    "_read_innings",
    "add_features",
    "batch_graphs",
    "build_features",
    "build_vocab",
    "count",
    "fill_graph",
    "innings_features",
    "keyed_by_registry",
    "listed",
    "load_innings",
    "match_files",
    "match_registries",
    "parse_files",
    "parse_match",
    "player_teams",
    "split_matches",
    "vocab_sizes",
    "window_runs",
]
