"""The cricket recipe's network: a stack of PyG `HeteroConv` layers over the graph of one
delivery (GATv2 on attention edges, TransformerConv along the ball chain, mean SAGE from the
context nodes), then an MLP on the query node to the runs in the next 5 overs. The graphs
themselves (node features, fixed edges) are built in recipes/cricket/data.py.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

with warnings.catch_warnings():  # PyG's import trips torch's own torch.jit deprecation warning
    warnings.simplefilter("ignore", FutureWarning)
    from torch_geometric.data import HeteroData
    from torch_geometric.nn import GATv2Conv, HeteroConv, SAGEConv, TransformerConv

from accel_common.errors import ConfigError
from recipes.cricket.data import ACTOR_DIM, BALL_DIM, BALL_QUERY, CHAIN, FIXED_EDGES, STATE_DIM


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
        self.state_in = nn.Linear(STATE_DIM, hidden)
        self.actor_in = nn.Linear(ACTOR_DIM, hidden)
        self.ball_in = nn.Linear(BALL_DIM, hidden)
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
