"""recipes/pointcloud/ops.py against hand-worked cases and brute-force references of the
original's CUDA kernels (tests/reference/pointcloud_reference.py), on small inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recipes.pointcloud import ops
from tests.reference import pointcloud_reference as ref
from tests.reference.pointcloud_kernels import ReferenceKernels, compare_ops


def cloud(batch: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, 3, n, generator=torch.Generator().manual_seed(seed))


def test_farthest_point_sampling_starts_at_point_0_and_takes_the_farthest():
    # on a line: 0 first, then the far end (4), then the middle (2), then 1 (tie 1/3: lower k)
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    coords = torch.stack([x, torch.zeros_like(x), torch.zeros_like(x)], dim=1)
    assert ops.furthest_point_sample(coords, 4).tolist() == [[0, 4, 2, 1]]


def test_farthest_point_sampling_breaks_ties_as_the_kernels_512_threads():
    # 700 points near the origin, k = 100 (thread 100) and k = 600 (thread 88) tied farthest:
    # the kernel's reduction keeps the lower thread, so 600 first; a plain argmax would take 100
    coords = torch.zeros(1, 3, 700)
    coords[0, 0, :] = torch.linspace(0, 1, 700)
    coords[0, :, 100] = torch.tensor([0.0, 10.0, 0.0])
    coords[0, :, 600] = torch.tensor([0.0, -10.0, 0.0])
    chosen = ops.furthest_point_sample(coords, 3).tolist()[0]
    assert chosen == ref.furthest_point_sample(coords.numpy(), 3).tolist()[0] == [0, 600, 100]


def test_farthest_point_sampling_matches_the_kernel_on_random_clouds():
    coords = cloud(2, 700, seed=0)  # > 512 points: two per thread for some
    mine = ops.furthest_point_sample(coords, 12)
    assert mine.tolist() == ref.furthest_point_sample(coords.numpy(), 12).tolist()


def test_ball_query_takes_the_first_in_index_order_and_fills_with_the_first_found():
    # centre at 0; points 0.5 (in), 2 (out), 0.1 (in), 0.3 (in), radius 1, K = 5:
    # [0, 2, 3] in index order, the two short slots filled with the first found (0)
    x = torch.tensor([[0.5, 2.0, 0.1, 0.3]])
    points = torch.stack([x, torch.zeros_like(x), torch.zeros_like(x)], dim=1)
    centers = torch.zeros(1, 3, 2)
    centers[0, 0, 1] = 10.0  # nothing within 1 of it: all zeros, as the kernel's zeros
    got = ops.ball_query(centers, points, 1.0, 5).tolist()
    assert got == [[[0, 2, 3, 0, 0], [0, 0, 0, 0, 0]]]
    # K = 2 stops after the first two in index order (not the nearest two: 2 and 3)
    assert ops.ball_query(centers, points, 1.0, 2).tolist()[0][0] == [0, 2]
    # strict <: a point exactly at the radius is out
    assert ops.ball_query(centers, points, 0.5, 3).tolist()[0][0] == [2, 3, 2]


def test_ball_query_and_grouping_match_the_kernels_on_random_clouds():
    points, centers = cloud(2, 300, seed=1), cloud(2, 40, seed=2) * 0.5
    mine = ops.ball_query(centers, points, 0.8, 16)
    assert mine.tolist() == ref.ball_query(centers.numpy(), points.numpy(), 0.8, 16).tolist()
    features = cloud(2, 300, seed=3).repeat(1, 2, 1)  # 6 channels
    grouped = ops.grouping(features, mine)
    assert torch.equal(grouped, torch.from_numpy(ref.grouping(features.numpy(), mine.numpy())))


def test_three_nn_weights_are_normalised_inverse_squared_distances():
    # point at 0; centres at 1, 2, 3, 10 on a line: weights 1, 1/4, 1/9 normalised
    x = torch.tensor([[1.0, 10.0, 2.0, 3.0]])
    centers = torch.stack([x, torch.zeros_like(x), torch.zeros_like(x)], dim=1)
    points = torch.zeros(1, 3, 1)
    index, weights = ops.three_nearest_neighbors(points, centers)
    assert index[0, :, 0].tolist() == [0, 2, 3]
    expected = torch.tensor([1, 1 / 4, 1 / 9]) / (1 + 1 / 4 + 1 / 9)
    torch.testing.assert_close(weights[0, :, 0], expected, rtol=1e-6, atol=0)
    features = torch.tensor([[[1.0, 100.0, 2.0, 3.0]]])
    value = ops.nearest_neighbor_interpolate(points, centers, features)
    torch.testing.assert_close(value[0, 0, 0], (expected * torch.tensor([1.0, 2, 3])).sum())


def test_three_nn_interpolation_matches_the_kernel_on_random_clouds():
    points, centers = cloud(2, 50, seed=4), cloud(2, 20, seed=5)
    features = torch.randn(2, 4, 20, generator=torch.Generator().manual_seed(6))
    values, index, weights = ref.three_nn_interpolate(
        points.numpy(), centers.numpy(), features.numpy()
    )
    mine_index, mine_weights = ops.three_nearest_neighbors(points, centers)
    assert mine_index.tolist() == index.tolist()
    assert torch.equal(mine_weights, torch.from_numpy(weights))
    mine = ops.nearest_neighbor_interpolate(points, centers, features)
    assert torch.equal(mine, torch.from_numpy(values))


def test_voxelisation_centres_scales_and_averages_per_sample():
    # two points at -1 and +1 on x: centred, radius 1 -> grid x 0 and r - 1 (clamped 4 -> 3)
    coords = torch.tensor([[[-1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    grid = ops.normalize_voxel_coords(coords + 5.0, 4)  # a shift changes nothing
    mean_x = 1 / 3
    radius = ((1 + mean_x) ** 2) ** 0.5  # largest distance from the mean
    expected_x = ((coords[0, 0] - mean_x) / (2 * radius) + 0.5) * 4
    torch.testing.assert_close(grid[0, 0], expected_x.clamp(0, 3))
    torch.testing.assert_close(grid[0, 1], torch.full((3,), 2.0))
    features = torch.tensor([[[1.0, 2.0, 4.0]]])
    voxels = ops.avg_voxelize(features, grid, 4)
    # point 0 alone at x 0; points 1 and 2 share x 3: their mean, 3
    assert voxels[0, 0, 0, 2, 2] == 1.0 and voxels[0, 0, 3, 2, 2] == 3.0
    assert voxels.sum() == 4.0


def test_voxelisation_and_devoxelisation_match_the_kernels_on_random_clouds():
    coords = cloud(2, 200, seed=7)
    features = torch.randn(2, 5, 200, generator=torch.Generator().manual_seed(8))
    grid = ops.normalize_voxel_coords(coords, 6)
    np.testing.assert_allclose(grid.numpy(), ref.voxel_coords(coords.numpy(), 6), rtol=1e-6)
    voxels = ops.avg_voxelize(features, grid, 6)
    np.testing.assert_allclose(
        voxels.numpy(), ref.avg_voxelize(features.numpy(), grid.numpy(), 6), rtol=1e-5, atol=1e-6
    )
    back = ops.trilinear_devoxelize(voxels, grid, 6)
    np.testing.assert_allclose(
        back.numpy(),
        ref.trilinear_devoxelize(voxels.numpy(), grid.numpy(), 6),
        rtol=1e-5,
        atol=1e-6,
    )


def test_devoxelisation_at_a_grid_point_and_at_the_upper_edge_reads_that_voxel():
    grid = torch.arange(27.0).view(1, 1, 3, 3, 3)
    at = torch.tensor([[[1.0, 2.0, 0.5], [1.0, 2.0, 0.0], [1.0, 2.0, 0.0]]])  # (B, 3, N)
    out = ops.trilinear_devoxelize(grid, at, 3)[0, 0]
    # (1,1,1) -> 13; (2,2,2), the last voxel, -> 26; (0.5, 0, 0) -> mean of 0 and 9
    assert out.tolist() == [13.0, 26.0, 4.5]


def test_the_ops_carry_gradients_like_the_kernels_backward():
    coords = cloud(1, 30, seed=9)
    features = torch.randn(1, 2, 30, requires_grad=True)
    grid = ops.normalize_voxel_coords(coords, 4)
    out = ops.trilinear_devoxelize(ops.avg_voxelize(features, grid, 4), grid, 4)
    out.sum().backward()
    assert features.grad is not None and torch.isfinite(features.grad).all()
    centers = ops.gather(coords, ops.furthest_point_sample(coords, 5))
    center_features = torch.randn(1, 2, 5, requires_grad=True)
    ops.nearest_neighbor_interpolate(coords, centers, center_features).sum().backward()
    # every point spreads weight 1 over its 3 centres: the gradients sum to the point count
    torch.testing.assert_close(center_features.grad.sum(), torch.tensor(2 * 30.0))


TINY_CLOUD = dict(batch=2, points=96, centers=20, radius=0.9, neighbors=8, resolution=4, channels=3)


def test_every_op_forward_and_backward_matches_the_kernels_interface():
    """The harness the GPU suite runs against pcdiff's compiled kernels, here against their
    brute-force transcriptions: identical indices, floats within 1e-5, backward passes included
    (the kernels' own scatters, transcribed, against our autograd)."""
    measured = compare_ops(ReferenceKernels(), "cpu", **TINY_CLOUD)
    assert measured["fps_identical_samples"] == TINY_CLOUD["centers"]
    assert measured["ball_query_lists_differing"] == measured["three_nn_points_differing"] == 0


class FillWithLastNeighbour(ReferenceKernels):
    """The original's CPU fallback's ball query (cpu_backend.py), not its kernel's."""

    @staticmethod
    def ball_query(centers, points, radius, k):
        found = ReferenceKernels.ball_query(centers, points, radius, k).long()
        inside = ((centers[:, :, :, None] - points[:, :, None, :]) ** 2).sum(1) < radius**2
        count = inside.sum(2, keepdim=True).clamp(max=k)
        last = found.gather(2, (count - 1).clamp(min=0))
        return torch.where(torch.arange(k) < count, found, last).int()


class StartAtTheLastPoint(ReferenceKernels):
    @staticmethod
    def furthest_point_sampling(coords, m):
        flipped = ReferenceKernels.furthest_point_sampling(coords.flip(2), m)
        return coords.shape[2] - 1 - flipped


@pytest.mark.parametrize(
    "kernels, op", [(FillWithLastNeighbour, "ball query"), (StartAtTheLastPoint, "farthest-point")]
)
def test_the_harness_finds_another_semantics(kernels, op):
    with pytest.raises(AssertionError, match=op):
        compare_ops(kernels(), "cpu", **TINY_CLOUD)
