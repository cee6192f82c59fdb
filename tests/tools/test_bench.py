"""Smoke test of the scaling benchmark's code paths at tiny sizes (no timing is asserted)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from accel_common.errors import RecipeError
from accel_common.tools.bench import measuring, reference, report
from accel_common.tools.example_data import make_data
from recipes import load_recipe
from tests.processes import REPO, recipe_env, run_processes

TINY = ("--hidden", "16", "--depth", "1")


def tiny(case: measuring.Case) -> measuring.Case:
    return replace(case, model="tiny MLP", per_device_bs=16, max_steps=8, log_every=2, args=TINY)


@pytest.mark.dist
def test_bench_writes_its_section_and_plot(tmp_path):
    """Reference loop and template recipe at 1 and 2 processes, table, section, plot."""
    cases = [tiny(case) for case in measuring.CASES if case.data == "template"]
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n## Overhead\n\nkept as it was\n")
    plot = tmp_path / "scaling.png"

    text = report.run_benchmark(out, plot, repeats=1, cpu=True, cases=cases)

    rows = [line for line in text.splitlines() if line.startswith(("| DDP", "| template"))]
    assert len(rows) == 2
    header = next(line for line in text.splitlines() if line.startswith("| run |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    for row in rows:
        cells = dict(zip(columns, (c.strip() for c in row.strip("|").split("|")), strict=True))
        assert float(cells["samples/s at 1"]) > 0 and float(cells["samples/s at 2"]) > 0
        assert cells["imbalance 2"] == "-"  # fixed-size items: nothing to balance, not logged
        # the all-reduce of both runs is timed: the least waiting process waits no longer
        least, most = (float(v) for v in cells["wait ms 2 [least, most]"].split(", "))
        assert 0 < least <= most < float(cells["step ms 2"])
    assert re.search(r"\| template .*\| (met|\*\*missed\*\*.*) \|$", rows[1])
    assert plot.read_bytes().startswith(b"\x89PNG")
    report.write_section(out, text)  # a rerun replaces the section instead of adding another
    document = out.read_text()
    assert document.startswith("# Benchmarks\n\n## Overhead\n\nkept as it was\n")
    assert document.count(report.SECTION_START) == 1


def test_independent_runs_are_a_ceiling_without_a_target():
    """N separate 1-process runs at once: their summed rate is shown, with no target to meet
    (the runs themselves are the template's 1-process runs, exercised above)."""
    template = tiny(next(case for case in measuring.CASES if case.name == "template"))
    ceiling = replace(template, name="template, independent runs", independent=True)
    results = [measuring.Result(case, {1: [10.0], 2: [19.0]}) for case in (template, ceiling)]
    rows = report.table(results, [1, 2])[-2:]
    assert rows[0].startswith("| template |") and not rows[0].endswith("| - |")
    assert rows[1].startswith("| template, independent runs |") and rows[1].endswith("| - |")


def test_the_table_shows_imbalance_and_waits_where_logged(tmp_path):
    """A launch's imbalance and waits come from its metrics log, first window dropped; the
    table shows the medians over repeats, and '-' where a run logged none."""
    records = [{"config": {"global_batch_size": 32}}]
    for step, (rate, imbalance, least, most) in enumerate(
        [(1.0, 9.0, 90.0, 99.0), (100.0, 1.02, 2.0, 6.0), (100.0, 1.04, 4.0, 10.0)]
    ):
        records.append({"step": step, "train/samples_per_s": rate})
        records.append(
            {"step": step, "train/rank_imbalance": imbalance, "train/sync_wait_ms_min": least,
             "train/sync_wait_ms_max": most}
        )  # fmt: skip
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    launch = measuring.read_launch(log)
    assert launch.rate == pytest.approx(100.0)
    assert launch.step_ms == pytest.approx(320.0)  # 32 samples at 100 samples/s
    assert launch.imbalance == pytest.approx(1.03)
    assert launch.wait_ms == pytest.approx((3.0, 8.0))
    case = tiny(next(case for case in measuring.CASES if case.name == "template"))
    result = measuring.Result(case, {1: [50.0], 2: [100.0]})
    result.launches = {1: [measuring.Launch(50.0)], 2: [launch]}
    assert report.table([result], [1, 2])[-1].endswith("| 1.030 | 320.0 | 3.0, 8.0 | met |")
    assert report.table([measuring.Result(case, {1: [50.0], 2: [100.0]})], [1, 2])[-1].endswith(
        "| - | - | - | met |"
    )


def test_steady_rate_drops_the_warm_up_window(tmp_path):
    records = [{"config": {}}] + [{"step": s, "train/samples_per_s": r} for s, r in
                                  ((5, 10.0), (10, 100.0), (15, 50.0))]  # fmt: skip
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert measuring.steady_rate(log) == pytest.approx(2 / (1 / 100 + 1 / 50))
    with pytest.raises(RecipeError, match="throughput records"):
        measuring.steady_rate(log, skip=3)


def test_the_reference_reads_the_template_data_and_builds_its_model(tmp_path):
    """The reference loop imports no recipe, so its reader and MLP are held here to the template
    recipe's: the same tensors from the same CSV, the same initial weights and outputs."""
    template = load_recipe("template")
    data = make_data("template", tmp_path / "data", train_size=64)
    ours, recipes = reference.read_train_split(data).tensors, template.load_split(data, "train")
    for mine, theirs in zip(ours, recipes.tensors, strict=True):
        assert torch.equal(mine, theirs)
    torch.manual_seed(0)
    mlp = reference.mlp(ours[0].shape[1], 16, 3)
    torch.manual_seed(0)
    regressor = template.MLPRegressor(ours[0].shape[1], 16, 3)
    for mine, theirs in zip(mlp.parameters(), regressor.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert torch.equal(mlp(ours[0]), regressor(ours[0]))


TIMED_RANK = """
import json, sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
sys.path.insert(0, {repo!r})
from accel_common.monitoring.sync_wait import SyncWaitTimer

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(8, 1))
timer = SyncWaitTimer()
for step in range(6):
    loss = model(torch.randn(4, 8)).square().mean()
    if rank == 1:
        time.sleep({late})  # the slow process: its gradients arrive this much later
    loss.backward()
    timer.backward_done()
    timer.attach(model)  # as TrainLoop: after the first backward, which is not timed
    timer.take_step()
with open({out!r} + str(rank), "w") as f:
    json.dump({{"attached": timer.attached, "waits": timer.waits}}, f)
dist.destroy_process_group()
"""


@pytest.mark.dist
def test_the_process_that_waits_for_a_slow_one_measures_the_wait(tmp_path):
    """Two processes, the second 0.3 s late to every all-reduce: the first measures about 0.3 s
    of waiting per step, the second (the slow one) only the communication."""
    late, script, out = 0.3, tmp_path / "rank.py", str(tmp_path / "waits")
    script.write_text(TIMED_RANK.format(repo=str(REPO), late=late, out=out))
    result = run_processes(script, [], 2, cwd=tmp_path, env=recipe_env(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr
    first, second = (json.loads(Path(out + str(rank)).read_text()) for rank in (0, 1))
    assert first["attached"] and second["attached"]
    assert len(first["waits"]) == len(second["waits"]) == 5  # the steps after the attaching one
    assert all(0.8 * late < wait < 3 * late for wait in first["waits"]), first
    assert all(wait < 0.5 * late for wait in second["waits"]), second
