"""The GPU benchmark's record as a section of docs/BENCHMARKS.md: the issue's targets checked
(PASS / MISS / UNMEASURED and why), every training step with its ratios against the anchors of
the same run, and the point ops per backend.

Ratios are speed-ups, the anchor's ms/step over the row's (above 1: the row is faster): `vs
fp32` against the same network and mode in fp32, `vs eager` against the same step uncompiled,
`vs original` against pcdiff's network at the same precision and mode, `vs PyTorch ops` against
the recipe's network on its plain-PyTorch point ops (eager, same precision)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.gpu.point_ops import BACKENDS, OPS
from benchmarks.gpu.steps import ORIGINAL, PRECISIONS, RECIPE, TORCH_OPS, Step, precision_name

SECTION_START = "<!-- gpu benchmark: written by benchmarks/bench_gpu.py -->"
SECTION_END = "<!-- end of gpu benchmark -->"
ANCHORS = {  # ratio key -> what of a row is set to the anchor's value
    "vs_fp32": {"precision": "no"},
    "vs_eager": {"compiled": False},
    "vs_original": {"variant": ORIGINAL},
    "vs_torch_ops": {"variant": TORCH_OPS, "compiled": False},
}
Row = dict[str, Any]
NETWORKS = (RECIPE, TORCH_OPS, ORIGINAL)  # the order of one workload's rows in the table


def find(rows: list[Row], **key: Any) -> Row | None:
    return next((r for r in rows if all(r[k] == v for k, v in key.items())), None)


def add_ratios(rows: list[Row]) -> None:
    """Each row's speed-ups against its anchors in `rows`, where the anchor was measured and is
    another row."""
    for row in rows:
        for ratio, change in ANCHORS.items():
            key = {k: row[k] for k in ("workload", "variant", "precision", "compiled")} | change
            anchor = find(rows, **key)
            useful = anchor is not None and anchor is not row
            row[ratio] = anchor["ms_per_step"] / row["ms_per_step"] if useful else None


def targets(record: dict[str, Any]) -> list[dict[str, str]]:
    """The issue's targets on one GPU, each checked against this run's rows: PASS, MISS, or
    UNMEASURED with the reason a row is missing (skipped, failed, not in this run)."""
    rows, peak = record["steps"], record["matmul_tflops"]
    missing = record["skipped"] | record["failed"]
    checks = []

    def row(workload: str, precision: str, compiled: bool, variant: str = RECIPE) -> Row:
        found = find(rows, workload=workload, precision=precision, compiled=compiled,
                     variant=variant)  # fmt: skip
        if found is None:
            label = Step(workload, precision, compiled, variant).label
            raise LookupError(f"{label}: {missing.get(label, 'not in this run')}")
        return found

    def check(name: str, measure: Callable[[], tuple[float, str]], bound: float, low: bool):
        try:
            value, text = measure()
        except LookupError as error:
            checks.append({"target": name, "measured": "", "result": f"UNMEASURED ({error})"})
            return
        met = value <= bound if low else value >= bound
        checks.append({"target": name, "measured": text, "result": "PASS" if met else "MISS"})

    def versus_original(compiled: bool) -> tuple[float, str]:
        ours, theirs = (
            row("pointcloud", "no", compiled),
            row("pointcloud", "no", compiled, ORIGINAL),
        )
        ratio = ours["ms_per_step"] / theirs["ms_per_step"]
        return ratio, (
            f"{ours['ms_per_step']:.0f} ms against {theirs['ms_per_step']:.0f} ms "
            f"({ratio:.2f}x the original's time)"
        )

    def bf16_speedup(workload: str, compiled: bool) -> tuple[float, str]:
        fp32, bf16 = row(workload, "no", compiled), row(workload, "bf16", compiled)
        ratio = fp32["ms_per_step"] / bf16["ms_per_step"]
        return (
            ratio,
            f"{bf16['ms_per_step']:.1f} against {fp32['ms_per_step']:.1f} ms: {ratio:.2f}x",
        )

    def share_of_peak() -> tuple[float, str]:
        bf16 = row("captioning", "bf16", True)
        share = bf16["tflops"] / peak
        return share, f"{bf16['tflops']:.1f} of {peak:.0f} TFLOP/s: {100 * share:.0f}%"

    for compiled, mode in ((False, "eager"), (True, "compiled")):
        check(f"pointcloud fp32 step <= the original's ({mode})",
              lambda c=compiled: versus_original(c), 1.0, low=True)  # fmt: skip
        check(f"goal: pointcloud fp32 step <= half the original's ({mode})",
              lambda c=compiled: versus_original(c), 0.5, low=True)  # fmt: skip
        check(f"pointcloud bf16 >= 1.3x fp32 ({mode})",
              lambda c=compiled: bf16_speedup("pointcloud", c), 1.3, low=False)  # fmt: skip
    check("captioning compiled: bf16 >= 1.8x fp32",
          lambda: bf16_speedup("captioning", True), 1.8, low=False)  # fmt: skip
    check("captioning compiled bf16 >= 25% of the bf16 matmul peak", share_of_peak, 0.25, False)
    return checks


def _cell(value: float | None, form: str = "{:.2f}x") -> str:
    return "" if value is None else form.format(value)


def steps_table(rows: list[Row], peak: float) -> list[str]:
    lines = [
        "| workload | network | precision | mode | per-GPU batch | samples/s | ms/step | vs fp32 "
        "| vs eager | vs original | vs PyTorch ops | peak memory | estimate (fp32) | TFLOP/s "
        "| of the matmul peak | warm-up s |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: |",
    ]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))

    def order(r: Row) -> tuple:
        variant = NETWORKS.index(r["variant"])
        return (
            workloads.index(r["workload"]),
            variant,
            r["compiled"],
            PRECISIONS.index(r["precision"]),
        )

    for r in sorted(rows, key=order):
        estimate = r["estimate_gib"] if r["precision"] == "no" and not r["compiled"] else None
        lines.append(
            f"| {r['workload']} | {r['variant']} | {precision_name(r['precision'])} "
            f"| {'compiled' if r['compiled'] else 'eager'} | {r['batch']} "
            f"| {r['samples_per_s']:.1f} | {r['ms_per_step']:.1f} | {_cell(r['vs_fp32'])} "
            f"| {_cell(r['vs_eager'])} | {_cell(r['vs_original'])} | {_cell(r['vs_torch_ops'])} "
            f"| {_cell(r['peak_gib'], '{:.1f} GiB') or 'n/a'} | {_cell(estimate, '{:.1f} GiB')} "
            f"| {r['tflops']:.1f} | {100 * r['tflops'] / peak:.0f}% | {r['warmup_s']:.1f} |"
        )
    return lines


def op_totals(ops: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per op and backend: ms of its calls in one forward and in the backward (none for the
    ops without one), summed."""
    totals: dict[str, dict[str, dict[str, float]]] = {}
    for call in ops["calls"]:
        for backend in BACKENDS:
            timed = call.get(backend)
            if timed is None or "error" in timed:
                continue
            total = totals.setdefault(call["op"], {}).setdefault(backend, {"fwd": 0.0})
            total["fwd"] += call["calls"] * timed["forward_ms"]
            if timed["backward_ms"] is not None:
                total["bwd"] = total.get("bwd", 0.0) + call["calls"] * timed["backward_ms"]
    return totals


