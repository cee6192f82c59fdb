"""Brute-force references of the original's CUDA point ops (pcdiff/modules/functional/src/ at
DimensionLab/pcdiff-implant @115a399), written as the kernels are: plain Python loops over
points, one sample at a time, float32 numpy arithmetic. Slow; for tiny inputs in the tests of
recipes/pointcloud/ops.py, and independent of it (no shared code)."""

from __future__ import annotations

import numpy as np

f32 = np.float32


def furthest_point_sample(coords: np.ndarray, m: int) -> np.ndarray:
    """sampling.cu: start at 0, distances from 1e38, per-thread strict > over k = t, t + 512, ...,
    then a tree reduction that keeps the lower thread on ties (blockDim 512)."""
    b, _, n = coords.shape
    out = np.zeros((b, m), dtype=np.int64)
    for s in range(b):
        x, y, z = coords[s].astype(f32)
        dist = np.full(n, f32(1e38), dtype=f32)
        old = 0
        for j in range(1, m):
            best_per_thread = []
            for t in range(512):
                best, besti = f32(-1), 0
                for k in range(t, n, 512):
                    d = (x[k] - x[old]) * (x[k] - x[old]) + (y[k] - y[old]) * (y[k] - y[old])
                    d = f32(d + (z[k] - z[old]) * (z[k] - z[old]))
                    d2 = min(d, dist[k])
                    dist[k] = d2
                    if d2 > best:
                        best, besti = d2, k
                best_per_thread.append((best, besti))
            best, besti = best_per_thread[0]
            for value, index in best_per_thread[1:]:  # leftmost maximum wins
                if value > best:
                    best, besti = value, index
            old = besti
            out[s, j] = old
    return out


def ball_query(centers: np.ndarray, points: np.ndarray, radius: float, u: int) -> np.ndarray:
    """ball_query.cu: scan points in order, take those with d2 < r2 until u; on the first hit
    fill all u slots with it; none: zeros."""
    b, _, m = centers.shape
    n = points.shape[2]
    r2 = f32(f32(radius) * f32(radius))
    out = np.zeros((b, m, u), dtype=np.int64)
    for s in range(b):
        for j in range(m):
            cnt = 0
            for k in range(n):
                if cnt >= u:
                    break
                d = centers[s, :, j].astype(f32) - points[s, :, k].astype(f32)
                d2 = f32(d[0] * d[0] + d[1] * d[1] + d[2] * d[2])
                if d2 < r2:
                    if cnt == 0:
                        out[s, j, :] = k
                    out[s, j, cnt] = k
                    cnt += 1
    return out


def grouping(features: np.ndarray, indices: np.ndarray) -> np.ndarray:
    b, c, _ = features.shape
    _, m, u = indices.shape
    out = np.zeros((b, c, m, u), dtype=features.dtype)
    for s in range(b):
        for ch in range(c):
            for j in range(m):
                for k in range(u):
                    out[s, ch, j, k] = features[s, ch, indices[s, j, k]]
    return out


def three_nn_interpolate(points: np.ndarray, centers: np.ndarray, feats: np.ndarray):
    """neighbor_interpolate.cu: the 3 nearest by insertion with strict <, doubles clamped to
    [1e-10, 1e10], weights d1d2 / (d0d1 + d0d2 + d1d2) ... in float."""
    b, _, n = points.shape
    m = centers.shape[2]
    c = feats.shape[1]
    out = np.zeros((b, c, n), dtype=f32)
    idx_out = np.zeros((b, 3, n), dtype=np.int64)
    w_out = np.zeros((b, 3, n), dtype=f32)
    for s in range(b):
        for j in range(n):
            best = [1e40, 1e40, 1e40]
            besti = [0, 0, 0]
            for k in range(m):
                d = points[s, :, j].astype(f32) - centers[s, :, k].astype(f32)
                d = float(f32(d[0] * d[0] + d[1] * d[1] + d[2] * d[2]))
                if d < best[2]:
                    best[2], besti[2] = d, k
                    if d < best[1]:
                        best[2], besti[2] = best[1], besti[1]
                        best[1], besti[1] = d, k
                        if d < best[0]:
                            best[1], besti[1] = best[0], besti[0]
                            best[0], besti[0] = d, k
            bb = [max(min(1e10, v), 1e-10) for v in best]
            d0d1, d0d2, d1d2 = f32(bb[0] * bb[1]), f32(bb[0] * bb[2]), f32(bb[1] * bb[2])
            inv = f32(f32(1.0) / f32(d0d1 + d0d2 + d1d2))
            w = [f32(d1d2 * inv), f32(d0d2 * inv), f32(d0d1 * inv)]
            idx_out[s, :, j], w_out[s, :, j] = besti, w
            for ch in range(c):
                f = feats[s, ch]
                out[s, ch, j] = f32(
                    f32(f[besti[0]] * w[0]) + f32(f[besti[1]] * w[1]) + f32(f[besti[2]] * w[2])
                )
    return out, idx_out, w_out


