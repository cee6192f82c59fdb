"""The recipe's point ops (recipes/pointcloud/ops.py) against an implementation of the interface
of pcdiff's compiled CUDA backend (`_pvcnn_backend`, pcdiff/modules/functional/src/bindings.cpp):
forward and backward of each op on one random cloud.

Used on a GPU with the original's own kernels (tests/gpu/test_pointcloud_kernels_on_gpu.py), and
on the CPU with `ReferenceKernels`, brute-force transcriptions of those kernels, which checks this
harness itself (tests/recipes/pointcloud/test_ops.py).

Index results (farthest-point sampling, ball query, the 3 nearest neighbours) must be equal except
at float near-ties: the kernels are compiled with nvcc, which fuses a*a + b*b into fused
multiply-adds, so a squared distance may differ from ours in its last bit, and where two
candidates are that close the other one may be taken. Each difference is checked to be such a
tie (relative gap <= 1e-6 in float64), and counted. Float results are compared at the
kernels' indices within 1e-5 relative (the kernels' atomic adds sum in another order).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import numpy as np
import torch

from recipes.pointcloud import ops
from tests.reference import pointcloud_reference as ref

TIE = 1e-6  # relative gap of two float32 squared distances that a last-bit difference can flip
FLOAT_TOLERANCE = 1e-5  # relative to the largest magnitude: summation order only


def relative_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    scale = theirs.abs().max().clamp_min(1e-30)
    return ((ours.float() - theirs.float()).abs().max() / scale).item()


def squared_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(M, N) float64 squared distances of a (3, M) to b (3, N)."""
    return ((a.double()[:, :, None] - b.double()[:, None, :]) ** 2).sum(0)


def check_fps(coords: torch.Tensor, ours: torch.Tensor, theirs: torch.Tensor) -> int:
    """Samples of each cloud identical up to the first difference, which must be a tie: both
    points equally far (to TIE) from the samples chosen before it. Returns the fewest identical."""
    identical = ours.shape[1]
    for s in range(coords.shape[0]):
        differ = (ours[s] != theirs[s]).nonzero()
        if len(differ) == 0:
            continue
        j = int(differ[0])
        assert j > 0, (
            f"farthest-point sampling of cloud {s} starts at point {int(theirs[s, 0])} (kernel), "
            f"not {int(ours[s, 0])} (ours)"
        )
        nearest = torch.full(
            (coords.shape[2],), float("inf"), dtype=torch.float64, device=ours.device
        )
        for start in range(0, j, 1024):  # in chunks: (chosen x points) float64 at 30720 points
            chosen = coords[s][:, ours[s, start : min(start + 1024, j)]]
            nearest = torch.minimum(nearest, squared_distances(chosen, coords[s]).min(0).values)
        a, b = nearest[ours[s, j]].item(), nearest[theirs[s, j]].item()
        assert abs(a - b) <= TIE * max(a, b), (
            f"farthest-point sample {j} of cloud {s}: point {int(ours[s, j])} (ours, squared "
            f"distance {a}) against {int(theirs[s, j])} (kernel, {b}): not a float tie"
        )
        identical = min(identical, j)
    return identical


def check_ball_query(
    centers: torch.Tensor,
    points: torch.Tensor,
    radius: float,
    ours: torch.Tensor,
    theirs: torch.Tensor,
) -> int:
    """Neighbour lists equal, except for centres with a point on the sphere (to TIE), whose
    inside / outside a last bit decides. Returns how many lists differ."""
    rows = (ours != theirs).any(dim=2).nonzero().tolist()
    r2 = radius * radius
    for s, j in rows:
        d2 = squared_distances(centers[s][:, j : j + 1], points[s])[0]
        assert ((d2 - r2).abs() <= TIE * r2).any(), (
            f"ball query, centre {j} of cloud {s}: neighbours {ours[s, j].tolist()} (ours) against "
            f"{theirs[s, j].tolist()} (kernel), and no point on the sphere"
        )
    return len(rows)


