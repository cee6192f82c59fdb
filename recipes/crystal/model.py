"""The crystal recipe's networks: ComFormer's iComformer and eComformer (Yan et al., ICLR 2024),
layer for layer.

As jwchen25/comformer @7241ae8 builds it (comformer/models/comformer.py 148-229, transformer.py
15-185, utils.py 9-45), with its module names, so that its `best_model.pt` state dict loads here
key for key (166 tensors at its default config, 4,966,497 parameters):

- atoms: the 92 CGCNN features of each element (a fixed table, recipes/crystal/cgcnn_features.json,
  not a parameter) -> `atom_embedding` (Linear 92 -> width);
- edges: `rbf` (RBF of -0.75 / |r| on `rbf_bins` centres in [-4, 0] -> Linear -> Softplus); the
  three lattice vectors of the structure enter each edge as their lengths (through the same
  `rbf`) and their cosines with the edge vector (`rbf_angle`: `angle_bins` centres in [-1, 1]);
- `att_layers`: `ComformerConv` node updates (query/key/value/edge projections, key update and
  message MLPs on [x_i, x_j, e_ij], a BatchNorm-ed sigmoid gate, summed messages, heads
  concatenated then projected, BatchNorm, residual, softplus);
- after the first, `edge_update_layer` (`ComformerConv_edge`): each edge attends over the three
  lattice vectors with per-vector key/value projections (`lin_key_e1..3`, `lin_value_e1..3`),
  BatchNorm-ed gate, residual, softplus. It also carries the original's unused `lemb` and
  `lin_edge_len`, so that the parameter count and the keys are the original's;
- mean over atoms -> `fc` (Linear, SiLU) -> `fc_out` (Linear -> 1).

eComformer (comformer.py 71-145, transformer.py 188-268) shares the atom features, `rbf`,
the `ComformerConv`s and the head; after the first convolution, instead of the edge update, its
`equi_update` (`ComformerConvEqui`): the nodes narrowed to 64 scalars, two e3nn tensor products
with the edge vector's spherical harmonics (l = 0, 1, 2; weights per edge from an MLP of the
edge's RBF features; mean over each atom's edges, 64x0e -> 64x0e + 8x1o + 8x2e -> 64x0e),
BatchNorm, a projection back and a skip connection (5,583,809 parameters, 116 tensors).

Every BatchNorm is, by default, `BatchNorm` (accel_common's GlobalBatchNorm), whose training
statistics are summed in float64 and are those of the whole global batch when several processes
train (see its docstring), so that 1 and N processes take the same steps; `batchnorm="torch"` (the
presets) builds the original's plain BatchNorm1d instead (`BATCHNORMS`), whose step is the
original's bit for bit. The original runs `att_layers` 0..3 by index (its forward needs exactly 4);
here `layers` convolutions run in order, the edge update after the first: the same at 4.
"""

from __future__ import annotations

import json
import math
import warnings
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.amp import is_autocast_available

from accel_common import GlobalBatchNorm

with warnings.catch_warnings():  # PyG's import trips torch's own torch.jit deprecation warning
    warnings.simplefilter("ignore", FutureWarning)
    from torch_geometric.data import Data
    from torch_geometric.nn import MessagePassing, global_mean_pool
    from torch_geometric.utils import scatter

CGCNN_TABLE = Path(__file__).with_name("cgcnn_features.json")
VARIANTS = ("iComformer", "eComformer")  # the original's model names this recipe builds
# the BatchNorms it can train with: its own float64, global-batch one, or torch's, as the original
BATCHNORMS = ("float64", "torch")


def cgcnn_features() -> torch.Tensor:
    """The original's atom features: one row of 92 CGCNN features per atomic number 0..103 (row 0
    and any element the table lacks: zeros; 101-103 repeat 100, as jarvis-tools falls back)."""
    table = json.loads(CGCNN_TABLE.read_text())
    return torch.tensor(table["features"], dtype=torch.float32, device="cpu")


