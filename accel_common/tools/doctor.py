"""`accel-recipes doctor`: what to know about a machine before a distributed launch, in one report.

A failed launch costs a queue wait and usually says little: a port another job holds, an
NCCL_SOCKET_IFNAME copied from another cluster, a WORLD_SIZE left in the shell, a config asking for
8 GPUs on a node that shows 2. The doctor reads the machine, the environment and (optionally) the
accelerate config, names each blocker with what to do about it, and with `--check-comm` runs a real
all-reduce across local processes, so a broken or slow interconnect shows up before training does.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import platform
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any

import accelerate
import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from rich.console import Console
from rich.table import Table

from accel_common.batching import BatchRequest
from accel_common.errors import RecipeError
from accel_common.runtime import config_asks_for_gpus
from accel_common.tools.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "accelerate_configs"
DEFAULT_PORT = 29500
DEFAULT_ADDR = "127.0.0.1"
DEFAULT_PER_DEVICE_BS = 32
GPU_CONFIGS = {1: "1gpu.yaml", 2: "2gpu.yaml", 4: "4gpu.yaml", 8: "8gpu.yaml"}
CPU_CONFIG = "cpu_2proc.yaml"
EXIT_BLOCKER = 1
# spawned processes import torch before their process group exists; slow on a busy node
STARTUP_ALLOWANCE_S = 60.0
ENV_SHOWN = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "CUDA_VISIBLE_DEVICES",
    "NCCL_SOCKET_IFNAME",
    "NCCL_DEBUG",
    "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLE",
    "GLOO_SOCKET_IFNAME",
    "OMP_NUM_THREADS",
)
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "TORCH_DISTRIBUTED_", "ACCELERATE_")
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


class Backend(str, Enum):
    """`auto` is nccl when there are GPUs, else gloo (what Accelerate itself picks)."""

    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


@dataclass(frozen=True)
class Problem:
    """One finding: a `blocker` makes the launch fail (non-zero exit), a `warning` may."""

    severity: str
    message: str
    advice: str


@dataclass(frozen=True)
class DoctorOptions:
    """What to check; None means "derive it" (from the config, the environment, the devices)."""

    port: int | None = None
    addr: str | None = None
    config_file: Path | None = None
    # --bs / --per-device-bs (default: 32 per device)
    batch: BatchRequest = field(default_factory=BatchRequest)
    check_comm: bool = False
    backend: Backend = Backend.auto
    nproc: int | None = None
    sizes_mb: tuple[float, ...] = (1.0, 16.0, 64.0)
    iters: int = 10
    dist_timeout: float = 60.0


def versions(gpus: int) -> dict[str, str]:
    """Versions that decide which launches can work; NCCL counts only with a GPU to run on."""
    if not dist.is_nccl_available():
        nccl = "not available (torch built without NCCL)"
    else:
        shipped = ".".join(map(str, torch.cuda.nccl.version()))
        nccl = shipped if gpus else f"not available: no GPU visible (torch ships NCCL {shipped})"
    backends = [
        name
        for name, ok in (
            ("gloo", dist.is_gloo_available()),
            ("nccl", dist.is_nccl_available()),
            ("mpi", dist.is_mpi_available()),
        )
        if ok
    ]
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "cuda": torch.version.cuda or "not built (CPU-only torch)",
        "nccl": nccl,
        "distributed backends": ", ".join(backends) or "none",
    }


def devices() -> dict[str, Any]:
    """Visible accelerators: CUDA GPUs with name and memory, MPS, and CPU cores."""
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(
            {"index": index, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)}
        )
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cuda": gpus,
        "mps": torch.backends.mps.is_available(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
    }


def physical_nvidia_gpus() -> int | None:
    """GPUs the NVIDIA driver knows whatever CUDA_VISIBLE_DEVICES says (Linux; None elsewhere)."""
    root = Path("/proc/driver/nvidia/gpus")
    return len(list(root.iterdir())) if root.is_dir() else None


def interfaces() -> list[dict[str, Any]]:
    """Network interfaces by name with their IPv4 addresses, to choose *_SOCKET_IFNAME from."""
    addresses = psutil.net_if_addrs()
    return [
        {
            "name": name,
            "ipv4": [a.address for a in addresses.get(name, []) if a.family == socket.AF_INET],
        }
        for _, name in socket.if_nameindex()
    ]


def environment(env: dict[str, str]) -> dict[str, str | None]:
    """The launch-relevant variables (None = unset), plus any set NCCL_/GLOO_/ACCELERATE_ ones."""
    shown: dict[str, str | None] = {name: env.get(name) for name in ENV_SHOWN}
    shown.update({k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES)})
    return shown


def port_owner(port: int) -> str | None:
    """`pid N (name)` of the local listener on `port`, where the OS lets us see it."""
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
                if conn.pid is None:
                    return None
                return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
    except psutil.Error:
        return None
    return None


def check_port(addr: str, port: int) -> tuple[dict[str, Any], list[Problem]]:
    """Can the rendezvous store listen on `port` here, and is `addr` one of this machine's?

    torch's TCPStore listens on every address with SO_REUSEADDR, so the port is tried the same
    way: a socket in TIME_WAIT from a finished run is not "in use", a live listener anywhere is.
    """
    problems = []
    status: dict[str, Any] = {"addr": addr, "port": port, "free": True, "addr_is_local": True}
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as err:
            status["free"] = False
            if err.errno == errno.EACCES:
                problems.append(
                    Problem("blocker", f"port {port} needs root to bind", "use a port above 1024")
                )
            else:
                owner = port_owner(port)
                status["owner"] = owner
                problems.append(
                    Problem(
                        "blocker",
                        f"port {port} is in use ({owner or 'owner not visible to this user'}): "
                        "the master process cannot listen on it (`Address already in use`)",
                        f"pick another, e.g. --main_process_port {free_port()} (or MASTER_PORT); "
                        f"see who holds it with `ss -ltnp 'sport = :{port}'` or `lsof -i :{port}`",
                    )
                )
    try:
        with socket.socket() as sock:
            sock.bind((addr, 0))
    except OSError as err:  # socket.gaierror is an OSError too
        status["addr_is_local"] = False
        if isinstance(err, socket.gaierror):
            problems.append(
                Problem(
                    "blocker",
                    f"master address {addr!r} does not resolve",
                    "give the head node's IP address (see Network interfaces above)",
                )
            )
        else:
            problems.append(
                Problem(
                    "warning",
                    f"master address {addr} is not an address of this machine",
                    "fine on a worker node, which connects to it; on the head node (machine rank "
                    "0) MASTER_ADDR / --main_process_ip must be one of its own addresses",
                )
            )
    return status, problems


def check_interfaces(env: dict[str, str], names: list[str]) -> list[Problem]:
    """An *_SOCKET_IFNAME naming no interface here makes NCCL / Gloo fail at init or hang.

    NCCL reads a comma-separated list of name prefixes (`=` for exact names, `^` to exclude);
    Gloo reads comma-separated exact names.
    """
    problems = []
    nccl = env.get("NCCL_SOCKET_IFNAME", "").strip()
    if nccl and not nccl.startswith("^"):
        exact = nccl.startswith("=")
        wanted = [w.strip() for w in nccl.lstrip("=").split(",") if w.strip()]
        if not any(n == w if exact else n.startswith(w) for w in wanted for n in names):
            problems.append(
                Problem(
                    "blocker",
                    f"NCCL_SOCKET_IFNAME={nccl} matches no network interface on this machine "
                    f"(interfaces: {', '.join(names)})",
                    "set it to the interface that carries traffic between the nodes (often eth0, "
                    "ens*, ib0) or unset it to let NCCL choose",
                )
            )
    gloo = env.get("GLOO_SOCKET_IFNAME", "").strip()
    missing = [w.strip() for w in gloo.split(",") if w.strip() and w.strip() not in names]
    if missing:
        problems.append(
            Problem(
                "blocker",
                f"GLOO_SOCKET_IFNAME={gloo} names interface(s) that do not exist here: "
                f"{', '.join(missing)} (interfaces: {', '.join(names)})",
                "set it to an existing interface name or unset it",
            )
        )
    return problems


def check_environment(
    env: dict[str, str], gpus: int, physical: int | None, config_given: bool
) -> list[Problem]:
    """Hidden GPUs, and launcher variables left over in the shell."""
    problems = []
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and (visible.strip() in ("", "-1") or (physical or 0) > gpus):
        seen = f"shows {gpus} of this machine's {physical} GPUs" if physical else "hides every GPU"
        problems.append(
            Problem(
                "warning",
                f"CUDA_VISIBLE_DEVICES={visible!r} {seen}",
                "unset it to use them all: accelerate launch / torchrun give each process its "
                "own GPU, nothing needs to be hidden per process",
            )
        )
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        value = env.get(name)
        if value is not None and not value.strip().isdigit():
            problems.append(
                Problem("blocker", f"{name}={value!r} is not a number", f"fix or unset {name}")
            )
    world = env.get("WORLD_SIZE", "")
    if not config_given and world.isdigit() and int(world) > 1:
        problems.append(
            Problem(
                "warning",
                f"WORLD_SIZE={world} is set in this shell",
                "launchers set it for each process they start; left over in a shell it makes a "
                f"plain `python recipe.py` wait for {int(world) - 1} peers that never come: "
                "`unset WORLD_SIZE RANK LOCAL_RANK` unless a launcher set it",
            )
        )
    return problems


def yaml_error(err: yaml.YAMLError) -> str:
    """A YAML parse error on one line: where, what, and while doing what."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(err, "context", None)
    return f"not valid YAML{where}: {problem}" + (f" ({context})" if context else "")


