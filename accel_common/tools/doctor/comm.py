"""`--check-comm`: a real all-reduce across local processes, verified and timed, within a
deadline, so a broken or slow interconnect shows up before training does."""

from __future__ import annotations

import json
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from accel_common.errors import RecipeError
from accel_common.tools.doctor.base import Backend, DoctorOptions, Problem
from accel_common.tools.doctor.network import DEFAULT_ADDR
from accel_common.tools.ports import free_port

# spawned processes import torch before their process group exists; slow on a busy node
STARTUP_ALLOWANCE_S = 60.0


COMM_ADVICE = {
    "nccl": "rerun with NCCL_DEBUG=INFO to see the step that fails; check NCCL_SOCKET_IFNAME "
    "names an interface listed above; NCCL_IB_DISABLE=1 where there is no InfiniBand",
    "gloo": "rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL to see the step that fails; check "
    "GLOO_SOCKET_IFNAME names an interface listed above (or unset it)",
}


TIMEOUT_ADVICE = (
    "between nodes a firewall must let the master port (and NCCL's ports) through; a slow start "
    "needs a longer --dist-timeout, here and on the recipe"
)


def _time_all_reduce(tensor: torch.Tensor, iters: int) -> float:
    """Mean seconds per all-reduce on the slowest rank, after warm-up (connection set-up)."""
    sync = torch.cuda.synchronize if tensor.is_cuda else (lambda: None)
    for _ in range(2):
        dist.all_reduce(tensor)
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    sync()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=tensor.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item() / iters


def _comm_worker(
    rank: int,
    world: int,
    backend: str,
    port: int,
    sizes: list[int],
    iters: int,
    timeout_s: float,
    out: str,
) -> None:
    """One process of the all-reduce check: verify a sum, then time tiny and large all-reduces."""
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{DEFAULT_ADDR}:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        check = torch.full((8,), float(rank + 1), device=device)
        dist.all_reduce(check)
        expected = world * (world + 1) / 2
        if not bool((check == expected).all()):
            raise RuntimeError(f"all-reduce summed to {check[0].item()}, expected {expected}")
        latency = _time_all_reduce(torch.zeros(1, device=device), max(iters, 20))
        rows = []
        for nbytes in sizes:
            seconds = _time_all_reduce(torch.zeros(nbytes // 4, device=device), iters)
            algbw = nbytes / seconds / 1e9
            rows.append(
                {
                    "bytes": nbytes,
                    "time_ms": seconds * 1e3,
                    "algbw_gbps": algbw,
                    # nccl-tests' bus bandwidth: what each link carries in a ring all-reduce
                    "busbw_gbps": algbw * 2 * (world - 1) / world,
                }
            )
        if rank == 0:
            Path(out).write_text(json.dumps({"latency_us": latency * 1e6, "sizes": rows}))
    finally:
        dist.destroy_process_group()


def check_comm(
    backend: str, nproc: int, sizes_mb: tuple[float, ...], iters: int, timeout_s: float
) -> tuple[dict[str, Any], list[Problem]]:
    """Run the all-reduce check in `nproc` spawned processes on 127.0.0.1, within a deadline."""
    sizes = [max(4, int(mb * 2**20) // 4 * 4) for mb in sizes_mb]
    result: dict[str, Any] = {"backend": backend, "nproc": nproc, "ok": False}
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "comm.json"
        args = (nproc, backend, port, sizes, iters, timeout_s, str(out))
        context = mp.start_processes(_comm_worker, args=args, nprocs=nproc, join=False)
        deadline = time.monotonic() + STARTUP_ALLOWANCE_S + timeout_s
        try:
            while not context.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    for process in context.processes:
                        if process.is_alive():
                            process.kill()
                        process.join()
                    limit = STARTUP_ALLOWANCE_S + timeout_s
                    result["error"] = f"no result within {limit:.0f} s (timed out)"
                    break
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            lines = [line for line in str(err).splitlines() if line.strip()]
            result["error"] = lines[-1] if lines else type(err).__name__
            result["error_detail"] = str(err)
        if "error" not in result:
            result.update(json.loads(out.read_text()), ok=True)
            return result, []
    problem = Problem(
        "blocker",
        f"{nproc}-process {backend} all-reduce failed: {result['error']}",
        f"{COMM_ADVICE[backend]}; {TIMEOUT_ADVICE}",
    )
    return result, [problem]


def parse_sizes(text: str) -> tuple[float, ...]:
    """`--sizes-mb 1,16,64` as numbers; anything else is a user error."""
    try:
        sizes = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) <= 0:
        raise RecipeError(f"--sizes-mb {text!r}: give comma-separated positive sizes, e.g. 1,16,64")
    return sizes


def comm_section(opts: DoctorOptions, gpus: int) -> tuple[dict[str, Any], list[Problem]]:
    """Pick backend and process count for --check-comm, refuse what cannot run, else run it."""
    backend = opts.backend.value
    if opts.backend == Backend.auto:
        backend = "nccl" if gpus else "gloo"
    nproc = opts.nproc or (gpus or 2)
    if backend == "nccl" and nproc > gpus:
        skipped = {"backend": backend, "nproc": nproc, "ok": False, "error": "not run"}
        return skipped, [
            Problem(
                "blocker",
                f"--backend nccl with {nproc} processes needs {nproc} GPUs; {gpus} visible",
                "use --backend gloo on CPU, or --nproc up to the number of GPUs",
            )
        ]
    problems = []
    if nproc == 1:
        problems.append(
            Problem(
                "warning",
                "--check-comm with one process: nothing crosses a link, the all-reduce only "
                f"shows that {backend} initialises here",
                "use --nproc 2 or more (one per GPU for nccl)",
            )
        )
    result, failed = check_comm(backend, nproc, opts.sizes_mb, opts.iters, opts.dist_timeout)
    return result, problems + failed
