"""The doctor's report: every finding collected as plain data (what --json prints), shown as
tables for people, and the exit code (1 when a blocker was found)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table

from accel_common.tools.doctor.base import DoctorOptions
from accel_common.tools.doctor.comm import comm_section
from accel_common.tools.doctor.config import check_config, read_config, recommend
from accel_common.tools.doctor.machine import (
    check_environment,
    devices,
    environment,
    physical_nvidia_gpus,
    versions,
)
from accel_common.tools.doctor.network import (
    check_interfaces,
    check_port,
    interfaces,
    resolve_endpoint,
)

EXIT_BLOCKER = 1


def collect(opts: DoctorOptions) -> dict[str, Any]:
    """Everything the report shows, as plain data (what --json prints)."""
    env = dict(os.environ)
    config, problems = read_config(opts.config_file) if opts.config_file else (None, [])
    machine = devices()
    gpus = len(machine["cuda"])
    nics = interfaces()
    ipv4 = [a for nic in nics if nic["name"] != "lo" for a in nic["ipv4"]]
    addr, port, source = resolve_endpoint(opts, config, env)
    port_status, found = check_port(addr, port)
    problems += found
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
