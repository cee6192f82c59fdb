"""The point operations PVCNN2 is built from, in plain PyTorch (CPU and GPU), with the semantics of
the original's CUDA kernels (pcdiff/modules/functional/src/ at DimensionLab/pcdiff-implant
@115a399): which point farthest-point sampling starts from and how it breaks ties, how ball query
fills a neighbourhood with fewer than K points, the inverse-squared-distance weights of the
3-nearest-neighbour interpolation, and the rounding and clamping of the voxel grid.

Coordinates and features are channels-first as in the original: coords (B, 3, N), features
(B, C, N). Everything is vectorised over points; farthest-point sampling loops over its samples
(each depends on the previous one). Gradients come from autograd through gather / scatter_add,
which are the kernels' own backward passes (scatter of the weighted gradient).

Why not a package: torch_cluster's `fps` starts from a random point unless told otherwise and
takes flat batches, its `radius` returns neighbours in no guaranteed order; pytorch3d's
`ball_query` fills a short neighbourhood with -1 and its `sample_farthest_points` is a CPU/CUDA
extension that has no wheel for every platform the recipe runs on. None of them has the
original's short-neighbourhood fill, so the recipe keeps its own ~150 lines, tested against
brute-force references (tests/recipes/pointcloud/test_ops.py).

The original's pure-PyTorch fallback (modules/functional/cpu_backend.py) is NOT the reference
here: it starts sampling at a random point, sorts ball neighbours by distance and fills with the
last one, where the CUDA kernels, which the original trains with, do as below.
"""

from __future__ import annotations

import torch

from recipes.pointcloud import backend

# Pairwise-distance tensors are built in chunks of about this many elements, so the original's
# sizes (10240 centres x 30720 points per sample) stay within a few hundred MB.
CHUNK_ELEMENTS = 1 << 26


def _squared_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(B, M, N) squared distances of a (B, 3, M) to b (B, 3, N), summed in the kernels' order
    (dx*dx + dy*dy + dz*dz, differences first: no |a|^2 + |b|^2 - 2ab cancellation)."""
    d = a[:, :, :, None] - b[:, :, None, :]
    return d[:, 0] * d[:, 0] + d[:, 1] * d[:, 1] + d[:, 2] * d[:, 2]


def _scatter_kernels(tensor: torch.Tensor, *no_gradient: torch.Tensor) -> bool:
    """Whether a gather / scatter op runs gpu_scatter's Triton kernels: where backend.use_triton
    says so, except under torch's deterministic mode (`--deterministic`: the kernels scatter-add
    with atomics in arrival order, where torch's ops have deterministic kernels) and where an
    input the kernels give no gradient for (coordinates, weights) requires one."""
    return (
        backend.use_triton(tensor)
        and not torch.are_deterministic_algorithms_enabled()
        and not any(t.requires_grad for t in no_gradient)
    )


def _chunks(batch: int, rows: int, cols: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, batch * cols * 4))


def furthest_point_sample(coords: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Indices (B, M) of iterative farthest-point sampling, as the CUDA kernel: the first sample
    is point 0; each next one is the point farthest from those chosen (squared distance, starting
    at 1e38). Ties go where the kernel's 512-thread reduction sends them: to the point whose
    index k has the smallest (k mod 512, k div 512), found by a first-occurrence argmax over the
    points listed in that order."""
    if backend.use_triton(coords):
        from recipes.pointcloud import gpu_search

        return gpu_search.furthest_point_sample(coords, num_samples)
    return _furthest_point_sample(coords, num_samples)


