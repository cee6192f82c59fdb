"""The network a launch needs: the master endpoint (address, port and who holds the port) and the
interfaces NCCL / Gloo are told to use."""

from __future__ import annotations

import errno
import socket
from typing import Any

import psutil

from accel_common.errors import RecipeError
from accel_common.tools.doctor.base import DoctorOptions, Problem
from accel_common.tools.ports import free_port

DEFAULT_PORT = 29500


DEFAULT_ADDR = "127.0.0.1"


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
        if value is None:
            continue
        if not str(value).isdigit() or not 1 <= int(value) <= 65535:
            shown = f"{source}={value}" if source == "MASTER_PORT" else f"{source} {value!r}"
            raise RecipeError(
                f"{shown} is not a port: give a whole number from 1 to 65535 (above "
                "1024 without root), or leave it unset for the default 29500"
            )
        return str(addr), int(value), source
    return str(addr), DEFAULT_PORT, "default"
