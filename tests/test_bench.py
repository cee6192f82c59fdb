"""Smoke test of the scaling benchmark's code paths at tiny sizes (no timing is asserted)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from accel_common.tools import bench

TINY = ("--hidden", "16", "--depth", "1")


def tiny(case: bench.Case) -> bench.Case:
    return replace(case, model="tiny MLP", per_device_bs=16, max_steps=8, log_every=2, args=TINY)


@pytest.mark.dist
def test_bench_writes_its_section_and_plot(tmp_path):
    """Reference loop and template recipe at 1 and 2 processes, table, section, plot."""
    cases = [tiny(case) for case in bench.CASES if case.data == "template"]
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n## Overhead\n\nkept as it was\n")
    plot = tmp_path / "scaling.png"

    text = bench.run_benchmark(out, plot, repeats=1, cpu=True, cases=cases)

    rows = [line for line in text.splitlines() if line.startswith(("| DDP", "| template"))]
    assert len(rows) == 2
    for row in rows:
        rates = [float(cell) for cell in row.split(" | ")[3:5]]
        assert all(rate > 0 for rate in rates)
    assert re.search(r"\| template .*\| (met|\*\*missed\*\*.*) \|$", rows[1])
    assert plot.read_bytes().startswith(b"\x89PNG")
    bench.write_section(out, text)  # a rerun replaces the section instead of adding another
    document = out.read_text()
    assert document.startswith("# Benchmarks\n\n## Overhead\n\nkept as it was\n")
    assert document.count(bench.SECTION_START) == 1


def test_independent_runs_are_a_ceiling_without_a_target():
    """N separate 1-process runs at once: their summed rate is shown, with no target to meet
    (the runs themselves are the template's 1-process runs, exercised above)."""
    template = tiny(next(case for case in bench.CASES if case.name == "template"))
    ceiling = replace(template, name="template, independent runs", independent=True)
    results = [bench.Result(case, {1: [10.0], 2: [19.0]}) for case in (template, ceiling)]
    rows = bench.table(results, [1, 2])[-2:]
    assert rows[0].startswith("| template |") and not rows[0].endswith("| - |")
    assert rows[1].startswith("| template, independent runs |") and rows[1].endswith("| - |")


def test_steady_rate_drops_the_warm_up_window(tmp_path):
    records = [{"config": {}}] + [{"step": s, "train/samples_per_s": r} for s, r in
                                  ((5, 10.0), (10, 100.0), (15, 50.0))]  # fmt: skip
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert bench.steady_rate(log) == pytest.approx(2 / (1 / 100 + 1 / 50))
    with pytest.raises(bench.RecipeError, match="throughput records"):
        bench.steady_rate(log, skip=3)