def voxel_coords(coords: np.ndarray, r: int, eps: float = 0.0) -> np.ndarray:
    """Voxelization (modules/voxelization.py): centre on the mean, divide by twice the largest
    distance from it (+ eps), + 0.5, x r, clamp to [0, r - 1]."""
    out = np.zeros_like(coords, dtype=f32)
    for s in range(coords.shape[0]):
        c = coords[s].astype(f32)
        c = c - c.mean(axis=1, keepdims=True)
        c = c / (np.sqrt((c * c).sum(axis=0)).max() * 2 + eps) + 0.5
        out[s] = np.clip(c * r, 0, r - 1)
    return out


def avg_voxelize(features: np.ndarray, grid: np.ndarray, r: int) -> np.ndarray:
    """vox.cu: voxel x * r^2 + y * r + z of round(grid) (half to even); each point adds its
    features times float(1 / count) of its voxel, in float32 (here in point order)."""
    b, c, _ = features.shape
    out = np.zeros((b, c, r**3), dtype=f32)
    for s in range(b):
        index = [
            (int(np.round(x)) * r + int(np.round(y))) * r + int(np.round(z))
            for x, y, z in grid[s].T
        ]
        count = np.bincount(index, minlength=r**3)
        for i, v in enumerate(index):
            out[s, :, v] += features[s, :, i].astype(f32) * f32(1.0 / count[v])
    return out.reshape(b, c, r, r, r)


def trilinear_devoxelize(grid_features: np.ndarray, coords: np.ndarray, r: int) -> np.ndarray:
    """trilinear_devox.cu, in float32: lower corner floor(x), upper x + 1 only where the fraction
    is > 0; weight of corner (i, j, k) = wx_i * wy_j * wz_k; the 8 terms summed 000, 001, ...111."""
    b, c = grid_features.shape[:2]
    n = coords.shape[2]
    out = np.zeros((b, c, n), dtype=f32)
    for s in range(b):
        for i in range(n):
            x = coords[s, :, i].astype(f32)
            lo = np.floor(x)
            d1 = x - lo
            d0 = f32(1.0) - d1
            total = np.zeros(c, dtype=f32)
            for corner in range(8):
                bits = ((corner >> 2) & 1, (corner >> 1) & 1, corner & 1)
                w = f32(1.0)
                idx = []
                for a in range(3):
                    w = f32(w * (d1[a] if bits[a] else d0[a]))
                    idx.append(int(lo[a]) + (1 if bits[a] and d1[a] > 0 else 0))
                total = total + f32(w) * grid_features[s, :, idx[0], idx[1], idx[2]].astype(f32)
            out[s, :, i] = total
    return out


def fill_weights(state: dict) -> dict:
    """Deterministic weights for a state dict, as the fixtures of the original's network were
    made (tests/fixtures/pointcloud/README.md): each tensor from a generator seeded by crc32 of
    its key; matrices uniform in +-1/sqrt(fan_in), 1-d weights 1 + 0.1 N(0, 1), biases
    0.1 N(0, 1)."""
    import zlib

    import torch

    out = {}
    for key, value in state.items():
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        if value.dim() == 1:
            base = 1.0 if key.endswith("weight") else 0.0
            out[key] = base + 0.1 * torch.randn(value.shape, generator=g)
        else:
            bound = 1 / np.sqrt(value[0].numel())
            out[key] = (torch.rand(value.shape, generator=g) * 2 - 1) * bound
    return out
