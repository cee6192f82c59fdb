"""The cricket recipe's network: cricketmodel's `CricketHeteroGNN` and `CricketHeteroGNNFull`
(lyndonkl/cricketmodel @a97d68e, src/model/hetero_gnn.py, encoders.py, conv_builder.py), module
for module, so that a state dict of either maps one to one onto the original's tensors (the
same names and shapes; recipes/cricket/convert.py reads and writes the original's checkpoints).

- Encoders: an embedding + MLP per entity node (venue, the two teams), a hierarchical player
  encoder (identity embedding, or for an unknown player a team + role fallback), an MLP per
  numeric context node, a ball encoder (18 features + bowler and batter embeddings) and a learned
  query vector.
- Message passing: `layers` blocks of PyG `HeteroConv` (sum over edge types) with a residual,
  a LayerNorm per node type and dropout: GATv2 on most edge types, TransformerConv with a 1-wide
  edge feature (temporal distance, position in the over) on the ball-to-ball edges, mean SAGE on
  the sparse distant edges.
- Head: Linear-ReLU-Dropout-Linear on the query node, in raw runs.
- `Full` (the tuned model): FiLM modulation of every node type after each block, conditioned on
  the phase, chase and wicket-buffer features; a hybrid readout (striker x bowler matchup gated
  by the non-striker, plus the query); in a chase, the readout and the chase state go through a
  projection before the same head.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

with warnings.catch_warnings():  # PyG's import trips torch's own torch.jit deprecation warning
    warnings.simplefilter("ignore", FutureWarning)
    from torch_geometric.nn import GATv2Conv, HeteroConv, SAGEConv, TransformerConv

from accel_common import ConfigError
from recipes.cricket.schema import (
    BALL_FEATURE_DIM,
    EDGE_TYPES,
    FEATURE_DIMS,
    NODE_TYPES,
    NUM_ROLES,
    SAGE_RELATIONS,
    TRANSFORMER_RELATIONS,
)

# the original's ModelConfig defaults
VENUE_EMBED, TEAM_EMBED, PLAYER_EMBED, ROLE_EMBED = 32, 32, 64, 16
CONDITION_DIM = 15  # phase_state 6 + chase_state 7 + wicket_buffer 2
CHASE_DIM = 7


def _mlp(d_in: int, hidden: int, dropout: float, norm_out: bool = False) -> nn.Sequential:
    """Linear-LayerNorm-GELU-Dropout-Linear (and a last LayerNorm for the feature encoders)."""
    layers = [nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(dropout)]
    layers.append(nn.Linear(hidden, hidden))
    if norm_out:
        layers.append(nn.LayerNorm(hidden))
    return nn.Sequential(*layers)


def _embedding(n: int, dim: int) -> nn.Embedding:
    """An embedding with index 0 for unknown (zero, no gradient), N(0, 0.02) otherwise."""
    table = nn.Embedding(n + 1, dim, padding_idx=0)
    nn.init.normal_(table.weight, mean=0.0, std=0.02)
    with torch.no_grad():
        table.weight[0].fill_(0)
    return table


class EntityEncoder(nn.Module):
    def __init__(self, n: int, embed_dim: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.embedding = _embedding(n, embed_dim)
        self.projection = _mlp(embed_dim, hidden, dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.projection(self.embedding(ids.squeeze(-1)))


class HierarchicalPlayerEncoder(nn.Module):
    """A known player's own embedding; an unknown one (id 0) falls back to team + role."""

    def __init__(self, players: int, teams: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.num_players, self.hidden_dim = players, hidden
        self.player_embed = _embedding(players, PLAYER_EMBED)
        self.team_embed = _embedding(teams, TEAM_EMBED // 2)
        self.role_embed = _embedding(NUM_ROLES, ROLE_EMBED)
        self.player_projection = _mlp(PLAYER_EMBED, hidden, dropout)
        self.fallback_projection = _mlp(TEAM_EMBED // 2 + ROLE_EMBED, hidden, dropout)

    def forward(self, player: torch.Tensor, team: torch.Tensor, role: torch.Tensor):
        player, team, role = player.squeeze(-1), team.squeeze(-1), role.squeeze(-1)
        known = self.player_projection(self.player_embed(player))
        fallback = torch.cat([self.team_embed(team), self.role_embed(role)], dim=-1)
        return torch.where((player == 0).unsqueeze(-1), self.fallback_projection(fallback), known)


class FeatureEncoder(nn.Module):
    def __init__(self, d_in: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.encoder = _mlp(d_in, hidden, dropout, norm_out=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


class BallEncoder(nn.Module):
    def __init__(self, players: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.bowler_embed = _embedding(players, PLAYER_EMBED)
        self.batsman_embed = _embedding(players, PLAYER_EMBED)
        self.projection = _mlp(2 * PLAYER_EMBED + BALL_FEATURE_DIM, hidden, dropout, True)

    def forward(self, x, bowler_ids, batsman_ids) -> torch.Tensor:
        combined = [x, self.bowler_embed(bowler_ids), self.batsman_embed(batsman_ids)]
        return self.projection(torch.cat(combined, dim=-1))


class QueryEncoder(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.embedding = nn.Parameter(torch.randn(1, hidden) * 0.02)

    def forward(self, n: int) -> torch.Tensor:
        return self.embedding.expand(n, -1)


class NodeEncoderDict(nn.Module):
    """One encoder per node type, to the common hidden width."""

    def __init__(self, vocab_sizes: dict[str, int], hidden: int, dropout: float) -> None:
        super().__init__()
        venues, teams, players = (vocab_sizes[k] for k in ("venues", "teams", "players"))
        self.use_hierarchical_player = True
        self.venue_encoder = EntityEncoder(venues, VENUE_EMBED, hidden, dropout)
        self.team_encoder = EntityEncoder(teams, TEAM_EMBED, hidden, dropout)
        self.player_encoder = HierarchicalPlayerEncoder(players, teams, hidden, dropout)
        self.feature_encoders = nn.ModuleDict(
            {kind: FeatureEncoder(d, hidden, dropout) for kind, d in FEATURE_DIMS.items()}
        )
        self.ball_encoder = BallEncoder(players, hidden, dropout)
        self.query_encoder = QueryEncoder(hidden)

    def encode_nodes(self, data) -> dict[str, torch.Tensor]:
        x = {
            "venue": self.venue_encoder(data["venue"].x),
            "batting_team": self.team_encoder(data["batting_team"].x),
            "bowling_team": self.team_encoder(data["bowling_team"].x),
        }
        for kind in ("striker_identity", "nonstriker_identity", "bowler_identity"):
            node = data[kind]
            x[kind] = self.player_encoder(node.x, node.team_id, node.role_id)
        for kind, encoder in self.feature_encoders.items():
            x[kind] = encoder(data[kind].x)
        ball = data["ball"]
        x["ball"] = self.ball_encoder(ball.x, ball.bowler_ids, ball.batsman_ids)
        x["query"] = self.query_encoder(data["query"].num_nodes)
        return x


class SAGEConvWrapper(nn.Module):
    """Mean SAGE that ignores the edge attribute HeteroConv hands it."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.conv = SAGEConv(hidden, hidden, aggr="mean")

    def forward(self, x, edge_index, edge_attr=None):
        return self.conv(x, edge_index)


def build_hetero_conv(hidden: int, heads: int, dropout: float) -> HeteroConv:
    per_head = hidden // heads
    convs: dict[tuple[str, str, str], nn.Module] = {}
    for edge in EDGE_TYPES:
        if edge[1] in TRANSFORMER_RELATIONS:
            convs[edge] = TransformerConv(
                hidden, per_head, heads=heads, concat=True, dropout=dropout, edge_dim=1
            )
        elif edge[1] in SAGE_RELATIONS:
            convs[edge] = SAGEConvWrapper(hidden)
        else:
            convs[edge] = GATv2Conv(
                hidden, per_head, heads=heads, add_self_loops=False, concat=True, dropout=dropout
            )
    return HeteroConv(convs, aggr="sum")


class FiLMLayer(nn.Module):
    """gamma * x + beta, gamma and beta from the graph's condition (starts as the identity)."""

    def __init__(self, condition_dim: int, hidden: int) -> None:
        super().__init__()
        self.film_generator = nn.Sequential(
            nn.Linear(condition_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden * 2)
        )
        with torch.no_grad():
            self.film_generator[-1].weight.fill_(0.0)
            self.film_generator[-1].bias.zero_()
            self.film_generator[-1].bias[:hidden].fill_(1.0)

    def forward(self, x, condition, batch=None) -> torch.Tensor:
        gamma, beta = self.film_generator(condition).chunk(2, dim=-1)
        if batch is not None and gamma.shape[0] != x.shape[0]:
            gamma, beta = gamma[batch], beta[batch]
        elif gamma.shape[0] == 1 and x.shape[0] > 1:
            gamma, beta = gamma.expand(x.shape[0], -1), beta.expand(x.shape[0], -1)
        return gamma * x + beta


class HeteroConvBlock(nn.Module):
    """HeteroConv, residual, LayerNorm per node type, (FiLM), dropout."""

    def __init__(self, hidden: int, heads: int, dropout: float, film: bool = False) -> None:
        super().__init__()
        self.node_types = NODE_TYPES
        self.conv = build_hetero_conv(hidden, heads, dropout)
        self.norms = nn.ModuleDict({kind: nn.LayerNorm(hidden) for kind in NODE_TYPES})
        if film:
            self.film_layers = nn.ModuleDict(
                {kind: FiLMLayer(CONDITION_DIM, hidden) for kind in NODE_TYPES}
            )
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, edge_index_dict, edge_attr_dict=None, condition=None, batch_dict=None):
        if edge_attr_dict:
            out = self.conv(x, edge_index_dict, edge_attr_dict=edge_attr_dict)
        else:
            out = self.conv(x, edge_index_dict)
        result = {}
        for kind, h in out.items():
            if kind in x and x[kind].shape[0] > 0:
                h = h + x[kind]
            h = self.norms[kind](h)
            if condition is not None:
                batch = batch_dict.get(kind) if batch_dict else None
                h = self.film_layers[kind](h, condition, batch=batch)
            result[kind] = self.dropout(h)
        return result | {k: v for k, v in x.items() if k not in result}


def _edge_attrs(data) -> dict:
    return {
        edge: data[edge].edge_attr
        for edge in data.edge_index_dict
        if getattr(data[edge], "edge_attr", None) is not None
    }


def _score_head(hidden: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(hidden, hidden // 2), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden // 2, 1)
    )


def _check(hidden: int, heads: int) -> None:
    if hidden % heads:
        raise ConfigError(f"--hidden {hidden} must be a multiple of --heads {heads}")


class _EncodersAndBlocks(nn.Module):
    """What both of the original's models start with, registered first and in this order (the
    state dict's keys follow it): the node encoders, then the message-passing blocks."""

    def __init__(
        self,
        vocab_sizes: dict[str, int],
        hidden: int,
        layers: int,
        heads: int,
        dropout: float,
        film: bool = False,
    ) -> None:
        super().__init__()
        _check(hidden, heads)
        self.encoders = NodeEncoderDict(vocab_sizes, hidden, dropout)
        self.conv_stack = nn.ModuleList(
            HeteroConvBlock(hidden, heads, dropout, film=film) for _ in range(layers)
        )


class CricketHeteroGNN(_EncodersAndBlocks):
    """The original's default model: encoders, message passing, the query node to the head.
    `forward` returns the predicted runs, shape (graphs,) (the original's is a dict
    {'score': (graphs, 1)})."""

    def __init__(
        self, vocab_sizes: dict[str, int], hidden: int, layers: int, heads: int, dropout: float
    ) -> None:
        super().__init__(vocab_sizes, hidden, layers, heads, dropout)
        self.score_head = _score_head(hidden, dropout)

    def forward(self, data) -> torch.Tensor:
        x = self.encoders.encode_nodes(data)
        attrs = _edge_attrs(data)
        for block in self.conv_stack:
            x = block(x, data.edge_index_dict, attrs or None)
        return self.score_head(x["query"]).squeeze(-1)


class CricketHeteroGNNFull(_EncodersAndBlocks):
    """The original's full model (its tuned run): FiLM-modulated blocks, hybrid matchup + query
    readout, innings-conditional chase projection."""

    def __init__(
        self, vocab_sizes: dict[str, int], hidden: int, layers: int, heads: int, dropout: float
    ) -> None:
        super().__init__(vocab_sizes, hidden, layers, heads, dropout, film=True)
        self.matchup_mlp = nn.Sequential(
            nn.Linear(hidden * 2, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(dropout)
        )
        self.query_proj = nn.Sequential(nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.GELU())
        self.combiner = nn.Sequential(
            nn.Linear(hidden * 2, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(dropout)
        )
        self.nonstriker_gate = nn.Sequential(
            nn.Linear(hidden, hidden // 4), nn.GELU(), nn.Linear(hidden // 4, hidden), nn.Sigmoid()
        )
        self.score_head = _score_head(hidden, dropout)
        self.chase_projection = nn.Sequential(
            nn.Linear(hidden + CHASE_DIM, hidden), nn.LayerNorm(hidden), nn.GELU()
        )

    def forward(self, data) -> torch.Tensor:
        x = self.encoders.encode_nodes(data)
        attrs = _edge_attrs(data)
        chase = data["chase_state"].x
        condition = torch.cat([data["phase_state"].x, chase, data["wicket_buffer"].x], dim=-1)
        batches = {
            kind: data[kind].batch for kind in x if getattr(data[kind], "batch", None) is not None
        }
        for block in self.conv_stack:
            x = block(x, data.edge_index_dict, attrs or None, condition, batches)
        striker, bowler = x["striker_identity"], x["bowler_identity"]
        matchup = self.matchup_mlp(torch.cat([striker, bowler], dim=-1))
        matchup = matchup * (1.0 + 0.1 * self.nonstriker_gate(x["nonstriker_identity"]))
        readout = self.combiner(torch.cat([matchup, self.query_proj(x["query"])], dim=-1))
        first = self.score_head(readout)
        second = self.score_head(self.chase_projection(torch.cat([readout, chase], dim=-1)))
        is_chase = data.is_chase.view(-1, 1).expand_as(first)
        return torch.where(is_chase, second, first).squeeze(-1)


MODELS = {"CricketHeteroGNN": CricketHeteroGNN, "CricketHeteroGNNFull": CricketHeteroGNNFull}
