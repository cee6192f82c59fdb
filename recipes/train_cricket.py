"""Cricket score prediction with a heterogeneous graph neural network (Cricsheet match JSON).

Every legal delivery of a T20 innings becomes one graph of the state before it is bowled:
context nodes (venue, batting team, bowling team), four match-state nodes (score, wickets, phase,
chase), three actor nodes (striker, non-striker, bowler: who they are and their innings so far),
the last `--history` deliveries as a chain of ball nodes, and a query node that is read out.
A stack of PyG `HeteroConv` layers (GATv2 on attention edges, TransformerConv along the ball
chain, mean SAGE from the context) updates them; the query node goes through an MLP to the runs
the batting side scores in the next 5 overs (fewer when the innings ends first).

    python recipes/train_cricket.py                                  # simulated example
    python recipes/train_cricket.py --data t20s_male_json/ --split-by-date
    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/train_cricket.py \\
        --data t20s_male_json/ --per-device-bs 64 --epochs 100 --patience 10
    python recipes/train_cricket.py predict --model runs/cricket/model --match 1001349.json \\
        --out 1001349.csv

Parsing and features are computed once and cached as Arrow with Hugging Face `datasets`, keyed
by the files' bytes and the settings; graphs are assembled from the cached arrays per sample.
"""

from __future__ import annotations

import copy
import csv
import json
import time
import warnings
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
import torch.nn.functional as F
import typer
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset

with warnings.catch_warnings():  # PyG's import trips torch's own torch.jit deprecation warning
    warnings.simplefilter("ignore", FutureWarning)
    from torch_geometric.data import HeteroData
    from torch_geometric.loader.dataloader import Collater
    from torch_geometric.nn import GATv2Conv, HeteroConv, SAGEConv, TransformerConv

from accel_common.checkpoint import load_for_inference, read_recipe_export
from accel_common.console import say
from accel_common.data import cricket as cricket_data
from accel_common.data.cache import (
    cache_key,
    cache_root,
    cached,
    files_digest,
    list_column,
    save_whole,
)
from accel_common.errors import ConfigError, DataError
from accel_common.lr import Decay
from accel_common.options import TrainArgs, model_option, train_options
from accel_common.runtime import require_new_file, resolve_data, run_recipe

RECIPE = "cricket"
VOCAB_FILE = "vocab.json"
FORMAT = 1  # bump when the cached columns change

# --------------------------------------------------------------------------- WORKLOAD: data

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
        **{k: datasets.Sequence(datasets.Value("string")) for k in ("batter", "non_striker")},
        "bowler": datasets.Sequence(datasets.Value("string")),
        **{k: datasets.Sequence(datasets.Value("int16")) for k in ("runs_batter", "runs_total")},
        "flags": datasets.Sequence(datasets.Value("int8")),
    }
)
EMPTY = {"innings": 0, "venue": "", "batting_team": "", "bowling_team": "", "date": ""}
EMPTY |= {"target_runs": -1, "max_balls": 0, "balls_per_over": 6}
EMPTY |= {k: [] for k in ("batter", "non_striker", "bowler", "runs_batter", "runs_total", "flags")}
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
        "sample_pos": datasets.Sequence(datasets.Value("int32")),
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
    for path in batch["path"]:
        note = ""
        try:
            status, records = cricket_data.parse_match(Path(path), tuple(match_types))
        except cricket_data.NotAMatch as err:
            status, records, note = "not_match", [], str(err)
        for record in records or [{"status": status}]:
            row = EMPTY | record | {"file": Path(path).name, "note": note}
            for key in PARSED:
                out[key].append(row[key])
    return out


def add_features(row: dict[str, Any], vocab: dict[str, dict[str, int]]) -> dict[str, Any]:
    return cricket_data.innings_features(row, vocab)