def check_three_nn(
    points: torch.Tensor, centers: torch.Tensor, ours: torch.Tensor, theirs: torch.Tensor
) -> int:
    """The 3 nearest centres equal, except where ours and the kernel's are equally near (to
    TIE). Returns how many points differ."""
    rows = (ours != theirs).any(dim=1).nonzero().tolist()
    for s, i in rows:
        d2 = squared_distances(points[s][:, i : i + 1], centers[s])[0]
        a, b = d2[ours[s, :, i]].sort().values, d2[theirs[s, :, i]].sort().values
        assert ((a - b).abs() <= TIE * torch.maximum(a, b)).all(), (
            f"3 nearest centres of point {i} of cloud {s}: {ours[s, :, i].tolist()} (ours) against "
            f"{theirs[s, :, i].tolist()} (kernel), squared distances {a.tolist()} / {b.tolist()}"
        )
    return len(rows)


def compare_ops(
    kernels: Any,
    device: torch.device | str,
    *,
    batch: int,
    points: int,
    centers: int,
    radius: float,
    neighbors: int,
    resolution: int,
    channels: int,
    seed: int = 0,
) -> dict[str, float]:
    """Every op of the kernels' interface against ours on one random cloud (coordinates like a
    normalised skull's); returns what was measured. Raises AssertionError on a real difference."""
    g = torch.Generator().manual_seed(seed)
    coords = torch.randn(batch, 3, points, generator=g) * torch.tensor([1.0, 0.8, 0.6])[:, None]
    coords = coords.to(device).contiguous()
    features = torch.randn(batch, channels, points, generator=g).to(device)
    grad_points = torch.randn(batch, channels, points, generator=g).to(device)
    measured: dict[str, float] = {"points": points, "centers": centers}

    sampled = kernels.furthest_point_sampling(coords, centers).long()
    measured["fps_identical_samples"] = check_fps(
        coords, ops.furthest_point_sample(coords, centers), sampled
    )
    center_coords = ops.gather(coords, sampled).contiguous()

    neighbours = kernels.ball_query(center_coords, coords, radius, neighbors).long()
    measured["ball_query_lists_differing"] = check_ball_query(
        center_coords,
        coords,
        radius,
        ops.ball_query(center_coords, coords, radius, neighbors),
        neighbours,
    )
    mine = features.clone().requires_grad_()
    grouped = ops.grouping(mine, neighbours)
    assert torch.equal(grouped, kernels.grouping_forward(features, neighbours.int())), "grouping"
    grad_grouped = torch.randn(grouped.shape, generator=g).to(device)
    grouped.backward(grad_grouped)
    theirs = kernels.grouping_backward(grad_grouped, neighbours.int(), points)
    measured["grouping_backward"] = relative_difference(mine.grad, theirs)

    center_features = torch.randn(batch, channels, centers, generator=g).to(device)
    out, index, weights = kernels.three_nearest_neighbors_interpolate_forward(
        coords, center_coords, center_features
    )
    our_index, our_weights = ops.three_nearest_neighbors(coords, center_coords)
    measured["three_nn_points_differing"] = check_three_nn(
        coords, center_coords, our_index, index.long()
    )
    same = (our_index == index.long()).all(dim=1, keepdim=True)
    measured["three_nn_weights"] = relative_difference(our_weights * same, weights * same)
    mine = center_features.clone().requires_grad_()
    interpolated = ops.interpolate(mine, index.long(), weights)
    measured["three_nn_forward"] = relative_difference(interpolated, out)
    interpolated.backward(grad_points)
    theirs = kernels.three_nearest_neighbors_interpolate_backward(
        grad_points, index, weights, centers
    )
    measured["three_nn_backward"] = relative_difference(mine.grad, theirs)

    r = resolution
    grid_coords = ops.normalize_voxel_coords(coords, r)
    mine = features.clone().requires_grad_()
    voxels = ops.avg_voxelize(mine, grid_coords, r).view(batch, channels, r**3)
    out, voxel_index, counts = kernels.avg_voxelize_forward(
        features, torch.round(grid_coords).int(), r
    )
    measured["avg_voxelize_forward"] = relative_difference(voxels, out)
    grad_voxels = torch.randn(voxels.shape, generator=g).to(device)
    voxels.backward(grad_voxels)
    theirs = kernels.avg_voxelize_backward(grad_voxels, voxel_index, counts)
    measured["avg_voxelize_backward"] = relative_difference(mine.grad, theirs)

    grid = torch.randn(batch, channels, r, r, r, generator=g).to(device)
    mine = grid.clone().requires_grad_()
    devoxelized = ops.trilinear_devoxelize(mine, grid_coords, r)
    out, corners, corner_weights = kernels.trilinear_devoxelize_forward(
        r, True, grid_coords.contiguous(), grid.view(batch, channels, -1).contiguous()
    )
    measured["devoxelize_forward"] = relative_difference(devoxelized, out)
    devoxelized.backward(grad_points)
    theirs = kernels.trilinear_devoxelize_backward(grad_points, corners, corner_weights, r)
    measured["devoxelize_backward"] = relative_difference(
        mine.grad.view(batch, channels, -1), theirs
    )

    worst = max(v for k, v in measured.items() if k.endswith(("forward", "backward", "weights")))
    assert worst <= FLOAT_TOLERANCE, measured
    return measured


