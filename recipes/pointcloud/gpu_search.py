"""Triton kernels for the search ops of recipes/pointcloud/ops.py: farthest-point sampling, ball
query and the 3-nearest-neighbour search, with the semantics ops.py pins (the original's CUDA
kernels'). ops.py calls them when `backend.use_triton` says so; only this module imports triton.

Why hand-written: no maintained package has the original's semantics (ops.py's header: which
point sampling starts from, the short-neighbourhood fill), and the plain-PyTorch ops launch
several kernels per sampled centre. Each op here is ONE kernel launch:

- farthest-point sampling: one program per sample, looping over the samples inside the kernel.
  Up to FPS_RESIDENT points a sample's coordinates and running distances stay in registers;
  above, the distances live in a (B, N) scratch buffer that the program sweeps in chunks of
  FPS_CHUNK points, keeping a running best per lane and reducing once per sample (the CUDA
  kernel's per-thread best, then one tree reduction). Ties go to the point with the smallest
  (k mod 512, k div 512), the CUDA kernel's 512-thread order: a max, then a min of that key
  over the points at the max.
- ball query: one program per (block of BQ_CENTERS centres, sample); it scans the points in
  index order in chunks, places each hit at its rank (running count + prefix sum) and stops
  once every centre of the block has K; then fills the short ones with their first point.
- 3-NN: one program per (block of NN_POINTS points, sample); it scans the centres in chunks,
  extracting each chunk's 3 smallest by (distance, index) and merging them into a running best 3,
  then computes the weights as ops.py (products in double, the rest in float, IEEE division).

Distances are dx*dx + dy*dy + dz*dz in float32, launched with enable_fp_fusion=False (LAUNCH) so
no multiply-add is fused: the same rounding as ops.py's torch path and the references. Inputs in
float16 / bfloat16 are read as float32 (exact), i.e. the result of the torch path on
`coords.float()`; the model feeds float32 (coordinates never pass through an autocast op).

The ops are torch.library.triton_op's, so Dynamo traces them as opaque ops, without a graph
break (tested on the CPU); Inductor running them compiled needs a GPU (unverified)."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from recipes.pointcloud.backend import launchable

# no fused multiply-add: distances round as dx*dx + dy*dy + dz*dz in ops.py and the references
LAUNCH = dict(enable_fp_fusion=False)
FPS_WARPS, BQ_WARPS, NN_WARPS = 16, 8, 8  # ptxas for sm_90: 103 / 40, 116, 127 registers
FPS_THREADS = 512  # the CUDA kernel's block size: its reduction order is the tie rule
FPS_RESIDENT = 8192  # points per sample up to which distances stay in registers
FPS_CHUNK = 2048  # points per sweep step above that (a multiple of FPS_THREADS)
BQ_CENTERS, BQ_POINTS, BQ_SLOTS = 32, 64, 32
NN_POINTS, NN_CENTERS = 32, 128
NO_INDEX = 2**31 - 1  # "no point yet": sorts after every index
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype not in INPUT_DTYPES:
            raise ValueError(f"{name}: the Triton kernels take float32/16/bf16, not {t.dtype}")
        if t.dim() != 3 or t.shape[1] != 3:
            raise ValueError(f"{name}: coordinates must be (B, 3, N), got {tuple(t.shape)}")


@triton.jit
def _fps_kernel(
    coords, scratch, out, n, m, stride_b, stride_c, stride_n, rows,
    BLOCK: tl.constexpr, RESIDENT: tl.constexpr, THREADS: tl.constexpr, NONE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    base = coords + b * stride_b
    dist_row = scratch + b * n
    lanes = tl.arange(0, BLOCK)
    tl.store(out + b * m, 0)  # the first sample is point 0
    last = tl.zeros((), tl.int32)
    if RESIDENT:
        valid = lanes < n
        x = tl.load(base + lanes * stride_n, mask=valid, other=0.0).to(tl.float32)
        y = tl.load(base + stride_c + lanes * stride_n, mask=valid, other=0.0).to(tl.float32)
        z = tl.load(base + 2 * stride_c + lanes * stride_n, mask=valid, other=0.0).to(tl.float32)
        key = (lanes % THREADS) * rows + lanes // THREADS
        dist = tl.where(valid, 1e38, -1.0)
        for j in range(1, m):
            lx = tl.load(base + last * stride_n).to(tl.float32)
            ly = tl.load(base + stride_c + last * stride_n).to(tl.float32)
            lz = tl.load(base + 2 * stride_c + last * stride_n).to(tl.float32)
            dx, dy, dz = x - lx, y - ly, z - lz
            dist = tl.minimum(dist, dx * dx + dy * dy + dz * dz)
            far = tl.max(dist, 0)
            best = tl.min(tl.where(dist == far, key, NONE), 0)  # the smallest key among ties
            last = (best % rows) * THREADS + best // rows
            tl.store(out + b * m + j, last.to(tl.int64))
    else:
        for start in range(0, n, BLOCK):
            k = start + lanes
            tl.store(dist_row + k, tl.full((BLOCK,), 1e38, tl.float32), mask=k < n)
        tl.debug_barrier()
        for j in range(1, m):
            lx = tl.load(base + last * stride_n).to(tl.float32)
            ly = tl.load(base + stride_c + last * stride_n).to(tl.float32)
            lz = tl.load(base + 2 * stride_c + last * stride_n).to(tl.float32)
            best = tl.full((BLOCK,), -1.0, tl.float32)
            best_key = tl.full((BLOCK,), NONE, tl.int32)
            for start in range(0, n, BLOCK):
                k = start + lanes
                valid = k < n
                x = tl.load(base + k * stride_n, mask=valid, other=0.0).to(tl.float32)
                y = tl.load(base + stride_c + k * stride_n, mask=valid, other=0.0).to(tl.float32)
                z = tl.load(base + 2 * stride_c + k * stride_n, mask=valid, other=0.0).to(
                    tl.float32
                )
                dx, dy, dz = x - lx, y - ly, z - lz
                dist = tl.load(dist_row + k, mask=valid, other=-1.0)
                dist = tl.minimum(dist, dx * dx + dy * dy + dz * dz)
                tl.store(dist_row + k, dist, mask=valid)
                # a lane's points share k mod 512 (BLOCK is a multiple of 512), so its earlier
                # chunk has the smaller key: strict > keeps it on a tie
                take = dist > best
                best = tl.where(take, dist, best)
                best_key = tl.where(take, (k % THREADS) * rows + k // THREADS, best_key)
            far = tl.max(best, 0)
            key = tl.min(tl.where(best == far, best_key, NONE), 0)
            last = (key % rows) * THREADS + key // rows
            tl.store(out + b * m + j, last.to(tl.int64))
            tl.debug_barrier()


@torch.library.triton_op("pointcloud::furthest_point_sample", mutates_args=())
def furthest_point_sample(coords: torch.Tensor, num_samples: int) -> torch.Tensor:
    """ops.furthest_point_sample in one launch."""
    _check("furthest_point_sample", coords)
    batch, _, n = coords.shape
    out = torch.empty(batch, num_samples, dtype=torch.long, device=coords.device)
    if out.numel() == 0:
        return out
    if n == 0:
        raise ValueError("furthest_point_sample: a cloud of 0 points has no samples")
    resident = n <= FPS_RESIDENT
    block = max(triton.next_power_of_2(n), 128) if resident else FPS_CHUNK
    scratch = torch.empty(
        (0,) if resident else (batch, n), dtype=torch.float32, device=coords.device
    )
    launchable(_fps_kernel)[(batch,)](
        coords, scratch, out, n, num_samples, *coords.stride(), n // FPS_THREADS + 1,
        BLOCK=block, RESIDENT=resident, THREADS=FPS_THREADS, NONE=NO_INDEX, num_warps=FPS_WARPS,
        **LAUNCH,
    )  # fmt: skip
    return out


@triton.jit
def _ball_query_kernel(
    centers, points, out, n, m, r2, K, c_sb, c_sc, c_sn, p_sb, p_sc, p_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < m
    c = centers + b * c_sb + rows * c_sn
    cx = tl.load(c, mask=row_ok, other=0.0).to(tl.float32)
    cy = tl.load(c + c_sc, mask=row_ok, other=0.0).to(tl.float32)
    cz = tl.load(c + 2 * c_sc, mask=row_ok, other=0.0).to(tl.float32)
    p = points + b * p_sb
    out_rows = out + (b * m + rows) * K
    count = tl.where(row_ok, 0, K)  # centres past the end count as full
    first = tl.zeros((BLOCK_M,), tl.int32)
    cols = tl.arange(0, BLOCK_N)
    start = tl.zeros((), tl.int32)
    while (start < n) & (tl.min(count, 0) < K):
        k = start + cols
        ok = k < n
        px = tl.load(p + k * p_sn, mask=ok, other=0.0).to(tl.float32)
        py = tl.load(p + p_sc + k * p_sn, mask=ok, other=0.0).to(tl.float32)
        pz = tl.load(p + 2 * p_sc + k * p_sn, mask=ok, other=0.0).to(tl.float32)
        dx = cx[:, None] - px[None, :]
        dy = cy[:, None] - py[None, :]
        dz = cz[:, None] - pz[None, :]
        hit = (dx * dx + dy * dy + dz * dz < r2) & ok[None, :] & row_ok[:, None]
        hits = hit.to(tl.int32)
        slot = count[:, None] + tl.cumsum(hits, 1) - 1  # rank among the centre's hits
        tl.store(out_rows[:, None] + slot, k[None, :].to(tl.int64), mask=hit & (slot < K))
        found = tl.sum(hits, 1)
        chunk_first = tl.min(tl.where(hit, k[None, :], n), 1)
        first = tl.where((count == 0) & (found > 0), chunk_first, first)
        count += found
        start += BLOCK_N
    value = tl.broadcast_to(first[:, None], (BLOCK_M, BLOCK_K)).to(tl.int64)
    for s in range(0, K, BLOCK_K):  # the short neighbourhoods' free slots: their first point
        slots = s + tl.arange(0, BLOCK_K)[None, :]
        fill = (slots >= count[:, None]) & (slots < K) & row_ok[:, None]
        tl.store(out_rows[:, None] + slots, value, mask=fill)


@torch.library.triton_op("pointcloud::ball_query", mutates_args=())
def ball_query(
    centers: torch.Tensor, points: torch.Tensor, radius: float, num_neighbors: int
) -> torch.Tensor:
    """ops.ball_query in one launch."""
    _check("ball_query", centers, points)
    batch, _, m = centers.shape
    out = torch.empty(batch, m, num_neighbors, dtype=torch.long, device=centers.device)
    if out.numel() == 0:
        return out
    if points.shape[2] == 0:
        raise ValueError("ball_query: a cloud of 0 points has no neighbours")
    r2 = float(np.float32(radius * radius))  # the kernel's float r2, as ops.py rounds it
    launchable(_ball_query_kernel)[(triton.cdiv(m, BQ_CENTERS), batch)](
        centers, points, out, points.shape[2], m, r2, num_neighbors,
        *centers.stride(), *points.stride(),
        BLOCK_M=BQ_CENTERS, BLOCK_N=BQ_POINTS, BLOCK_K=BQ_SLOTS, num_warps=BQ_WARPS, **LAUNCH,
    )  # fmt: skip
    return out


@triton.jit
def _insert(v, i, b0, i0, b1, i1, b2, i2):
    """(v, i) merged into the sorted best three, by (distance, index)."""
    before0 = (v < b0) | ((v == b0) & (i < i0))
    before1 = (v < b1) | ((v == b1) & (i < i1))
    before2 = (v < b2) | ((v == b2) & (i < i2))
    n2 = tl.where(before1, b1, tl.where(before2, v, b2))
    j2 = tl.where(before1, i1, tl.where(before2, i, i2))
    n1 = tl.where(before0, b0, tl.where(before1, v, b1))
    j1 = tl.where(before0, i0, tl.where(before1, i, i1))
    return tl.where(before0, v, b0), tl.where(before0, i, i0), n1, j1, n2, j2


@triton.jit
def _three_nn_kernel(
    points, centers, index, weights, n, m, p_sb, p_sc, p_sn, c_sb, c_sc, c_sn,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, NONE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    p = points + b * p_sb + rows * p_sn
    px = tl.load(p, mask=row_ok, other=0.0).to(tl.float32)
    py = tl.load(p + p_sc, mask=row_ok, other=0.0).to(tl.float32)
    pz = tl.load(p + 2 * p_sc, mask=row_ok, other=0.0).to(tl.float32)
    c = centers + b * c_sb
    inf = tl.full((BLOCK_N,), float("inf"), tl.float32)
    none = tl.full((BLOCK_N,), NONE, tl.int32)
    b0, i0, b1, i1, b2, i2 = inf, none, inf, none, inf, none
    for start in range(0, m, BLOCK_M):
        k = start + tl.arange(0, BLOCK_M)
        ok = k < m
        cx = tl.load(c + k * c_sn, mask=ok, other=0.0).to(tl.float32)
        cy = tl.load(c + c_sc + k * c_sn, mask=ok, other=0.0).to(tl.float32)
        cz = tl.load(c + 2 * c_sc + k * c_sn, mask=ok, other=0.0).to(tl.float32)
        dx = px[:, None] - cx[None, :]
        dy = py[:, None] - cy[None, :]
        dz = pz[:, None] - cz[None, :]
        d2 = tl.where(ok[None, :], dx * dx + dy * dy + dz * dz, float("inf"))
        ids = tl.broadcast_to(tl.where(ok, k, NONE)[None, :], (BLOCK_N, BLOCK_M))
        for _ in tl.static_range(3):  # the chunk's 3 nearest, merged into the best 3
            v = tl.min(d2, 1)
            i = tl.min(tl.where(d2 == v[:, None], ids, NONE), 1)  # the lowest index among ties
            b0, i0, b1, i1, b2, i2 = _insert(v, i, b0, i0, b1, i1, b2, i2)
            taken = ids == i[:, None]
            d2 = tl.where(taken, float("inf"), d2)
            ids = tl.where(taken, NONE, ids)
    # ops.py's weights: distances in double clamped to [1e-10, 1e10]; fewer than 3 centres: the
    # kernel's index 0 at distance 1e40, i.e. 1e10 once clamped
    lo = tl.full((BLOCK_N,), 1e-10, tl.float64)
    hi = tl.full((BLOCK_N,), 1e10, tl.float64)
    e0 = tl.where(i0 == NONE, hi, tl.minimum(tl.maximum(b0.to(tl.float64), lo), hi))
    e1 = tl.where(i1 == NONE, hi, tl.minimum(tl.maximum(b1.to(tl.float64), lo), hi))
    e2 = tl.where(i2 == NONE, hi, tl.minimum(tl.maximum(b2.to(tl.float64), lo), hi))
    d0d1, d0d2, d1d2 = (e0 * e1).to(tl.float32), (e0 * e2).to(tl.float32), (e1 * e2).to(tl.float32)
    inv = tl.math.div_rn(tl.full((BLOCK_N,), 1.0, tl.float32), d0d1 + d0d2 + d1d2)
    at = b * 3 * n + rows
    tl.store(index + at, tl.where(i0 == NONE, 0, i0).to(tl.int64), mask=row_ok)
    tl.store(index + at + n, tl.where(i1 == NONE, 0, i1).to(tl.int64), mask=row_ok)
    tl.store(index + at + 2 * n, tl.where(i2 == NONE, 0, i2).to(tl.int64), mask=row_ok)
    tl.store(weights + at, d1d2 * inv, mask=row_ok)
    tl.store(weights + at + n, d0d2 * inv, mask=row_ok)
    tl.store(weights + at + 2 * n, d0d1 * inv, mask=row_ok)


@torch.library.triton_op("pointcloud::three_nearest_neighbors", mutates_args=())
def three_nearest_neighbors(
    points: torch.Tensor, centers: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.three_nearest_neighbors in one launch: indices (B, 3, N) and weights (B, 3, N)."""
    _check("three_nearest_neighbors", points, centers)
    batch, _, n = points.shape
    index = torch.empty(batch, 3, n, dtype=torch.long, device=points.device)
    weights = torch.empty(batch, 3, n, dtype=torch.float32, device=points.device)
    if index.numel() == 0:
        return index, weights
    if centers.shape[2] == 0:
        raise ValueError("three_nearest_neighbors: no centres to interpolate from")
    launchable(_three_nn_kernel)[(triton.cdiv(n, NN_POINTS), batch)](
        points, centers, index, weights, n, centers.shape[2], *points.stride(), *centers.stride(),
        BLOCK_N=NN_POINTS, BLOCK_M=NN_CENTERS, NONE=NO_INDEX, num_warps=NN_WARPS, **LAUNCH,
    )  # fmt: skip
    return index, weights