def match_files(folder: Path) -> list[Path]:
    """The folder's `*.json` files, as the original globs them (README.txt is not one)."""
    files = sorted(folder.glob("*.json"))
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
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """The featurised innings of every usable match in `folder` (column `split`: 0 train, 1
    val, 2 test) and what the run needs beside them (vocabulary, summary, seconds, cached)."""
    start = time.perf_counter()
    files = match_files(folder)
    cache_dir = cache_root(cache_dir)
    parse_key = cache_key(files_digest(files), sorted(match_types), FORMAT)
    key = cache_key(parse_key, ratios, split_seed, split_by_date, min_matches)
    target = cache_dir / f"cricket-{key}"
    was_cached = (target / VOCAB_FILE).is_file()
    num_proc = workers if workers > 1 else None
    parsed = cached(
        cache_dir / f"cricket-parse-{parse_key}",
        lambda: datasets.Dataset.from_dict({"path": [str(f) for f in files]}).map(
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
                              min_matches, num_proc)  # fmt: skip
    else:
        info = json.loads((target / VOCAB_FILE).read_text())
    rows = datasets.load_from_disk(str(target))
    info |= {"seconds": time.perf_counter() - start, "cached": was_cached}
    info["not_matches"] = not_matches
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
) -> dict[str, Any]:
    """Split the usable matches, build the vocabulary from the training split, and compute
    every innings' features into the cache folder `target` (with the vocabulary and summary)."""
    ok = [i for i, s in enumerate(status["status"]) if s == "ok"]
    if not ok:
        raise DataError(
            "no usable T20 innings in --data (see the counts above); check --match-types"
        )
    dates = dict(zip(parsed["file"], parsed["date"], strict=True))
    used = sorted({status["file"][i] for i in ok})
    split = split_matches(used, [dates[f] for f in used], ratios, split_seed, split_by_date)
    vocab = build_vocab(parsed, [i for i in ok if split[status["file"][i]] == 0], min_matches)
    usable = parsed.select(ok)
    usable = usable.add_column("split", [split[status["file"][i]] for i in ok])
    names = [c for c in PARSED if c not in ("file", "innings")]
    rows = usable.map(
        add_features,
        fn_kwargs={"vocab": vocab},
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


class Deliveries:
    """Every delivery's arrays, flat in memory (one copy out of Arrow, shared by the splits),
    and every sample (a legal delivery) as its row, position and flat index, with its label,
    over and wickets down."""

    def __init__(self, rows: datasets.Dataset, balls_per_over: int = 6) -> None:
        positions, sample_offsets = list_column(rows, "sample_pos")
        self.y_all, offsets = list_column(rows, "y")
        self.row = np.repeat(np.arange(len(rows)), np.diff(sample_offsets))
        self.pos = positions.astype(np.int64)
        self.flat = offsets[self.row] + self.pos
        self.y = self.y_all[self.flat]
        self.over = list_column(rows, "legal_before")[0][self.flat] // balls_per_over
        self.wickets = list_column(rows, "wickets")[0][self.flat].astype(np.int64)
        self.split = rows.data.column("split").to_numpy()[self.row]
        self.rank = np.arange(len(self.row)) - sample_offsets[self.row]  # legal ball number
        self.state = list_column(rows, "state_x")[0].reshape(-1, 4, cricket_data.STATE_DIM)
        self.actor = list_column(rows, "actor_x")[0].reshape(-1, 3, cricket_data.ACTOR_DIM)
        self.actor_ids = list_column(rows, "actor_ids")[0].reshape(-1, 3).astype(np.int64)
        self.ball = list_column(rows, "ball_x")[0].reshape(-1, cricket_data.BALL_DIM)
        self.context = np.stack(
            [rows.data.column(k).to_numpy() for k in ("venue_id", "batting_id", "bowling_id")], 1
        ).astype(np.int64)


# The graph's fixed edges (context nodes: venue, batting team, bowling team; state nodes:
# score, wickets, phase, chase; actors: striker, non-striker, bowler); the ball chain's edges
# depend on how many recent balls there are.
def _full(n_src: int, n_dst: int, self_loops: bool = True) -> torch.Tensor:
    pairs = [(s, d) for s in range(n_src) for d in range(n_dst) if self_loops or s != d]
    return torch.tensor(pairs, dtype=torch.long).t().contiguous()


FIXED_EDGES = {
    ("context", "informs", "state"): _full(3, 4),
    ("context", "informs", "actor"): torch.tensor([[1, 1, 2], [0, 1, 2]]),
    ("context", "informs", "query"): _full(3, 1),
    ("state", "relates", "state"): _full(4, 4, self_loops=False),
    ("actor", "faces", "actor"): _full(3, 3, self_loops=False),
    ("state", "shapes", "actor"): _full(4, 3),
    ("actor", "shapes", "state"): _full(3, 4),
    ("state", "reads", "query"): _full(4, 1),
    ("actor", "reads", "query"): _full(3, 1),
}
CHAIN, BALL_QUERY = ("ball", "precedes", "ball"), ("ball", "reads", "query")


class CricketGraphs(Dataset):
    """One HeteroData per sample of a split, assembled from the flat delivery arrays."""

    def __init__(
        self, deliveries: Deliveries, keep: np.ndarray, history: int, baseline: PhaseBaseline
    ) -> None:
        self.d = deliveries
        self.index = np.flatnonzero(keep)
        self.history = history
        self.baseline = baseline(deliveries.over[keep], deliveries.wickets[keep])
        self.template = HeteroData()  # the edges every graph has; copied per sample (cheaper)
        for edge, edge_index in FIXED_EDGES.items():
            self.template[edge].edge_index = edge_index
        self.template["context"].num_nodes = 3
        self.template["query"].num_nodes = 1
        self.chains = [
            torch.tensor([list(range(k - 1)), list(range(1, k))], dtype=torch.long).view(2, -1)
            for k in range(history + 1)
        ]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, index: int) -> HeteroData:
        d, k = self.d, int(self.index[index])
        flat, balls = int(d.flat[k]), min(int(d.pos[k]), self.history)
        graph = copy.copy(self.template)
        graph["context"].id = torch.from_numpy(d.context[d.row[k]])
        graph["state"].x = torch.from_numpy(d.state[flat])
        graph["actor"].x = torch.from_numpy(d.actor[flat])
        graph["actor"].id = torch.from_numpy(d.actor_ids[flat])
        graph["ball"].x = torch.from_numpy(d.ball[flat - balls : flat])
        graph[CHAIN].edge_index = self.chains[balls]
        graph[BALL_QUERY].edge_index = torch.stack(
            [torch.arange(balls), torch.zeros(balls, dtype=torch.long)]
        )
        graph.y = torch.tensor([float(d.y[k])])
        graph.baseline = torch.tensor([float(self.baseline[index])])
        return graph