def ops_table(ops: dict[str, Any]) -> list[str]:
    totals = op_totals(ops)
    lines = [
        "| op | calls | PyTorch fwd | bwd | Triton fwd | bwd | pcdiff fwd | bwd | Triton vs "
        "PyTorch | Triton vs pcdiff |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for op in OPS:
        if op not in totals:
            continue
        t = totals[op]
        calls = sum(c["calls"] for c in ops["calls"] if c["op"] == op)
        cells = [
            f"{t[b]['fwd']:.2f} | {t[b]['bwd']:.2f}" if "bwd" in t.get(b, {}) else
            f"{t[b]['fwd']:.2f} | -" if b in t else " | "
            for b in BACKENDS
        ]  # fmt: skip

        speedups = [
            f"{sum(t[anchor].values()) / sum(t['triton'].values()):.2f}x"
            if "triton" in t and anchor in t
            else ""
            for anchor in ("torch", "pcdiff")
        ]
        lines.append(f"| {op} | {calls} | {' | '.join(cells)} | {' | '.join(speedups)} |")
    not_run = [f"{b}: {why}" for b, why in ops["backends"].items() if why]
    errors = [f"{c['op']} ({c['sizes']}) on {b}: {c[b]['error']}" for c in ops["calls"]
              for b in BACKENDS if "error" in c.get(b, {})]  # fmt: skip
    lines += [""] + [f"- not run: {line}" for line in not_run + errors] if not_run or errors else []
    return lines


def section(record: dict[str, Any], smoke_matmul: int) -> str:
    """The markdown section for docs/BENCHMARKS.md (with `smoke`, a check's record only)."""
    peak, device = record["matmul_tflops"], record["device"]
    when = f"{device}, {record['versions']}, {record['date']}"
    if record["smoke"]:
        intro = [
            "## GPU benchmark smoke run: small sizes, one step, not a measurement",
            "",
            f"Run on {when}, with `benchmarks/bench_gpu.py --smoke`; a {smoke_matmul}^3 bf16",
            f"matrix product ran at {peak:.2f} TFLOP/s.",
        ]
    else:
        intro = [
            "## GPU: training steps, point ops and the targets at the originals' sizes",
            "",
            f"Measured on {when}, with `make bench-gpu` (benchmarks/bench_gpu.py: one",
            "process, synthetic inputs of the original's shapes, each network and loss through",
            "Accelerate with AdamW; data loading left out). An 8192^3 bf16 matrix product ran at",
            f"**{peak:.0f} TFLOP/s** on this GPU in the same run. Ratios are speed-ups (the",
            "anchor's ms/step over the row's) against the same run's fp32, eager and original",
            "rows.",
        ]
    lines = [SECTION_START, *intro, "", "### Targets", "", "| target | measured | result |"]
    lines += ["| --- | --- | --- |"]
    lines += [f"| {t['target']} | {t['measured']} | {t['result']} |" for t in record["targets"]]
    lines += ["", "### Training steps", "", *steps_table(record["steps"], peak)]
    missing = [f"- skipped: {k}: {v}" for k, v in record["skipped"].items()]
    missing += [f"- failed: {k}: {v}" for k, v in record["failed"].items()]
    lines += ["", *missing] if missing else []
    if "ops" in record:
        lines += ["", "### Point ops: ms per PVCNN2 forward and backward, summed over its calls"]
        lines += ["", *ops_table(record["ops"])]
    lines += ["", SECTION_END]
    return "\n".join(lines)
