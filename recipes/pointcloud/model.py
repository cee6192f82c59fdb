"""The original's network, in plain PyTorch: a PVCNN-style point-voxel denoiser that predicts the
noise on the implant points, given them noised and the clean defective skull, with a sinusoidal
timestep embedding in every block."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of diffusion timesteps, as in DDPM."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000) * torch.arange(half, device=t.device) / (half - 1))
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def voxelize(features: torch.Tensor, coords: torch.Tensor, resolution: int) -> torch.Tensor:
    """Average point features into a resolution^3 grid (scatter-mean). coords in [-1, 1]."""
    batch, channels, _ = features.shape
    cells = ((coords + 1) / 2 * (resolution - 1)).round().long().clamp(0, resolution - 1)
    flat = (cells[..., 2] * resolution + cells[..., 1]) * resolution + cells[..., 0]  # z, y, x
    grid = features.new_zeros(batch, channels, resolution**3)
    grid.scatter_add_(2, flat[:, None].expand(-1, channels, -1), features)
    count = features.new_zeros(batch, 1, resolution**3)
    count.scatter_add_(2, flat[:, None], torch.ones_like(features[:, :1]))
    grid = grid / count.clamp(min=1)
    return grid.view(batch, channels, resolution, resolution, resolution)


def devoxelize(grid: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
    """Trilinear interpolation of grid features back at the points: (B, C, N)."""
    sampled = F.grid_sample(grid, coords[:, None, None], mode="bilinear", align_corners=True)
    return sampled[:, :, 0, 0]


class PointVoxelBlock(nn.Module):
    """Voxel branch (Conv3d, GroupNorm(8), Swish) + point MLP branch, with the timestep added."""

    def __init__(self, channels: int, resolution: int, temb_dim: int) -> None:
        super().__init__()
        self.resolution = resolution
        self.temb = nn.Linear(temb_dim, channels)
        self.voxel = nn.Sequential(
            nn.Conv3d(channels, channels, 3, padding=1),
            nn.GroupNorm(8, channels),
            nn.SiLU(),
            nn.Conv3d(channels, channels, 3, padding=1),
            nn.GroupNorm(8, channels),
            nn.SiLU(),
        )
        self.point = nn.Sequential(
            nn.Conv1d(channels, channels, 1), nn.GroupNorm(8, channels), nn.SiLU()
        )
        self.context = nn.Conv1d(2 * channels, channels, 1)  # global (max-pooled) context

    def forward(
        self, x: torch.Tensor, coords: torch.Tensor, temb: torch.Tensor, num_skull: int
    ) -> torch.Tensor:
        x = x + self.temb(temb)[:, :, None]
        # the grid holds the skull only: noised implant points scattered everywhere would fill
        # the very hole the implant points need to find; every point reads the grid back
        grid = voxelize(x[:, :, :num_skull], coords[:, :num_skull], self.resolution)
        voxel = devoxelize(self.voxel(grid), coords)
        fused = voxel + self.point(x)
        pooled = fused.max(dim=2, keepdim=True).values.expand_as(fused)
        return x + self.context(torch.cat([fused, pooled], dim=1))


class PointVoxelDenoiser(nn.Module):
    """Predicts the noise on the implant points, given them noised and the clean skull."""

    def __init__(self, width: int, depth: int, resolution: int, temb_dim: int = 64) -> None:
        super().__init__()
        self.temb_dim = temb_dim
        self.temb_mlp = nn.Sequential(
            nn.Linear(temb_dim, width), nn.SiLU(), nn.Linear(width, temb_dim)
        )
        self.stem = nn.Conv1d(4, width, 1)  # xyz + "is implant point" flag
        self.blocks = nn.ModuleList(
            PointVoxelBlock(width, resolution, temb_dim) for _ in range(depth)
        )
        self.head = nn.Sequential(nn.Conv1d(width, width, 1), nn.SiLU(), nn.Conv1d(width, 3, 1))

    def forward(self, skull: torch.Tensor, noisy: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        points = torch.cat([skull, noisy], dim=1)  # (B, N, 3)
        flag = torch.cat([torch.zeros_like(skull[..., :1]), torch.ones_like(noisy[..., :1])], 1)
        x = self.stem(torch.cat([points, flag], dim=2).transpose(1, 2))
        coords = (points / 4.0).clamp(-1, 1)  # normalised skulls span about [-3, 3]
        temb = self.temb_mlp(timestep_embedding(t, self.temb_dim))
        for block in self.blocks:
            x = block(x, coords, temb, skull.shape[1])
        return self.head(x)[:, :, skull.shape[1] :].transpose(1, 2)