# --------------------------------------------------------------------------- WORKLOAD: model


class CricketGNN(nn.Module):
    """HeteroConv layers, one convolution per edge type, then an MLP on the query node."""

    def __init__(
        self, vocab_sizes: dict[str, int], hidden: int, layers: int, heads: int, dropout: float,
        mean: float, std: float,
    ) -> None:  # fmt: skip
        super().__init__()
        if hidden % heads:
            raise ConfigError(f"--hidden {hidden} must be a multiple of --heads {heads}")
        self.players = nn.Embedding(vocab_sizes["players"] + 1, hidden)
        self.venues = nn.Embedding(vocab_sizes["venues"] + 1, hidden)
        self.teams = nn.Embedding(vocab_sizes["teams"] + 1, hidden)
        self.context_role = nn.Parameter(torch.zeros(3, hidden))  # venue, batting, bowling
        self.state_in = nn.Linear(cricket_data.STATE_DIM, hidden)
        self.actor_in = nn.Linear(cricket_data.ACTOR_DIM, hidden)
        self.ball_in = nn.Linear(cricket_data.BALL_DIM, hidden)
        self.query = nn.Parameter(torch.zeros(1, hidden))
        per_head = hidden // heads

        def conv(edge: tuple[str, str, str]) -> nn.Module:
            if edge == CHAIN:  # along the ball chain: transformer attention
                return TransformerConv(hidden, per_head, heads=heads)
            if edge[0] == "context":  # sparse context: a mean
                return SAGEConv((hidden, hidden), hidden, aggr="mean")
            return GATv2Conv((hidden, hidden), per_head, heads=heads, add_self_loops=False)

        # the last layer updates only the query node, the one read out (an update of the others
        # would be parameters without gradients, which DDP refuses)
        edges = [*FIXED_EDGES, CHAIN, BALL_QUERY]
        per_layer = [edges] * (layers - 1) + [[e for e in edges if e[2] == "query"]]
        with warnings.catch_warnings():  # context nodes are inputs only, by design
            warnings.filterwarnings("ignore", "There exist node types", UserWarning)
            self.convs = nn.ModuleList(
                HeteroConv({edge: conv(edge) for edge in layer}, aggr="sum") for layer in per_layer
            )
        self.norms = nn.ModuleList(
            nn.ModuleDict({kind: nn.LayerNorm(hidden) for kind in sorted({e[2] for e in layer})})
            for layer in per_layer
        )
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Sequential(
            nn.Linear(hidden, hidden // 2),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden // 2, 1),
        )
        # the head predicts standardised runs: Adam's steps then move it at the target's scale
        self.register_buffer("mean", torch.tensor(float(mean)))
        self.register_buffer("std", torch.tensor(float(std)))

    def forward(self, graph: HeteroData) -> torch.Tensor:
        ids = graph["context"].id.view(-1, 3)
        context = torch.stack(
            [self.venues(ids[:, 0]), self.teams(ids[:, 1]), self.teams(ids[:, 2])], 1
        )
        x = {
            "context": (context + self.context_role).view(-1, self.query.shape[1]),
            "state": self.state_in(graph["state"].x),
            "actor": self.actor_in(graph["actor"].x) + self.players(graph["actor"].id),
            "ball": self.ball_in(graph["ball"].x),
            "query": self.query.expand(graph["query"].num_nodes, -1),
        }
        for conv, norms in zip(self.convs, self.norms, strict=True):
            out = conv(x, graph.edge_index_dict)
            x = {k: norms[k](v + self.dropout(F.gelu(out[k]))) if k in out else v
                 for k, v in x.items()}  # fmt: skip
        return self.head(x["query"]).squeeze(-1) * self.std + self.mean


# --------------------------------------------------------------------------- WORKLOAD: quality


def regression_metrics(pred: torch.Tensor, y: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """MAE (runs) and R^2 of `pred` against `y`, R^2 as scikit-learn and torchmetrics define it
    (constant targets: 1 if predicted exactly, else 0). Written out because both are one line and
    torchmetrics would add ~2 CPU-s of import (and a torch.jit warning) to every process."""
    pred, y = pred.double(), y.double()
    residual, spread = ((pred - y) ** 2).sum(), ((y - y.mean()) ** 2).sum()
    r2 = 1 - residual / spread if spread > 0 else float(residual == 0)
    return {f"{prefix}mae": (pred - y).abs().mean().item(), f"{prefix}r2": float(r2)}


@torch.no_grad()
def evaluate(
    accelerator: Accelerator, model: nn.Module, loader: DataLoader, mean: float
) -> dict[str, float]:
    """MAE and R^2 in runs against the training mean and the phase-aware baseline."""
    model.eval()
    predictions, targets, baselines = [], [], []
    for graph in loader:
        pred, y, base = accelerator.gather_for_metrics((model(graph), graph.y, graph.baseline))
        predictions.append(pred.float())
        targets.append(y.float())
        baselines.append(base.float())
    model.train()
    pred, y, base = torch.cat(predictions), torch.cat(targets), torch.cat(baselines)
    return {
        **regression_metrics(pred, y),
        **regression_metrics(torch.full_like(y, mean), y, "mean_"),
        **regression_metrics(base, y, "phase_"),
        "n": len(y),
    }


# --------------------------------------------------------------------------- training


def prepare_data(
    accelerator: Accelerator, args: TrainArgs, **options: Any
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """The innings table, built by the main process first (the others read its cache), and a
    one-line summary of what was read and skipped."""
    folder = resolve_data(accelerator, RECIPE, args.data, cricket_data.write_dataset)
    with accelerator.main_process_first():
        rows, info = load_innings(folder, workers=args.workers, **options)
    for file, note in info["not_matches"]:
        say(accelerator, f"warning: skipped {folder / file}: {note} (--strict stops instead)")
    summary = info["summary"]
    skipped = ", ".join(f"{summary[k]} {text}" for k, text in SKIPPED.items() if summary[k])
    say(
        accelerator,
        f"{summary['files']} files: {summary['matches']} matches, {summary['innings']} innings"
        f" used; {summary['super_over_innings']} super-over innings excluded"
        + (f"; skipped {skipped}" if skipped else "")
        + f" ({'read from the cache' if info['cached'] else 'built'} in {info['seconds']:.1f}s)",
    )
    return rows, info


@train_options(
    default_per_device_bs=64,
    lr=1e-3,
    ref_bs=64,
    epochs=8,  # the original trains up to 100 with early stopping
    schedule=Decay.cosine,
    warmup_steps=100,  # the original warms up for 5 epochs
    weight_decay=0.01,
    clip_grad=1.0,
    output_dir=Path("runs/cricket"),
)
def train(
    args: TrainArgs,
    match_types: str = typer.Option(
        ",".join(cricket_data.DEFAULT_MATCH_TYPES), help="Comma-separated info.match_type values."
    ),
    strict: bool = typer.Option(False, help="Stop at a .json that is not a match (else skip it)."),
    split_by_date: bool = typer.Option(
        False, help="Train on the earliest matches, validate and test on the latest."
    ),
    val_ratio: float = typer.Option(0.1, min=0.01, max=0.5, help="Share of matches to validate."),
    test_ratio: float = typer.Option(0.1, min=0.01, max=0.5, help="Share of matches to test."),
    split_seed: int = typer.Option(42, help="Seed of the split by match."),
    min_matches: int = typer.Option(
        2, min=1, help="Training matches a player, venue or team needs for its own embedding."
    ),
    history: int = typer.Option(24, min=1, help="Recent deliveries in the ball chain."),
    sample_every: int = typer.Option(
        1,
        min=1,
        help="Use every Nth legal delivery of an innings as a sample (neighbours share "
        "most of their 5-over window; 1 = all, as the original).",
    ),
    hidden: int = typer.Option(128, min=8, help="Hidden width (128)."),
    layers: int = typer.Option(3, min=1, help="HeteroConv layers (3)."),
    heads: int = typer.Option(4, min=1, help="Attention heads (4)."),
    dropout: float = typer.Option(0.1, min=0.0, max=0.9, help="Dropout (0.1)."),
    huber_delta: float = typer.Option(10.0, min=0.01, help="Huber loss delta, in runs (10)."),
    patience: int = typer.Option(
        0, min=0, help="Stop after this many epochs without a better val MAE (0 = never)."
    ),
    graph_cache_dir: Path | None = typer.Option(
        None, help="Folder of the preprocessing cache (default: under the datasets cache)."
    ),
) -> dict[str, float]:
    """Train the heterogeneous GNN on Cricsheet match JSON (or a simulated example)."""
    accelerator, plan = args.make_accelerator()
    ratios = (1 - val_ratio - test_ratio, val_ratio)
    rows, info = prepare_data(
        accelerator, args, match_types=[t for t in match_types.split(",") if t], strict=strict,
        ratios=ratios, split_seed=split_seed, split_by_date=split_by_date,
        min_matches=min_matches, cache_dir=graph_cache_dir,
    )  # fmt: skip
    deliveries = Deliveries(rows)
    used = deliveries.rank % sample_every == 0
    train = used & (deliveries.split == 0)
    y_train = deliveries.y[train]
    baseline = PhaseBaseline.fit(deliveries.over[train], deliveries.wickets[train], y_train)
    train_set, val_set, test_set = (
        CricketGraphs(deliveries, used & (deliveries.split == k), history, baseline)
        for k in range(3)
    )
    vocab_sizes = {k: len(v) for k, v in info["vocab"].items()}
    std = float(y_train.std() or 1.0)
    model = CricketGNN(vocab_sizes, hidden, layers, heads, dropout, baseline.mean, std)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    collate = Collater(train_set)  # PyG's batching of HeteroData
    loaders = [args.make_train_loader(train_set, plan, collate_fn=collate)]
    loaders += [
        DataLoader(s, plan.per_device_batch_size, collate_fn=collate) for s in (val_set, test_set)
    ]
    model, optimizer, train_loader, val_loader, test_loader = accelerator.prepare(
        model, optimizer, *loaders
    )
    schedule = args.make_lr_schedule(accelerator, optimizer, plan, len(train_loader))
    config = {"hidden": hidden, "layers": layers, "heads": heads, "dropout": dropout}
    config |= {
        "sample_every": sample_every,
        "history": history,
        "vocab_sizes": vocab_sizes,
        "mean": baseline.mean,
        "std": std,
    }
    config |= {"baseline": baseline.table.tolist(), "match_types": match_types}
    config |= {"split_by_date": split_by_date, "val_ratio": val_ratio, "test_ratio": test_ratio}
    config |= {"split_seed": split_seed, "min_matches": min_matches, "huber_delta": huber_delta}
    loop = args.make_loop(
        accelerator, plan, train_loader, schedule, recipe=RECIPE, config=config,
        monitor="val_mae", patience=patience,
    )  # fmt: skip

    for _epoch in loop.epochs():
        for graph in loop.batches():
            with accelerator.accumulate(model):
                loss = F.huber_loss(model(graph), graph.y, delta=huber_delta)
                accelerator.backward(loss)
                loop.clip_gradients(model)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(loss)
        val = evaluate(accelerator, model, val_loader, baseline.mean)
        test = evaluate(accelerator, model, test_loader, baseline.mean)
        metrics = {f"val_{k}": v for k, v in val.items()} | {
            f"test_{k}": v for k, v in test.items()
        }
        loop.end_epoch(metrics, model)
    metrics = loop.finish(model)
    if accelerator.is_main_process:  # predict maps names with the training vocabulary
        (args.output_dir / "model" / VOCAB_FILE).write_text(json.dumps(info["vocab"]))
    return metrics


# --------------------------------------------------------------------------- single-device use


def predict(
    match: Path = typer.Option(..., help="One Cricsheet match JSON file."),
    out: Path = typer.Option(..., help="CSV to write, one row per legal delivery."),
    model_dir: Path = model_option(RECIPE),
) -> None:
    """Predict the runs in the next 5 overs before every legal delivery of one match."""
    config = read_recipe_export(model_dir, RECIPE)
    require_new_file(out)
    vocab_path = model_dir / VOCAB_FILE
    if not vocab_path.is_file():
        raise DataError(f"{vocab_path}: missing; export the model again with train")
    vocab = json.loads(vocab_path.read_text())
    model = CricketGNN(
        config["vocab_sizes"], config["hidden"], config["layers"], config["heads"], 0.0,
        config["mean"], config["std"],
    )  # fmt: skip
    device = load_for_inference(model_dir, model)
    if not match.is_file():
        raise DataError(f"--match {match}: file not found")
    try:
        _, records = cricket_data.parse_match(match, tuple(config["match_types"].split(",")))
    except cricket_data.NotAMatch as err:
        raise DataError(f"{match}: {err}") from None
    records = [r for r in records if r["status"] == "ok"]
    if not records:
        raise DataError(f"{match}: no innings to predict (other match type, or no result)")
    table = datasets.Dataset.from_list([
        {"file": match.name, "innings": r["innings"], "split": 0}
        | cricket_data.innings_features(r, vocab) for r in records
    ], features=FEATURES)  # fmt: skip
    deliveries = Deliveries(table)
    baseline = PhaseBaseline(config["baseline"], config["mean"])
    everything = np.ones(len(deliveries.row), dtype=bool)
    graphs = CricketGraphs(deliveries, everything, config["history"], baseline)
    loader = DataLoader(graphs, batch_size=256, collate_fn=Collater(graphs))
    predictions = []
    with torch.no_grad():
        for graph in loader:
            predictions += model(graph.to(device)).tolist()
    legal = list_column(table, "legal_before")[0][deliveries.flat]
    score = list_column(table, "score")[0][deliveries.flat]
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["innings", "over_ball", "score", "predicted_next5", "actual_next5"])
        for k, pred in enumerate(predictions):
            innings, balls = records[deliveries.row[k]]["innings"], int(legal[k])
            over_ball = f"{balls // 6}.{balls % 6 + 1}"
            writer.writerow([innings, over_ball, score[k], f"{pred:.2f}", f"{deliveries.y[k]:g}"])
    print(f"wrote {out}: {len(predictions)} deliveries")


if __name__ == "__main__":
    run_recipe(train, predict=predict)