def load_config(path: Path, flag: str = "--config-file") -> dict[str, Any]:
    """The accelerate config at `path`; a missing or malformed file is a user error (exit 2).
    `flag` is how the caller's user named it (`accelerate launch` spells it --config_file)."""
    if not path.is_file():
        shipped = ", ".join(sorted(p.name for p in CONFIG_DIR.glob("*.yaml")))
        raise RecipeError(
            f"{flag} {path}: no such file; the configs in {CONFIG_DIR.name}/ are: {shipped}"
        )
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise RecipeError(f"{flag} {path}: {yaml_error(err)}") from None
    except UnicodeDecodeError:
        raise RecipeError(f"{flag} {path}: not a text file, so not an accelerate config") from None
    if not isinstance(config, dict):
        raise RecipeError(f"{flag} {path}: not an accelerate config (no `key: value` lines)")
    return config


def missing_deepspeed(name: str) -> Problem | None:
    """A blocker when `name` (a config or a flag) asks for DeepSpeed and it is not installed."""
    if importlib.util.find_spec("deepspeed") is not None:
        return None
    return Problem(
        "blocker",
        f"{name} needs DeepSpeed, which is not installed",
        "`pip install deepspeed` on every GPU machine",
    )


def check_config(
    config: dict[str, Any], path: Path, env: dict[str, str], gpus: int, ipv4: list[str]
) -> tuple[dict[str, Any], list[Problem]]:
    """Does this config fit this machine and this environment?"""
    kind = str(config.get("distributed_type", "NO"))
    total = int(config.get("num_processes", 1))
    machines = int(config.get("num_machines", 1))
    use_cpu = bool(config.get("use_cpu", False))
    per_machine = total // machines
    summary = {
        "path": str(path),
        "distributed_type": kind,
        "num_processes": total,
        "num_machines": machines,
        "processes_per_machine": per_machine,
        "use_cpu": use_cpu,
        "mixed_precision": config.get("mixed_precision", "no"),
    }
    problems = []
    if total % machines:
        problems.append(
            Problem(
                "blocker",
                f"{path.name}: num_processes={total} is not a multiple of num_machines={machines}",
                "num_processes is the TOTAL over all machines: machines x processes per machine",
            )
        )
    world = env.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) != total:
        problems.append(
            Problem(
                "blocker",
                f"WORLD_SIZE={world} in the environment, but {path.name} starts num_processes="
                f"{total} in total ({machines} machine(s) x {per_machine})",
                "ranks then wait for peers that never join; unset WORLD_SIZE (launchers set it per "
                "process) or make every node's config and WORLD_SIZE agree: num_processes counts "
                "all machines together",
            )
        )
    wants_gpus = config_asks_for_gpus(config)  # what a recipe's workers refuse without GPUs
    hidden = env.get("CUDA_VISIBLE_DEVICES")
    hint = f" (CUDA_VISIBLE_DEVICES={hidden!r})" if hidden is not None else ""
    if wants_gpus and gpus == 0:
        problems.append(
            Problem(
                "blocker",
                f"{path.name} asks for {per_machine} GPU(s) per machine, but none is visible"
                + hint,
                f"on a CPU machine use accelerate_configs/{CPU_CONFIG}; otherwise check "
                "`nvidia-smi` and CUDA_VISIBLE_DEVICES",
            )
        )
    elif wants_gpus and per_machine > gpus:
        problems.append(
            Problem(
                "blocker",
                f"{path.name} starts {per_machine} processes per machine, but {gpus} GPU(s) are "
                "visible" + hint,
                f"pass --num_processes {gpus * machines} to accelerate launch, or use the "
                "recommended config below",
            )
        )
    if kind == "DEEPSPEED" and (missing := missing_deepspeed(path.name)) is not None:
        problems.append(missing)
    if config.get("mixed_precision") == "bf16" and gpus and not torch.cuda.is_bf16_supported():
        problems.append(
            Problem(
                "warning",
                f"{path.name} uses bf16, which these GPUs do not support",
                "add --mixed_precision fp16 to accelerate launch",
            )
        )
    head = str(config.get("main_process_ip", ""))
    if machines > 1 and head in ("", "127.0.0.1", "localhost"):
        problems.append(
            Problem(
                "warning",
                f"{path.name} is for {machines} machines but main_process_ip is "
                f"{head or 'unset'}, which other machines cannot reach",
                "pass --main_process_ip HEAD_NODE_IP on every node (this machine: "
                f"{', '.join(ipv4) or 'no IPv4 address'})",
            )
        )
    return summary, problems


