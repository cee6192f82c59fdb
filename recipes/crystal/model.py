"""The crystal recipe's network: an iComformer-style graph transformer (Yan et al., ICLR 2024).

Atoms embedded by atomic number, edges by an RBF expansion of -0.75 / |r|; `layers`
graph-transformer convolutions (`ComformerConv`: query/key/value/edge projections, gated
messages); after the first, `LatticeEdgeUpdate` makes the edges aware of the lattice; the mean
over atoms goes through an MLP to one number per structure.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

with warnings.catch_warnings():  # PyG's import trips torch's own torch.jit deprecation warning
    warnings.simplefilter("ignore", FutureWarning)
    from torch_geometric.data import Data
    from torch_geometric.nn import MessagePassing, global_mean_pool


class RBF(nn.Module):
    """Gaussian radial basis expansion of a scalar on `bins` centres in [low, high], with the
    original's width: gamma = 1 / spacing (not 1 / spacing^2), so neighbouring centres overlap
    and a distance moves many features smoothly."""

    def __init__(self, low: float, high: float, bins: int) -> None:
        super().__init__()
        self.register_buffer("centres", torch.linspace(low, high, bins))
        first = torch.linspace(low, high, bins, device="cpu")[:2]  # a number, even on `meta`
        self.gamma = 1.0 / (first[1] - first[0]).item()

    def forward(self, value: torch.Tensor) -> torch.Tensor:
        return torch.exp(-self.gamma * (value[:, None] - self.centres) ** 2)


class ComformerConv(MessagePassing):
    """Node update: for edge j -> i, key and value from (x_i, x_j, e_ij); attention weights per
    channel, squashed by a layer-normalised sigmoid gate; summed messages; residual; softplus."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__(aggr="add", node_dim=0)
        self.heads, self.width = heads, width
        self.query = nn.Linear(width, heads * width)
        self.key = nn.Linear(width, heads * width)
        self.value = nn.Linear(width, heads * width)
        self.edge = nn.Linear(width, heads * width)
        self.key_update = nn.Sequential(
            nn.Linear(3 * width, width), nn.SiLU(), nn.Linear(width, width)
        )
        self.message_update = nn.Sequential(
            nn.Linear(3 * width, width), nn.SiLU(), nn.Linear(width, width)
        )
        self.gate_norm = nn.LayerNorm(width)
        self.heads_out = nn.Linear(heads * width, width)
        # the original normalises with BatchNorm, whose statistics depend on each process's
        # share of the batch; LayerNorm keeps 1 and N processes exactly equal
        self.norm = nn.LayerNorm(width)

    def forward(
        self, x: torch.Tensor, edge_index: torch.Tensor, edge: torch.Tensor
    ) -> torch.Tensor:
        h, w = self.heads, self.width
        q, k, v = (f(x).view(-1, h, w) for f in (self.query, self.key, self.value))
        out = self.propagate(edge_index, q=q, k=k, v=v, e=self.edge(edge).view(-1, h, w))
        return F.softplus(x + self.norm(self.heads_out(out.reshape(-1, h * w))))

    def message(self, q_i, k_i, k_j, v_i, v_j, e) -> torch.Tensor:
        key = self.key_update(torch.cat([k_i, k_j, e], dim=-1))
        alpha = q_i * key / math.sqrt(self.width)
        value = self.message_update(torch.cat([v_i, v_j, e], dim=-1))
        return value * torch.sigmoid(self.gate_norm(alpha))


class LatticeEdgeUpdate(nn.Module):
    """Edge update from the lattice: the cosines between each edge vector and the three lattice
    vectors of its structure, RBF-expanded, gate a residual update of the edge features (what
    makes iComformer's graphs complete for periodic structures)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.angles = RBF(-1.0, 1.0, 16)
        self.update = nn.Sequential(
            nn.Linear(width + 3 * 16, width), nn.SiLU(), nn.Linear(width, 2 * width)
        )

    def forward(
        self, edge: torch.Tensor, vector: torch.Tensor, lattice: torch.Tensor
    ) -> torch.Tensor:
        cosines = F.cosine_similarity(vector[:, None, :], lattice, dim=-1)  # (E, 3)
        angles = self.angles(cosines.reshape(-1)).view(len(edge), -1)
        update, gate = self.update(torch.cat([edge, angles], dim=-1)).chunk(2, dim=-1)
        return edge + torch.sigmoid(gate) * update


class Comformer(nn.Module):
    def __init__(self, width: int, layers: int, heads: int, rbf_bins: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(119, width)  # by atomic number
        self.rbf = RBF(-4.0, 0.0, rbf_bins)  # of -0.75 / |r|, as the original
        self.edge_embed = nn.Sequential(nn.Linear(rbf_bins, width), nn.Softplus())
        self.convs = nn.ModuleList(ComformerConv(width, heads) for _ in range(layers))
        self.edge_update = LatticeEdgeUpdate(width)
        self.head = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, 1))

    def forward(self, graph: Data) -> torch.Tensor:
        x = self.embed(graph.z)
        edge = self.edge_embed(self.rbf(-0.75 / graph.distance.clamp(min=1e-3)))
        lattice = graph.lattice[graph.batch[graph.edge_index[1]]]  # (E, 3, 3)
        for layer, conv in enumerate(self.convs):
            x = conv(x, graph.edge_index, edge)
            if layer == 0:
                edge = self.edge_update(edge, graph.vector, lattice)
        return self.head(global_mean_pool(x, graph.batch)).squeeze(-1)
