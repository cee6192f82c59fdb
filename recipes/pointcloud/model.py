"""The original's network, layer for layer: pcdiff's PVCNN2 (DimensionLab/pcdiff-implant @115a399,
`PVCNN2` in pcdiff/train_completion.py line 1059 on `PVCNN2Base` in model/pvcnn_completion.py,
layers in modules/), in plain PyTorch on the point ops of ops.py.

A U-Net over points. Four set-abstraction stages: PVConv blocks (per-sample centred voxel grid,
Conv3d, GroupNorm, Swish, dropout, Conv3d, GroupNorm, Swish or voxel self-attention, squeeze-
excitation; trilinear devoxelisation, plus a point-wise MLP), then farthest-point sampling of
centres, ball query and a shared MLP max-pooled over each neighbourhood. Global self-attention.
Four feature-propagation stages: 3-nearest-neighbour interpolation back to the previous stage's
points, skip features, MLP and PVConv blocks. A sinusoidal timestep embedding through
Linear-LeakyReLU-Linear rides along with the points (grouped and interpolated as they are) and is
concatenated into every stage after the first. Module names, nesting and order are the
original's, so its state dict loads key for key (296 tensors, 27,648,963 parameters at
width_multiplier 1).

The construction reproduces the original's component builders, quirks included, because they
decide the parameter count: in set-abstraction stages after the first only the first of the
configured PVConv blocks is built; self-attention sits in the second stage's PVConv and in the
global layer, never in the feature-propagation stages (their test reads the length of a list
that is always 1 there).

One generalisation, off at the original's size: the number of centres of each set-abstraction
stage follows the number of points (num_points / 3, / 12, / 48, / 192: the original's 10240,
2560, 640, 160 at its 30720), so that the CPU-sized default (a few hundred points) keeps the
same hierarchy; `radius_multiplier` widens the ball queries for such sparse clouds (1 = the
original's 0.1 / 0.2 / 0.4 / 0.8).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from recipes.pointcloud import ops

NUM_NEIGHBORS = 128
# (PVConv: channels, blocks, voxel resolution) | None, (centres divisor, radius, MLP channels)
SA_BLOCKS = [
    ((32, 2, 32), (3, 0.1, (32, 64))),
    ((64, 3, 16), (12, 0.2, (64, 128))),
    ((128, 3, 8), (48, 0.4, (128, 256))),
    (None, (192, 0.8, (256, 256, 512))),
]
# (MLP channels of the interpolation), (PVConv: channels, blocks, voxel resolution)
FP_BLOCKS = [
    ((256, 256), (256, 3, 8)),
    ((256, 256), (256, 3, 8)),
    ((256, 128), (128, 2, 16)),
    ((128, 128, 64), (64, 2, 32)),
]


class Swish(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


class SharedMLP(nn.Module):
    """Per-point (dim 1) or per-neighbour (dim 2) 1x1 convolutions, each GroupNorm(8) + Swish.
    Given a tuple, transforms its first element and passes the rest through."""

    def __init__(self, in_channels: int, out_channels, dim: int = 1) -> None:
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d}[dim]
        layers: list[nn.Module] = []
        for oc in out_channels if isinstance(out_channels, (list, tuple)) else [out_channels]:
            layers += [conv(in_channels, oc, 1), nn.GroupNorm(8, oc), Swish()]
            in_channels = oc
        self.layers = nn.Sequential(*layers)

    def forward(self, inputs):
        if isinstance(inputs, (list, tuple)):
            return (self.layers(inputs[0]), *inputs[1:])
        return self.layers(inputs)


class SE3d(nn.Module):
    """Squeeze-excitation over a voxel grid: channel gates from the grid's mean."""

    def __init__(self, channels: int, reduction: int = 8, use_relu: bool = False) -> None:
        super().__init__()
        self.fc = nn.Sequential(
            nn.Linear(channels, channels // reduction, bias=False),
            nn.ReLU(True) if use_relu else Swish(),
            nn.Linear(channels // reduction, channels, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.fc(x.mean(-1).mean(-1).mean(-1))
        return x * gates.view(x.shape[0], x.shape[1], 1, 1, 1)


class Attention(nn.Module):
    """Self-attention over voxels (D=3) or points (D=1): unscaled, residual, GroupNorm, Swish."""

    def __init__(self, channels: int, num_groups: int, D: int = 3) -> None:
        super().__init__()
        conv = {1: nn.Conv1d, 3: nn.Conv3d}[D]
        self.q, self.k, self.v = (conv(channels, channels, 1) for _ in range(3))
        self.out = conv(channels, channels, 1)
        self.norm = nn.GroupNorm(num_groups, channels)
        self.nonlin = Swish()
        self.sm = nn.Softmax(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels = x.shape[:2]
        q, k, v = (f(x).reshape(batch, channels, -1) for f in (self.q, self.k, self.v))
        w = self.sm(torch.matmul(q.permute(0, 2, 1), k))  # (B, V, V), no 1/sqrt(C)
        h = torch.matmul(v, w.permute(0, 2, 1)).reshape(x.shape)
        return self.nonlin(self.norm(self.out(h) + x))


class PVConv(nn.Module):
    """Point-voxel convolution: voxel branch (centred grid, two 3^3 convolutions, attention or
    Swish, SE) read back at the points trilinearly, plus a per-point MLP. (features, coords, temb)
    in and out."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        resolution: int,
        attention: bool = False,
        dropout: float | None = 0.1,
        with_se: bool = False,
        with_se_relu: bool = False,
        normalize: bool = True,
        eps: float = 0,
    ) -> None:
        super().__init__()
        self.resolution, self.normalize, self.eps = int(resolution), normalize, eps
        pad = kernel_size // 2
        layers: list[nn.Module] = [
            nn.Conv3d(in_channels, out_channels, kernel_size, stride=1, padding=pad),
            nn.GroupNorm(num_groups=8, num_channels=out_channels),
            Swish(),
        ]
        layers += [nn.Dropout(dropout)] if dropout is not None else []
        layers += [
            nn.Conv3d(out_channels, out_channels, kernel_size, stride=1, padding=pad),
            nn.GroupNorm(num_groups=8, num_channels=out_channels),
            Attention(out_channels, 8) if attention else Swish(),
        ]
        if with_se:
            layers.append(SE3d(out_channels, use_relu=with_se_relu))
        self.voxel_layers = nn.Sequential(*layers)
        self.point_features = SharedMLP(in_channels, out_channels)

    def forward(self, inputs):
        features, coords, temb = inputs
        r = self.resolution
        grid_coords = ops.normalize_voxel_coords(coords, r, self.normalize, self.eps)
        voxels = self.voxel_layers(ops.avg_voxelize(features, grid_coords, r))
        fused = ops.trilinear_devoxelize(voxels, grid_coords, r) + self.point_features(features)
        return fused, coords, temb


class BallQuery(nn.Module):
    """Neighbourhoods of the centres: relative coordinates (+ features), and the grouped temb."""

    def __init__(self, radius: float, num_neighbors: int, include_coordinates: bool = True):
        super().__init__()
        self.radius, self.num_neighbors = radius, num_neighbors
        self.include_coordinates = include_coordinates

    def forward(self, points_coords, centers_coords, temb, points_features=None):
        index = ops.ball_query(centers_coords, points_coords, self.radius, self.num_neighbors)
        neighbors = ops.grouping(points_coords, index) - centers_coords.unsqueeze(-1)
        if points_features is not None:
            grouped = ops.grouping(points_features, index)
            neighbors = torch.cat([neighbors, grouped], 1) if self.include_coordinates else grouped
        return neighbors, ops.grouping(temb, index)


class PointNetSAModule(nn.Module):
    """Set abstraction: farthest-point centres, ball-query neighbourhoods, shared MLP, max-pool."""

    def __init__(
        self,
        num_centers,
        radius,
        num_neighbors,
        in_channels,
        out_channels,
        include_coordinates=True,
    ) -> None:
        super().__init__()
        extra = 3 if include_coordinates else 0
        self.num_centers = num_centers
        self.groupers = nn.ModuleList([BallQuery(radius, num_neighbors, include_coordinates)])
        self.mlps = nn.ModuleList([SharedMLP(in_channels + extra, out_channels, dim=2)])
        self.out_channels = out_channels[-1]

    def forward(self, inputs):
        features, coords, temb = inputs
        centers = ops.gather(coords, ops.furthest_point_sample(coords, self.num_centers))
        features, temb = self.mlps[0](self.groupers[0](coords, centers, temb, features))
        temb = temb.max(dim=-1).values if temb.shape[1] > 0 else temb
        return features.max(dim=-1).values, centers, temb


class PointNetFPModule(nn.Module):
    """Feature propagation: 3-NN interpolation to the finer points, skip features, shared MLP."""

    def __init__(self, in_channels: int, out_channels) -> None:
        super().__init__()
        self.mlp = SharedMLP(in_channels, out_channels, dim=1)

    def forward(self, inputs):
        points_coords, centers_coords, centers_features, points_features, temb = inputs
        # the original interpolates features and temb in two calls; one neighbour search serves both
        neighbors = ops.three_nearest_neighbors(points_coords, centers_coords)
        features = ops.interpolate(centers_features, *neighbors)
        temb = ops.interpolate(temb, *neighbors)
        features = torch.cat([features, points_features], dim=1)
        return self.mlp(features), points_coords, temb


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The original's sinusoidal embedding: sin | cos of t * 10000^(-i / (dim/2 - 1))."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, dtype=torch.float64) * -(math.log(10000) / (half - 1)))
    angles = t[:, None] * freqs.float().to(t.device)[None, :]
    emb = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    return nn.functional.pad(emb, (0, 1)) if dim % 2 else emb


class PVCNN2(nn.Module):
    """pcdiff's PVCNN2. forward(inputs (B, 3, N): skull points then implant points, t (B,)) ->
    (B, num_classes, N): the predicted noise (read on the implant points)."""

    def __init__(
        self,
        num_classes: int = 3,
        num_points: int = 30720,
        embed_dim: int = 64,
        use_att: bool = True,
        dropout: float = 0.1,
        head_dropout: float = 0.5,
        extra_feature_channels: int = 0,
        width_multiplier: float = 1.0,
        voxel_resolution_multiplier: float = 1.0,
        radius_multiplier: float = 1.0,
        num_neighbors: int = NUM_NEIGHBORS,
    ) -> None:
        super().__init__()
        r, vr = width_multiplier, voxel_resolution_multiplier
        self.embed_dim = embed_dim

        def pvconv(cin, cout, resolution, attention):
            return PVConv(
                cin, cout, 3, int(vr * resolution), attention=attention, dropout=dropout,
                with_se=not attention, with_se_relu=True,
            )  # fmt: skip

        # set abstraction (create_pointnet2_sa_components)
        in_channels = extra_feature_channels + 3
        sa_layers, sa_in_channels = [], []
        for c, (conv, (divisor, radius, mlp)) in enumerate(SA_BLOCKS):
            sa_in_channels.append(in_channels)
            blocks, built = [], 0
            if conv is not None:
                channels, num_blocks, resolution = conv
                channels = int(r * channels)
                for p in range(num_blocks):
                    attention = (c + 1) % 2 == 0 and c > 0 and use_att and p == 0
                    if c == 0:
                        blocks.append(pvconv(in_channels, channels, resolution, attention))
                    elif built == 0:  # the original builds only the first block after stage 0
                        blocks.append(
                            pvconv(in_channels + embed_dim, channels, resolution, attention)
                        )
                    in_channels = channels
                    built += 1
            blocks.append(
                PointNetSAModule(
                    num_centers=max(1, num_points // divisor),
                    radius=radius * radius_multiplier,
                    num_neighbors=num_neighbors,
                    in_channels=in_channels + (embed_dim if built == 0 else 0),
                    out_channels=[int(r * oc) for oc in mlp],
                )
            )
            in_channels = blocks[-1].out_channels
            sa_layers.append(blocks[0] if len(blocks) == 1 else nn.Sequential(*blocks))
        self.sa_layers = nn.ModuleList(sa_layers)
        self.global_att = Attention(in_channels, 8, D=1) if use_att else None

        # feature propagation (create_pointnet2_fp_modules): no attention, as the original's test
        sa_in_channels[0] = extra_feature_channels
        fp_layers = []
        for i, (mlp, (channels, num_blocks, resolution)) in enumerate(FP_BLOCKS):
            out = [int(r * oc) for oc in mlp]
            blocks = [PointNetFPModule(in_channels + sa_in_channels[-1 - i] + embed_dim, out)]
            in_channels = out[-1]
            for _ in range(num_blocks):
                blocks.append(pvconv(in_channels, int(r * channels), resolution, False))
                in_channels = int(r * channels)
            fp_layers.append(nn.Sequential(*blocks))
        self.fp_layers = nn.ModuleList(fp_layers)

        hidden = int(r * 128)  # create_mlp_components(out_channels=[128, 0.5, num_classes])
        self.classifier = nn.Sequential(
            SharedMLP(in_channels, hidden),
            nn.Dropout(head_dropout),
            nn.Conv1d(hidden, num_classes, 1),
        )
        self.embedf = nn.Sequential(
            nn.Linear(embed_dim, embed_dim),
            nn.LeakyReLU(0.1, inplace=True),
            nn.Linear(embed_dim, embed_dim),
        )

    def forward(self, inputs: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        temb = self.embedf(timestep_embedding(t, self.embed_dim))[:, :, None]
        temb = temb.expand(-1, -1, inputs.shape[-1])
        coords, features = inputs[:, :3, :].contiguous(), inputs
        coords_list, in_features_list = [], []
        for i, sa in enumerate(self.sa_layers):
            in_features_list.append(features)
            coords_list.append(coords)
            features = features if i == 0 else torch.cat([features, temb], dim=1)
            features, coords, temb = sa((features, coords, temb))
        in_features_list[0] = inputs[:, 3:, :].contiguous()
        if self.global_att is not None:
            features = self.global_att(features)
        for i, fp in enumerate(self.fp_layers):
            features, coords, temb = fp(
                (
                    coords_list[-1 - i],
                    coords,
                    torch.cat([features, temb], dim=1),
                    in_features_list[-1 - i],
                    temb,
                )
            )
        return self.classifier(features)


def predict_noise(
    model: nn.Module, skull: torch.Tensor, noisy: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    """The network's noise prediction on the implant points, (B, num_nn, 3), given the clean
    skull (B, S, 3) and the noised implant (B, num_nn, 3): the original's
    denoise_fn(cat([skull, noisy]), t)[:, :, sv_points:]."""
    inputs = torch.cat([skull, noisy], dim=1).transpose(1, 2)
    return model(inputs, t)[:, :, skull.shape[1] :].transpose(1, 2)