def recommend(gpus: int, mps: bool, batch: BatchRequest) -> dict[str, Any]:
    """The shipped config for the devices seen, the launch line, and the batch plan for it."""
    if gpus:
        nearest = min(GPU_CONFIGS, key=lambda n: (abs(n - gpus), n))
        name, processes = GPU_CONFIGS[nearest], gpus
        override = f"--num_processes {gpus} " if nearest != gpus else ""
        reason = f"{gpus} GPU(s) visible" + (
            f"; no config for {gpus}, so {name} with --num_processes {gpus}" if override else ""
        )
    elif mps:
        name, processes, override = GPU_CONFIGS[1], 1, ""
        reason = "one Apple GPU (MPS): one process; DDP over MPS brings no speed-up"
    else:
        name, processes, override = CPU_CONFIG, 2, ""
        reason = "no GPU: 2 CPU processes over gloo run the distributed code path"
    if batch.global_batch_size is None and batch.per_device_batch_size is None:
        batch = replace(batch, per_device_batch_size=DEFAULT_PER_DEVICE_BS)
    plan = batch.plan(processes, warn_small=False)
    config = f"{CONFIG_DIR.name}/{name}"
    return {
        "config": config,
        "num_processes": processes,
        "reason": reason,
        "command": f"accelerate launch --config_file {config} {override}"
        f"recipes/train_template.py --bs {plan.global_batch_size}",
        "batch": plan.as_dict(),
        "batch_text": plan.describe(),
    }


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