# A custom op, so that --compile neither unrolls its loop over samples (10240 + 2560 + 640 + 160
# iterations at the original's size: minutes of tracing) nor breaks the graph around it: the
# compiled graph calls it as one opaque op. Its indices carry no gradient. (The Triton kernel
# is an op of its own: gpu_search.)
@torch.library.custom_op("pointcloud::furthest_point_sample_torch", mutates_args=())
def _furthest_point_sample(coords: torch.Tensor, num_samples: int) -> torch.Tensor:
    batch, _, n = coords.shape
    k = torch.arange(n, device=coords.device)
    order = torch.argsort((k % 512) * (n // 512 + 1) + k // 512)  # kernel's tie order
    points = coords[:, :, order]  # (B, 3, N) in that order
    distances = torch.full((batch, n), 1e38, dtype=coords.dtype, device=coords.device)
    chosen = torch.zeros(batch, num_samples, dtype=torch.long, device=coords.device)
    rows = torch.arange(batch, device=coords.device)
    last = torch.zeros(batch, dtype=torch.long, device=coords.device)  # point 0: position 0
    for j in range(1, num_samples):
        d = points - points[rows, :, last][:, :, None]
        d = d[:, 0] * d[:, 0] + d[:, 1] * d[:, 1] + d[:, 2] * d[:, 2]
        distances = torch.minimum(distances, d)
        last = distances.argmax(dim=1)
        chosen[:, j] = last
    return order[chosen]


@_furthest_point_sample.register_fake
def _(coords: torch.Tensor, num_samples: int) -> torch.Tensor:
    return coords.new_empty((coords.shape[0], num_samples), dtype=torch.long)


def gather(features: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """features (B, C, N) at indices (B, M): (B, C, M)."""
    return features.gather(2, indices[:, None, :].expand(-1, features.shape[1], -1))


def ball_query(
    centers: torch.Tensor, points: torch.Tensor, radius: float, num_neighbors: int
) -> torch.Tensor:
    """Indices (B, M, K) of the points within `radius` of each centre, as the CUDA kernel: the
    first K points in index order with squared distance < radius^2 (strict); a neighbourhood of
    fewer than K is filled with its first point; one with none is all 0."""
    if backend.use_triton(points):
        from recipes.pointcloud import gpu_search

        return gpu_search.ball_query(centers, points, radius, num_neighbors)
    batch, _, m = centers.shape
    n = points.shape[2]
    # the kernel's float r2, kept a tensor: .item() would break a compiled graph here
    r2 = torch.tensor(radius * radius, dtype=torch.float32, device=points.device)
    k = min(num_neighbors, n)
    out = []
    index = torch.arange(n, device=points.device)
    for start in range(0, m, _chunks(batch, m, n)):
        d2 = _squared_distances(centers[:, :, start : start + _chunks(batch, m, n)], points)
        # valid points keep their index, the others sort after every valid one
        key = torch.where(d2 < r2, index, n)
        first = key.topk(k, dim=2, largest=False, sorted=True).values  # first K valid, in order
        fill = torch.where(first[:, :, :1] < n, first[:, :, :1], 0)
        out.append(torch.where(first < n, first, fill))
    found = torch.cat(out, dim=1)
    if k < num_neighbors:  # fewer points than K: the rest is the first found too
        found = torch.cat([found, found[:, :, :1].expand(-1, -1, num_neighbors - k)], dim=2)
    return found


def grouping(features: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """features (B, C, N) at neighbour indices (B, M, K): (B, C, M, K)."""
    if _scatter_kernels(features):
        from recipes.pointcloud import gpu_scatter

        return gpu_scatter.grouping(features, indices)
    batch, m, k = indices.shape
    flat = indices.reshape(batch, 1, m * k).expand(-1, features.shape[1], -1)
    return features.gather(2, flat).view(batch, features.shape[1], m, k)


def three_nearest_neighbors(
    points: torch.Tensor, centers: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (B, 3, N) of each point's 3 nearest centres (ties to the lower index, as the
    kernel's strict <) and their weights: inverse squared distances (clamped to [1e-10, 1e10])
    normalised to sum 1, computed as the kernel does (products in double, the rest in float)."""
    if backend.use_triton(points):
        from recipes.pointcloud import gpu_search

        return gpu_search.three_nearest_neighbors(points, centers)
    batch, _, n = points.shape
    m = centers.shape[2]
    indices, dists = [], []
    for start in range(0, n, _chunks(batch, n, m)):
        d2 = _squared_distances(points[:, :, start : start + _chunks(batch, n, m)], centers)
        idx, best = [], []
        for _ in range(min(3, m)):  # first-occurrence argmin, three times: the kernel's order
            i = d2.argmin(dim=2, keepdim=True)
            idx.append(i)
            best.append(d2.gather(2, i))
            d2 = d2.scatter(2, i, float("inf"))
        while len(idx) < 3:  # fewer than 3 centres: the kernel's index 0 at distance 1e40
            idx.append(torch.zeros_like(idx[0]))
            best.append(torch.full_like(best[0], 1e40, dtype=torch.float64))
        indices.append(torch.cat(idx, dim=2))
        dists.append(torch.cat([b.double() for b in best], dim=2))
    index = torch.cat(indices, dim=1).transpose(1, 2)  # (B, 3, N)
    d = torch.cat(dists, dim=1).transpose(1, 2).clamp(1e-10, 1e10)
    d0d1, d0d2, d1d2 = (
        (d[:, 0] * d[:, 1]).float(),
        (d[:, 0] * d[:, 2]).float(),
        (d[:, 1] * d[:, 2]).float(),
    )
    inv = 1.0 / (d0d1 + d0d2 + d1d2)
    weights = torch.stack([d1d2 * inv, d0d2 * inv, d0d1 * inv], dim=1)
    return index, weights


def nearest_neighbor_interpolate(
    points: torch.Tensor, centers: torch.Tensor, center_features: torch.Tensor
) -> torch.Tensor:
    """Features (B, C, N) at the points, interpolated from their 3 nearest centres."""
    return interpolate(center_features, *three_nearest_neighbors(points, centers))


def interpolate(
    center_features: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """sum_i features[index_i] * weight_i, summed in the kernel's order."""
    if _scatter_kernels(center_features, weights):
        from recipes.pointcloud import gpu_scatter

        return gpu_scatter.interpolate(center_features, index, weights)
    f = [gather(center_features, index[:, i]) * weights[:, i, None] for i in range(3)]
    return f[0] + f[1] + f[2]


def normalize_voxel_coords(
    coords: torch.Tensor, resolution: int, normalize: bool = True, eps: float = 0.0
) -> torch.Tensor:
    """Each sample's points centred on their mean and scaled into the grid, as the original's
    Voxelization: divided by twice the largest distance from the mean (+ eps), shifted by 0.5,
    times the resolution, clamped to [0, R - 1]. Float grid coordinates (B, 3, N)."""
    coords = coords.detach()
    centred = coords - coords.mean(dim=2, keepdim=True)
    if normalize:
        radius = centred.norm(dim=1, keepdim=True).max(dim=2, keepdim=True).values
        centred = centred / (radius * 2.0 + eps) + 0.5
    else:
        centred = (centred + 1) / 2.0
    return torch.clamp(centred * resolution, 0, resolution - 1)


def avg_voxelize(
    features: torch.Tensor, grid_coords: torch.Tensor, resolution: int
) -> torch.Tensor:
    """Mean of the features of the points in each voxel: (B, C, R, R, R), voxel of a point at
    round(grid coordinate) (half to even, as torch.round), x-major (x * R^2 + y * R + z). As
    the kernel, each point adds its features times 1/count of its voxel."""
    if _scatter_kernels(features):
        from recipes.pointcloud import gpu_scatter

        return gpu_scatter.avg_voxelize(features, grid_coords, resolution)
    batch, channels, _ = features.shape
    r = resolution
    vox = torch.round(grid_coords).long()
    flat = (vox[:, 0] * r + vox[:, 1]) * r + vox[:, 2]  # (B, N)
    count = torch.zeros(batch, r**3, dtype=torch.float64, device=features.device)
    count.scatter_add_(1, flat, torch.ones_like(flat, dtype=torch.float64))
    inv = (1.0 / count.gather(1, flat)).to(features.dtype)  # (B, N): 1 / points in its voxel
    out = features.new_zeros(batch, channels, r**3)
    out.scatter_add_(2, flat[:, None].expand(-1, channels, -1), features * inv[:, None])
    return out.view(batch, channels, r, r, r)


def trilinear_devoxelize(
    grid: torch.Tensor, grid_coords: torch.Tensor, resolution: int
) -> torch.Tensor:
    """Grid features (B, C, R, R, R) trilinearly interpolated at float grid coordinates
    (B, 3, N) in [0, R - 1]: (B, C, N). As the kernel: the upper corner on an axis is the lower
    one + 1 only where the fraction is > 0, weights x * y * z, the 8 terms summed in its order."""
    if _scatter_kernels(grid, grid_coords):
        from recipes.pointcloud import gpu_scatter

        return gpu_scatter.trilinear_devoxelize(grid, grid_coords, resolution)
    batch, channels = grid.shape[:2]
    r = resolution
    flat_grid = grid.reshape(batch, channels, r**3)
    lo = torch.floor(grid_coords)
    frac1 = grid_coords - lo
    frac0 = 1.0 - frac1
    lo = lo.long()
    step = (frac1 > 0).long() * torch.tensor([r * r, r, 1], device=grid.device)[None, :, None]
    base = lo[:, 0] * r * r + lo[:, 1] * r + lo[:, 2]
    out = None
    for corner in range(8):  # 000, 001, 010, ..., 111 (x, y, z bits)
        bits = ((corner >> 2) & 1, (corner >> 1) & 1, corner & 1)
        index = base + sum(step[:, a] for a in range(3) if bits[a])
        w = [frac1[:, a] if bits[a] else frac0[:, a] for a in range(3)]
        term = gather(flat_grid, index) * (w[0] * w[1] * w[2])[:, None]
        out = term if out is None else out + term
    return out