class RBFExpansion(nn.Module):
    """Gaussians exp(-gamma (v - c)^2) on `bins` centres in [vmin, vmax]; gamma = 1 / spacing,
    the spacing as the original computes it (mean of the float32 centre differences)."""

    def __init__(self, vmin: float, vmax: float, bins: int) -> None:
        super().__init__()
        self.register_buffer("centers", torch.linspace(vmin, vmax, bins))
        spacing = np.diff(torch.linspace(vmin, vmax, bins, device="cpu").numpy()).mean()
        self.gamma = float(np.float32(1) / spacing)  # a number, even on `meta`

    def forward(self, value: torch.Tensor) -> torch.Tensor:
        return torch.exp(-self.gamma * (value.unsqueeze(1) - self.centers) ** 2)


class BatchNorm(GlobalBatchNorm):
    """BatchNorm1d over the global batch. In training, the count and each channel's sum and sum
    of squares (accumulated in float64) are summed over the processes with one autograd-aware
    all-reduce (torch.distributed.nn), so every process normalises with the
    statistics of the whole global batch, the gradient flows through them as in one process,
    and the running statistics (hence evaluation) are the same on every process and equal one
    process's. torch's SyncBatchNorm does this on GPUs only; this one works on gloo (CPU) too.

    One process trains with the same formula (no all-reduce), not torch's own batch norm, whose
    float32 CPU kernels are less exact where a channel's variance is small (as the attention
    gates' are): on the fixture batch, its outputs are up to 6.8e-5 from float64 against 3.0e-6
    here, and at 60,000 rows its bias and weight gradients 3e-6 and 5e-4 relative against 4e-8
    and 6e-6 here (measured); with it, 1 and 2 processes took visibly different steps (a
    BatchNorm bias 1.4e-2 apart after 20). Evaluation: plain BatchNorm1d with the running
    statistics, the original's.

    `synchronised = False` (the recipe's --no-sync-batchnorm) skips the all-reduce: each process
    normalises with its own rows' statistics, as plain DDP does (and the original's `distributed`
    mode would): N processes then take other steps than one."""


