"""cricketmodel's heterogeneous graph of a sample, assembled from the flat delivery arrays
(`Deliveries`): one graph at a time as the original builds it, and a batch of them at once.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import torch
from torch.utils.data import Dataset

with warnings.catch_warnings():  # PyG's import trips torch's own torch.jit deprecation warning
    warnings.simplefilter("ignore", FutureWarning)
    from torch_geometric.data import HeteroData

from recipes.cricket.baseline import PhaseBaseline
from recipes.cricket.features import ball_edges, cross_edges, static_edges
from recipes.cricket.samples import Deliveries
from recipes.cricket.schema import FEATURE_DIMS
from recipes.cricket.vocab import UNKNOWN

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