def resolve_endpoint(
    opts: DoctorOptions, config: dict[str, Any] | None, env: dict[str, str]
) -> tuple[str, int, str]:
    """The master address and port a launch would use: flag, then config, then env, then default."""
    config = config or {}
    addr = opts.addr or config.get("main_process_ip") or env.get("MASTER_ADDR") or DEFAULT_ADDR
    candidates = (
        (opts.port, "--port"),
        (config.get("main_process_port"), "the config's main_process_port"),
        (env.get("MASTER_PORT", "").strip() or None, "MASTER_PORT"),
    )
    for value, source in candidates:
        if value is not None and str(value).isdigit():
            return str(addr), int(value), source
    return str(addr), DEFAULT_PORT, "default"


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


def collect(opts: DoctorOptions) -> dict[str, Any]:
    """Everything the report shows, as plain data (what --json prints)."""
    env = dict(os.environ)
    config = load_config(opts.config_file) if opts.config_file else None
    machine = devices()
    gpus = len(machine["cuda"])
    nics = interfaces()
    ipv4 = [a for nic in nics if nic["name"] != "lo" for a in nic["ipv4"]]
    addr, port, source = resolve_endpoint(opts, config, env)
    port_status, problems = check_port(addr, port)
    port_status["source"] = source
    problems += check_interfaces(env, [nic["name"] for nic in nics])
    problems += check_environment(env, gpus, physical_nvidia_gpus(), config is not None)
    report: dict[str, Any] = {
        "versions": versions(gpus),
        "devices": machine,
        "port": port_status,
        "interfaces": nics,
        "environment": environment(env),
        "recommendation": recommend(gpus, machine["mps"], opts.batch),
    }
    if config is not None and opts.config_file is not None:
        report["config"], found = check_config(config, opts.config_file, env, gpus, ipv4)
        problems += found
    if opts.check_comm:
        report["comm"], found = comm_section(opts, gpus)
        problems += found
    report["problems"] = [asdict(p) for p in problems]
    report["exit_code"] = EXIT_BLOCKER if any(p.severity == "blocker" for p in problems) else 0
    return report