def widened(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in float32 if it is in a narrower float (bf16 or fp16 under autocast); as it
    is otherwise (float32 and float64 runs are untouched, bit for bit)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def in_float32(module: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
    """`module(*inputs)` with autocast off (on the inputs' device type) and inputs `widened`: in
    float32 under mixed precision, the plain call otherwise. For the Linears whose outputs a
    BatchNorm normalises: in bf16 their outputs are rounded to 8 bits of their magnitude, while
    the BatchNorm keeps only the deviation from the channel's mean, up to ~400x smaller here (a
    bias common to every row); see docs/recipes/crystal.md, "bf16"."""
    device = inputs[0].device.type
    # a device without autocast (`meta`) has nothing to turn off
    off = torch.autocast(device, enabled=False) if is_autocast_available(device) else nullcontext()
    with off:
        return module(*(widened(t) for t in inputs))


def mlp(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(3 * width, width), nn.SiLU(), nn.Linear(width, width))


class ComformerConv(MessagePassing):
    """Node update (the original's ComformerConv, transformer.py 15-93): for edge j -> i, key
    update and message from [., ., e_ij] with the original's projections; the gate is the
    sigmoid of the BatchNorm-ed query-key product; messages summed at i."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__(aggr="add", node_dim=0)
        self.heads, self.width = heads, width
        self.lin_key = nn.Linear(width, heads * width)
        self.lin_query = nn.Linear(width, heads * width)
        self.lin_value = nn.Linear(width, heads * width)
        self.lin_edge = nn.Linear(width, heads * width)
        self.lin_concate = nn.Linear(heads * width, width)
        self.lin_msg_update = mlp(width)
        self.key_update = mlp(width)
        self.bn = BatchNorm(width)
        self.bn_att = BatchNorm(width)

    def forward(
        self, x: torch.Tensor, edge_index: torch.Tensor, edge: torch.Tensor
    ) -> torch.Tensor:
        h, c = self.heads, self.width
        query = self.lin_query(x).view(-1, h, c)
        key = self.lin_key(x).view(-1, h, c)
        value = self.lin_value(x).view(-1, h, c)
        # gathered per edge and summed per node in float32 under mixed precision: on CUDA
        # both sums (the messages at i, and in backward the gradients of each node's query,
        # key and value over its edges) are atomic adds, rounded to bf16 at every add
        q, k, v = widened(query), widened(key), widened(value)
        out = self.propagate(edge_index, query=q, key=k, value=v, edge_attr=edge)
        out = in_float32(self.lin_concate, out.view(-1, h * c))
        return F.softplus(x + self.bn(out))

    def message(self, query_i, key_i, key_j, value_i, value_j, edge_attr) -> torch.Tensor:
        h, c = self.heads, self.width
        edge = self.lin_edge(edge_attr).view(-1, h, c)
        key = self.key_update(torch.cat((key_i, key_j, edge), dim=-1))
        alpha = (query_i * key) / math.sqrt(c)
        out = self.lin_msg_update(torch.cat((value_i, value_j, edge), dim=-1))
        gate = torch.sigmoid(widened(self.bn_att(alpha.view(-1, c)))).view(-1, h, c)
        return widened(out) * gate  # summed in float32 (see forward)


class ComformerConvEdge(nn.Module):
    """Edge update (the original's ComformerConv_edge, transformer.py 96-185): each edge
    attends over its structure's three lattice vectors, from their RBF-expanded lengths
    (per-vector key/value projections) and their angles with the edge (`lin_edge`)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.width = heads, width
        self.lemb = nn.Embedding(3, 32)  # unused in the original's forward; kept for its keys
        self.lin_key = nn.Linear(width, heads * width)
        self.lin_query = nn.Linear(width, heads * width)
        self.lin_value = nn.Linear(width, heads * width)
        for k in (1, 2, 3):
            setattr(self, f"lin_key_e{k}", nn.Linear(width, heads * width))
            setattr(self, f"lin_value_e{k}", nn.Linear(width, heads * width))
        self.lin_edge = nn.Linear(width, heads * width, bias=False)
        self.lin_edge_len = nn.Linear(width + 32, width)  # unused there too
        for unused in (*self.lemb.parameters(), *self.lin_edge_len.parameters()):
            # no gradient ever reaches them (there neither: AdamW skips them, no decay), and
            # DDP would wait for one
            unused.requires_grad_(False)
        self.lin_concate = nn.Linear(heads * width, width)
        self.lin_msg_update = mlp(width)
        self.key_update = mlp(width)
        self.bn_att = BatchNorm(width)
        self.bn = BatchNorm(width)

    def forward(
        self, edge: torch.Tensor, nei_len: torch.Tensor, nei_angle: torch.Tensor
    ) -> torch.Tensor:
        h, c = self.heads, self.width
        query_x = self.lin_query(edge).view(-1, 1, h, c).expand(-1, 3, h, c)
        key_x = self.lin_key(edge).view(-1, 1, h, c).expand(-1, 3, h, c)
        value_x = self.lin_value(edge).view(-1, 1, h, c).expand(-1, 3, h, c)
        keys = (self.lin_key_e1, self.lin_key_e2, self.lin_key_e3)
        values = (self.lin_value_e1, self.lin_value_e2, self.lin_value_e3)
        key_y = torch.stack([f(nei_len[:, k]).view(-1, h, c) for k, f in enumerate(keys)], 1)
        value_y = torch.stack([f(nei_len[:, k]).view(-1, h, c) for k, f in enumerate(values)], 1)
        edge_xy = self.lin_edge(nei_angle).view(-1, 3, h, c)
        key = self.key_update(torch.cat((key_x, key_y, edge_xy), dim=-1))
        alpha = (query_x * key) / math.sqrt(c)
        out = self.lin_msg_update(torch.cat((value_x, value_y, edge_xy), dim=-1))
        out = out * torch.sigmoid(self.bn_att(alpha.reshape(-1, c)).view(-1, 3, h, c))
        out = in_float32(self.lin_concate, out.reshape(-1, 3, h * c)).sum(dim=1)
        return F.softplus(edge + self.bn(out))


def bond_cosine(r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    cosine = torch.sum(r1 * r2, dim=-1) / (torch.norm(r1, dim=-1) * torch.norm(r2, dim=-1))
    return torch.clamp(cosine, -1, 1)


class TensorProductConv(nn.Module):
    """The original's TensorProductConvLayer (transformer.py 188-215): an e3nn fully connected
    tensor product of the node at `edge_index[1]` with the edge's spherical harmonics, its
    weights per edge from an MLP of the edge features, averaged over the edges of each node at
    `edge_index[0]`; with `residual`, the input zero-padded to the output's width is added."""

    def __init__(
        self, in_irreps: str, sh_irreps: str, out_irreps: str, edge_dim: int, residual: bool
    ) -> None:
        super().__init__()
        from e3nn import o3  # imported here: only eComformer needs it (about 1 s to import)

        self.residual = residual
        self.tp = o3.FullyConnectedTensorProduct(
            in_irreps, sh_irreps, out_irreps, shared_weights=False
        )
        self.fc = nn.Sequential(
            nn.Linear(edge_dim, edge_dim), nn.Softplus(), nn.Linear(edge_dim, self.tp.weight_numel)
        )

    def forward(
        self, x: torch.Tensor, edge_index: torch.Tensor, edge: torch.Tensor, sh: torch.Tensor
    ) -> torch.Tensor:
        source, target = edge_index
        product = self.tp(x[target], sh, self.fc(edge))
        out = scatter(product, source, dim=0, dim_size=x.shape[0], reduce="mean")
        if self.residual:
            out = out + F.pad(x, (0, out.shape[-1] - x.shape[-1]))
        return out


class ComformerConvEqui(nn.Module):
    """eComformer's equivariant node update (the original's ComformerConvEqui, transformer.py
    218-268, at its defaults: 64 scalars, 8 vectors and 8 rank-2 features, residual)."""

    SH = "1x0e + 1x1o + 1x2e"

    def __init__(self, width: int, scalars: int = 64, vectors: int = 8) -> None:
        super().__init__()
        hidden = f"{scalars}x0e + {vectors}x1o + {vectors}x2e"
        self.node_linear = nn.Linear(width, scalars)
        self.skip_linear = nn.Linear(width, width)
        self.nlayer_1 = TensorProductConv(f"{scalars}x0e", self.SH, hidden, width, residual=True)
        self.nlayer_2 = TensorProductConv(hidden, self.SH, f"{scalars}x0e", width, residual=False)
        self.bn = BatchNorm(scalars)
        self.node_linear_2 = nn.Linear(scalars, width)

    def forward(
        self, x: torch.Tensor, edge_index: torch.Tensor, edge: torch.Tensor, vector: torch.Tensor
    ) -> torch.Tensor:
        from e3nn import o3

        sh = o3.spherical_harmonics(self.SH, vector, normalize=True, normalization="component")
        out = self.nlayer_1(self.node_linear(x), edge_index, edge, sh)
        out = self.nlayer_2(out, edge_index, edge, sh)
        out = F.softplus(self.node_linear_2(F.softplus(self.bn(out))))
        return out + self.skip_linear(x)


class Comformer(nn.Module):
    """iComformer. `width` is the original's node_features (= its fc input and every
    convolution's width), `rbf_bins` its edge_features, `angle_bins` its
    triplet_input_features, `fc_features` its fc_features, `heads` its node_layer_head."""

    def __init__(
        self,
        width: int,
        layers: int,
        heads: int,
        rbf_bins: int,
        angle_bins: int | None = None,
        fc_features: int | None = None,
    ) -> None:
        super().__init__()
        angle_bins = angle_bins or rbf_bins
        fc_features = fc_features or width
        self.register_buffer("cgcnn", cgcnn_features(), persistent=False)
        self.atom_embedding = nn.Linear(self.cgcnn.shape[1], width)
        self.rbf = nn.Sequential(
            RBFExpansion(-4.0, 0.0, rbf_bins), nn.Linear(rbf_bins, width), nn.Softplus()
        )
        self.rbf_angle = nn.Sequential(
            RBFExpansion(-1.0, 1.0, angle_bins), nn.Linear(angle_bins, width), nn.Softplus()
        )
        self.att_layers = nn.ModuleList(ComformerConv(width, heads) for _ in range(layers))
        self.edge_update_layer = ComformerConvEdge(width, heads)
        self.fc = nn.Sequential(nn.Linear(width, fc_features), nn.SiLU())
        self.fc_out = nn.Linear(fc_features, 1)

    def forward(self, graph: Data) -> torch.Tensor:
        x = self.atom_embedding(self.cgcnn[graph.z])
        vector = graph.vector  # (E, 3): from the source atom to the target atom's image
        lattice = graph.lattice[graph.batch[graph.edge_index[0]]]  # (E, 3, 3)
        n = len(vector)
        edge = self.rbf(-0.75 / torch.norm(vector, dim=1))
        nei_len = self.rbf((-0.75 / torch.norm(lattice, dim=-1)).reshape(-1)).view(n, 3, -1)
        angles = bond_cosine(lattice, vector.unsqueeze(1).expand(-1, 3, -1))
        nei_angle = self.rbf_angle(angles.reshape(-1)).view(n, 3, -1)
        for layer, conv in enumerate(self.att_layers):
            x = conv(x, graph.edge_index, edge)
            if layer == 0:
                edge = self.edge_update_layer(edge, nei_len, nei_angle)
        # the batch's graph count, not PyG's batch.max() + 1: an .item(), a --compile graph break
        out = self.fc_out(self.fc(global_mean_pool(x, graph.batch, graph.num_graphs)))
        return out.squeeze(-1)


class EComformer(nn.Module):
    """eComformer, with the original's sizes as Comformer names them (its triplet_input_features
    is unused there too, so there is no `angle_bins`): convolution 0, `equi_update`, then the
    other convolutions (the original's forward runs exactly 3), mean over atoms, the head."""

    def __init__(
        self, width: int, layers: int, heads: int, rbf_bins: int, fc_features: int | None = None
    ) -> None:
        super().__init__()
        fc_features = fc_features or width
        self.register_buffer("cgcnn", cgcnn_features(), persistent=False)
        self.atom_embedding = nn.Linear(self.cgcnn.shape[1], width)
        self.rbf = nn.Sequential(
            RBFExpansion(-4.0, 0.0, rbf_bins), nn.Linear(rbf_bins, width), nn.Softplus()
        )
        self.att_layers = nn.ModuleList(ComformerConv(width, heads) for _ in range(layers))
        self.equi_update = ComformerConvEqui(width)
        self.fc = nn.Sequential(nn.Linear(width, fc_features), nn.SiLU())
        self.fc_out = nn.Linear(fc_features, 1)

    def forward(self, graph: Data) -> torch.Tensor:
        x = self.atom_embedding(self.cgcnn[graph.z])
        edge = self.rbf(-0.75 / torch.norm(graph.vector, dim=1))
        for layer, conv in enumerate(self.att_layers):
            x = conv(x, graph.edge_index, edge)
            if layer == 0:
                x = self.equi_update(x, graph.edge_index, edge, graph.vector)
        out = self.fc_out(self.fc(global_mean_pool(x, graph.batch, graph.num_graphs)))
        return out.squeeze(-1)


def synchronise_batchnorm(network: nn.Module, synchronised: bool) -> None:
    """Every BatchNorm of the network with the global batch's statistics, or each process's."""
    for module in network.modules():
        if isinstance(module, BatchNorm):
            module.synchronised = synchronised


def with_torch_batchnorm(network: nn.Module) -> None:
    """Every `BatchNorm` of the network replaced, in place, by torch's BatchNorm1d as the
    original builds it (`nn.BatchNorm1d(channels)`: eps 1e-5, momentum 0.1, affine), with its
    parameters and buffers: the same state-dict keys, torch's float32 kernels in training."""
    for parent in list(network.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, BatchNorm):
                plain = nn.BatchNorm1d(child.num_features, child.eps, child.momentum)
                plain.load_state_dict(child.state_dict())
                setattr(parent, name, plain.to(child.weight.device))


def build_network(
    model: str,
    width: int,
    layers: int,
    heads: int,
    rbf_bins: int,
    angle_bins: int | None = None,
    fc_features: int | None = None,
    batchnorm: str = "float64",
) -> Comformer | EComformer:
    """The original's network by its name (its `model_name`): iComformer or eComformer, with
    the recipe's float64 BatchNorms or torch's (`BATCHNORMS`)."""
    if batchnorm not in BATCHNORMS:
        raise ValueError(f"batchnorm {batchnorm!r}: one of {', '.join(BATCHNORMS)}")
    if model == "eComformer":
        network: Comformer | EComformer = EComformer(width, layers, heads, rbf_bins, fc_features)
    elif model == "iComformer":
        network = Comformer(width, layers, heads, rbf_bins, angle_bins, fc_features)
    else:
        raise ValueError(f"model {model!r}: this recipe builds {', '.join(VARIANTS)}")
    if batchnorm == "torch":
        with_torch_batchnorm(network)
    return network