def load_pcdiff(source: str | None) -> tuple[ModuleType | None, str]:
    """pcdiff's modules.functional.backend with its compiled CUDA kernels installed, built by
    its own loader (modules/functional/backend.py: _load_cuda_backend), from `source` (its
    pcdiff/ folder, PCDIFF_SRC); or None and why not (no folder, no CUDA, no nvcc). Shared by
    the GPU suite (tests/gpu) and the GPU benchmark (benchmarks/gpu/)."""
    from torch.utils.cpp_extension import CUDA_HOME

    if not source or not (Path(source) / "modules" / "functional" / "src").is_dir():
        return None, "set PCDIFF_SRC to the original's pcdiff/ folder (pcdiff-implant @115a399)"
    if not torch.cuda.is_available():
        return None, "pcdiff's kernels need a CUDA GPU"
    if CUDA_HOME is None:
        return None, "the CUDA toolkit (nvcc) is needed to build the original's kernels"
    if source not in sys.path:
        sys.path.insert(0, source)
    import modules.functional.backend as backend

    if getattr(backend, "_backend_type", None) != "cuda":
        backend._real_backend, backend._backend_type = backend._load_cuda_backend(), "cuda"
    return backend, ""


def original_pvcnn2(config: dict) -> torch.nn.Module:
    """The original's PVCNN2 (train_completion.py, line 1059) at `config`'s sizes (the keys of
    tests/fixtures/pointcloud/pvcnn2_keys.json's config): its class attributes with the centres,
    radii and neighbours of config's points, as the fixtures were made
    (tests/fixtures/pointcloud/README.md). Needs load_pcdiff first (pcdiff on sys.path)."""
    from model.pvcnn_completion import PVCNN2Base

    n, k, rm = config["num_points"], config["num_neighbors"], config["radius_multiplier"]

    class OriginalPVCNN2(PVCNN2Base):
        sa_blocks: ClassVar[list] = [
            ((32, 2, 32), (n // 3, 0.1 * rm, k, (32, 64))),
            ((64, 3, 16), (n // 12, 0.2 * rm, k, (64, 128))),
            ((128, 3, 8), (n // 48, 0.4 * rm, k, (128, 256))),
            (None, (n // 192, 0.8 * rm, k, (256, 256, 512))),
        ]
        fp_blocks: ClassVar[list] = [
            ((256, 256), (256, 3, 8)),
            ((256, 256), (256, 3, 8)),
            ((256, 128), (128, 2, 16)),
            ((128, 128, 64), (64, 2, 32)),
        ]

    return OriginalPVCNN2(
        num_classes=3,
        sv_points=n - config["num_nn"],
        embed_dim=config["embed_dim"],
        use_att=config["use_att"],
        dropout=config["dropout"],
        extra_feature_channels=0,
        width_multiplier=config["width_multiplier"],
        voxel_resolution_multiplier=config["voxel_resolution_multiplier"],
    )


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


class ReferenceKernels:
    """The CUDA backend's interface on the brute-force transcriptions of its kernels
    (tests/reference/pointcloud_reference.py; backward passes as the kernels' scatters, in
    numpy). CPU, tiny clouds only."""

    @staticmethod
    def furthest_point_sampling(coords: torch.Tensor, m: int) -> torch.Tensor:
        return torch.from_numpy(ref.furthest_point_sample(_np(coords), m)).int()

    @staticmethod
    def ball_query(
        centers: torch.Tensor, points: torch.Tensor, radius: float, k: int
    ) -> torch.Tensor:
        return torch.from_numpy(ref.ball_query(_np(centers), _np(points), radius, k)).int()

    @staticmethod
    def gather_features_forward(features: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        f, i = _np(features), _np(indices).astype(np.int64)
        return torch.from_numpy(
            np.ascontiguousarray(np.stack([f[s][:, i[s]] for s in range(len(f))]))
        )

    @staticmethod
    def gather_features_backward(grad: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
        b, c = grad.shape[:2]
        out = np.zeros((b, c, n), dtype=np.float32)
        for s in range(b):
            np.add.at(out[s].T, _np(indices[s]).astype(np.int64), _np(grad[s]).T)
        return torch.from_numpy(out)

    @staticmethod
    def grouping_forward(features: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(ref.grouping(_np(features), _np(indices).astype(np.int64)))

    @staticmethod
    def grouping_backward(grad: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
        b, c = grad.shape[:2]
        out = np.zeros((b, c, n), dtype=np.float32)
        for s in range(b):
            np.add.at(out[s].T, _np(indices[s]).reshape(-1), _np(grad[s]).reshape(c, -1).T)
        return torch.from_numpy(out)

    @staticmethod
    def three_nearest_neighbors_interpolate_forward(
        points: torch.Tensor, centers: torch.Tensor, features: torch.Tensor
    ) -> list[torch.Tensor]:
        out, index, weights = ref.three_nn_interpolate(_np(points), _np(centers), _np(features))
        return [torch.from_numpy(out), torch.from_numpy(index).int(), torch.from_numpy(weights)]

    @staticmethod
    def three_nearest_neighbors_interpolate_backward(
        grad: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, m: int
    ) -> torch.Tensor:
        b, c = grad.shape[:2]
        out = np.zeros((b, c, m), dtype=np.float32)
        for s in range(b):
            for k in range(3):
                np.add.at(out[s].T, _np(indices[s, k]), (_np(grad[s]) * _np(weights[s, k])).T)
        return torch.from_numpy(out)

    @staticmethod
    def avg_voxelize_forward(
        features: torch.Tensor, voxels: torch.Tensor, r: int
    ) -> list[torch.Tensor]:
        b, c, _ = features.shape
        v = _np(voxels).astype(np.int64)
        index = (v[:, 0] * r + v[:, 1]) * r + v[:, 2]
        counts = np.stack([np.bincount(i, minlength=r**3) for i in index])
        out = ref.avg_voxelize(_np(features), v.astype(np.float32), r).reshape(b, c, r**3)
        return [
            torch.from_numpy(out),
            torch.from_numpy(index).int(),
            torch.from_numpy(counts).int(),
        ]

    @staticmethod
    def avg_voxelize_backward(
        grad: torch.Tensor, index: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        i, cnt = _np(index).astype(np.int64), _np(counts)
        g = _np(grad)
        out = [g[s][:, i[s]] / cnt[s][i[s]].astype(np.float32) for s in range(len(g))]
        return torch.from_numpy(np.stack(out).astype(np.float32))

    @staticmethod
    def trilinear_devoxelize_forward(
        r: int, training: bool, coords: torch.Tensor, features: torch.Tensor
    ) -> list[torch.Tensor]:
        b, c, _ = features.shape
        x = _np(coords)
        out = ref.trilinear_devoxelize(_np(features).reshape(b, c, r, r, r), x, r)
        lo = np.floor(x)
        d1 = (x - lo).astype(np.float32)
        upper = (d1 > 0) * np.array([r * r, r, 1])[None, :, None]
        base = (lo[:, 0] * r * r + lo[:, 1] * r + lo[:, 2]).astype(np.int64)
        corners, weights = [], []
        for corner in range(8):
            bits = ((corner >> 2) & 1, (corner >> 1) & 1, corner & 1)
            corners.append(base + sum(upper[:, a] for a in range(3) if bits[a]))
            w = np.ones_like(d1[:, 0])
            for a in range(3):
                w = (w * (d1[:, a] if bits[a] else np.float32(1.0) - d1[:, a])).astype(np.float32)
            weights.append(w)
        inds, wgts = np.stack(corners, axis=1), np.stack(weights, axis=1)
        return [torch.from_numpy(out), torch.from_numpy(inds).int(), torch.from_numpy(wgts)]

    @staticmethod
    def trilinear_devoxelize_backward(
        grad: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, r: int
    ) -> torch.Tensor:
        b, c = grad.shape[:2]
        out = np.zeros((b, c, r**3), dtype=np.float32)
        for s in range(b):
            for k in range(8):
                np.add.at(out[s].T, _np(indices[s, k]), (_np(grad[s]) * _np(weights[s, k])).T)
        return torch.from_numpy(out)