def _table(title: str, rows: dict[str, Any]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows.items():
        table.add_row(key, "unset" if value is None else str(value))
    return table


def render(report: dict[str, Any], console: Console) -> None:
    """The report for people: one small table per topic, then the problems with their advice."""
    console.print(_table("Versions", report["versions"]))
    machine = report["devices"]
    gpus = [f"{g['index']}: {g['name']}, {g['memory_gib']} GiB" for g in machine["cuda"]]
    console.print(
        _table(
            "Devices",
            {
                "CUDA GPUs": "; ".join(gpus) if gpus else "none visible",
                "Apple MPS": "available" if machine["mps"] else "no",
                "CPU cores": f"{machine['cpu_cores_usable']} usable of {machine['cpu_cores']}",
            },
        )
    )
    port = report["port"]
    state = "free" if port["free"] else f"IN USE ({port.get('owner') or 'owner not visible'})"
    console.print(
        _table(
            "Master endpoint",
            {
                "address": port["addr"] + ("" if port["addr_is_local"] else " (not on this host)"),
                "port": f"{port['port']} ({port['source']}): {state}",
            },
        )
    )
    nics = {nic["name"]: ", ".join(nic["ipv4"]) or "-" for nic in report["interfaces"]}
    console.print(_table("Network interfaces (IPv4)", nics))
    console.print(_table("Environment", report["environment"]))
    if "config" in report:
        console.print(_table("Config file", report["config"]))
    rec = report["recommendation"]
    console.print(
        _table(
            "Recommended launch",
            {
                "config": rec["config"],
                "why": rec["reason"],
                "batch": rec["batch_text"],
                "command": rec["command"],
            },
        )
    )
    if "comm" in report:
        _render_comm(report["comm"], console)
    problems = report["problems"]
    if not problems:
        console.print("[green]No problems found.[/green]")
    for p in problems:
        colour = "red" if p["severity"] == "blocker" else "yellow"
        console.print(f"[{colour}]{p['severity']}:[/{colour}] {p['message']}\n  -> {p['advice']}")


def _render_comm(comm: dict[str, Any], console: Console) -> None:
    if not comm["ok"]:
        console.print(f"[red]all-reduce check failed:[/red] {comm['error']}")
        return
    table = Table(
        title=f"All-reduce, {comm['nproc']} processes over {comm['backend']} "
        f"(tiny all-reduce latency {comm['latency_us']:.0f} us)",
        title_justify="left",
    )
    for column in ("size", "time", "algbw", "busbw"):
        table.add_column(column, justify="right")
    for row in comm["sizes"]:
        table.add_row(
            f"{row['bytes'] / 2**20:g} MiB",
            f"{row['time_ms']:.2f} ms",
            f"{row['algbw_gbps']:.2f} GB/s",
            f"{row['busbw_gbps']:.2f} GB/s",
        )
    console.print(table)


def run_doctor(opts: DoctorOptions, console: Console, as_json: bool) -> int:
    """Collect, print (rich or JSON), and return the exit code: 1 when a blocker was found."""
    report = collect(opts)
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        render(report, console)
    return report["exit_code"]
