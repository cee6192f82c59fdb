"""`accel-recipes check NAME` proves a recipe's promises: the template holds them all, a fresh
`accel-recipes new` copy holds them outside the repository, and a broken copy fails the row of
the promise it breaks, with exit code 1. Its refusals are one line (exit 2). The suite's generic
tests find a new recipe as the check does, by its file."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.processes import REPO, TEMPLATE, recipe_env


def check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`accel-recipes check ARGS` as a process, its table wide enough for a row per line."""
    env = {**recipe_env(tmp_path), "COLUMNS": "250"}
    command = [sys.executable, "-m", "accel_common.tools.cli", "check", *args]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)


def rows(output: str) -> dict[str, list[str]]:
    """The table's rows by promise letter: [promise, result, measured, why], a cell's lines
    (its own and rich's wrapping) joined by spaces."""
    found: dict[str, list[str]] = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if len(cells) == 5 and len(cells[0]) == 1:
            found[cells[0]] = last = cells[1:]
        elif len(cells) == 5 and not cells[0] and found:  # the row above, continued
            last[:] = [" ".join(filter(None, pair)) for pair in zip(last, cells[1:], strict=True)]
    return found


def new_recipe(tmp_path: Path, name: str) -> Path:
    from accel_common.tools.cli import app

    result = CliRunner().invoke(app, ["new", name, "--dest", str(tmp_path)])
    assert result.exit_code == 0, result.output
    return tmp_path / f"train_{name}.py"


@pytest.mark.slow
def test_the_template_holds_every_promise(tmp_path):
    result = check(tmp_path, "template")
    assert result.returncode == 0, result.stdout + result.stderr
    found = rows(result.stdout)
    assert sorted(found) == list("abcdefgh")
    assert all(row[1] == "held" for row in found.values()), found
    assert "check template: 2 processes = 1 ..." in result.stdout


@pytest.mark.slow
def test_a_new_recipe_outside_the_repository_holds_its_promises(tmp_path):
    """`accel-recipes new` then `check PATH`: found by its file (a relative path, as the porting
    guide gives it), its example written by its own generator, its command the template's; the
    promises that depend on the copied code."""
    script = new_recipe(tmp_path, "mymodel")
    # named relative to where the check starts (the runs start in folders of their own)
    result = check(tmp_path, script.name, "--only", "c,d,e")
    assert result.returncode == 0, result.stdout + result.stderr
    found = rows(result.stdout)
    assert sorted(found) == ["c", "d", "e"]
    assert all(row[1] == "held" for row in found.values()), found
    assert "accel-recipes check mymodel" in result.stdout


@pytest.mark.slow
def test_a_recipe_that_reads_an_undeclared_file_fails_that_row(tmp_path):
    script = new_recipe(tmp_path, "broken")
    text = script.read_text()
    declared = 'named_files([data_dir / "train.csv", data_dir / "test.csv"], data_dir)'
    assert declared in text
    script.write_text(text.replace(declared, 'named_files([data_dir / "train.csv"], data_dir)'))
    result = check(tmp_path, str(script), "--only", "d")
    assert result.returncode == 1, result.stdout + result.stderr
    row = rows(result.stdout)["d"]
    assert row[1:] == ["not held", "2 opened, 1 declared", "read, not declared: test.csv"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["template", "--only", "a,z"], "error: --only a,z: give letters among a,b,c,d,e,f,g,h"),
        (["nosuch"], "error: NAME nosuch: no such recipe or file; give a recipe ("),
    ],
)
def test_a_bad_name_or_promise_is_one_line(args, message):
    from accel_common.tools.cli import app

    result = CliRunner().invoke(app, ["check", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(message), result.stderr


def waiving(tmp_path: Path, declaration: str) -> Path:
    """A copy of the template that ends with `declaration` (CHECK_WAIVE, CHECK_NOISE)."""
    script = tmp_path / "train_waiving.py"
    script.write_text(TEMPLATE.read_text() + f"\n{declaration}\n")
    return script


WHY = "neighbour sampling: a seed's subgraph depends on the other seeds of its batch"


def test_a_waived_row_shows_its_reason_is_not_run_and_the_rest_are(tmp_path, monkeypatch, capsys):
    from rich.console import Console

    from accel_common.tools.check import runner
    from accel_common.tools.check.promises import Outcome

    def never(session) -> None:
        raise AssertionError("a waived promise was run")

    ran = []
    promises = {
        "a": ("2 processes = 1", never),
        "c": ("--dry-run = the run", lambda session: ran.append("c") or Outcome("held", "ok")),
    }
    monkeypatch.setattr(runner, "PROMISES", promises)
    script = waiving(tmp_path, f"CHECK_WAIVE = {{'a': {WHY!r}}}")
    assert runner.run_check(str(script), None, Console(width=250)) == 0
    out = capsys.readouterr().out
    assert ran == ["c"] and "check template: 2 processes = 1 ..." not in out
    assert rows(out)["a"] == ["2 processes = 1", "waived", "", WHY]
    assert out.splitlines()[-1] == "accel-recipes check template: 1 held, 1 waived (a)"


def test_the_summary_line_counts_each_result_and_names_all_but_the_held():
    from accel_common.tools.check.promises import Outcome
    from accel_common.tools.check.runner import summary

    results = dict.fromkeys("bcdfh", "held") | {"a": "waived", "e": "skipped", "g": "not held"}
    outcomes = {letter: Outcome(results[letter]) for letter in sorted(results)}
    assert summary(outcomes) == "5 held, 1 not held (g), 1 waived (a), 1 skipped (e)"
    assert summary({k: v for k, v in outcomes.items() if k != "g"}).startswith("5 held, 1 waiv")


@pytest.mark.slow
def test_a_recipe_that_waives_row_a_passes_with_the_reason_shown(tmp_path):
    script = waiving(tmp_path, f"CHECK_WAIVE = {{'a': {WHY!r}}}")
    result = check(tmp_path, str(script), "--only", "a,c")
    assert result.returncode == 0, result.stdout + result.stderr
    found = rows(result.stdout)
    assert found["a"] == ["2 processes = 1", "waived", "", WHY]
    assert found["c"][1] == "held"
    assert "accel-recipes check template: 1 held, 1 waived (a)" in result.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("declaration", "message"),
    [
        ("CHECK_WAIVE = {'a': ''}", "row 'a' has no reason; say why it cannot hold"),
        ("CHECK_WAIVE = {'a': '  '}", "row 'a' has no reason; say why it cannot hold"),
        ("CHECK_WAIVE = {'z': 'why'}", "'z' is no row; give letters among a,b,c,d,e,f,g,h"),
        ("CHECK_WAIVE = ['a']", 'give a dict of row to reason, e.g. {"a": "why"}'),
        ("CHECK_NOISE = 'to_k.bias'", 'give a tuple of name endings, e.g. CHECK_NOISE = ("to_k'),
        ("CHECK_NOISE = ('',)", 'give a tuple of name endings, e.g. CHECK_NOISE = ("to_k'),
    ],
    ids=["empty", "blank", "unknown-row", "not-a-dict", "noise-string", "noise-empty"],
)
def test_a_malformed_waiver_or_noise_declaration_is_one_line(tmp_path, declaration, message):
    """Refused before any run, naming the declaration and the recipe's file."""
    from accel_common.tools.cli import app

    script = waiving(tmp_path, declaration)
    result = CliRunner().invoke(app, ["check", str(script), "--only", "c"])
    assert result.exit_code == 2, result.output
    name = declaration.split(" = ")[0]
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(
        f"error: {name} in {script}: {message}"
    ), result.stderr


def test_the_template_shows_a_new_recipe_what_to_declare():
    """What `accel-recipes new` copies declares what the check and the tests run it with."""
    text = TEMPLATE.read_text()
    for name in ("CHECK_ARGS", "CHECK_DATA", "CHECK_COMMAND", "CHECK_RESUME"):
        assert f"\n{name} = " in text, name


def test_a_new_recipe_joins_the_generic_tests_with_no_test_edited(tmp_path):
    """`accel-recipes new mymodel` in a copy of the project: collecting the kill-and-resume, the
    FSDP and the GPU suite's recipe tests gives a case of the copy, named by its file, beside the
    project's recipes."""
    copy = tmp_path / "project"
    junk = shutil.ignore_patterns("__pycache__", "fixtures")
    for part in ("accel_common", "recipes", "tests"):
        shutil.copytree(REPO / part, copy / part, ignore=junk)
    shutil.copy(REPO / "pyproject.toml", copy)
    new_recipe(copy / "recipes", "mymodel")
    tests = [
        "tests/training/test_resume.py",
        "tests/hardware/test_sharded.py",
        "tests/gpu/test_recipes_on_gpu.py",
    ]
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    env = {**recipe_env(tmp_path), "PYTHONPATH": str(copy)}
    result = subprocess.run(
        [*command, *tests], cwd=copy, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    cases = set(result.stdout.split())
    for test in (
        "tests/training/test_resume.py::test_sigkill_mid_epoch_then_resume_matches_uninterrupted_run",
        "tests/hardware/test_sharded.py::test_every_recipe_under_fsdp_exports_what_it_exports_under_ddp",
        "tests/gpu/test_recipes_on_gpu.py::test_the_gpu_export_loads_and_runs_on_the_cpu",
    ):
        assert {f"{test}[mymodel]", f"{test}[template]"} <= cases, result.stdout


def test_a_run_that_times_out_is_a_row_not_a_traceback(monkeypatch, capsys):
    """cricket's --compile run took over the check's limit on a loaded machine: the check
    stopped with TimeoutExpired's traceback; it is that promise's row, not held, and exit 1."""
    from rich.console import Console

    from accel_common.tools.check import runner

    def slow(session) -> None:
        raise subprocess.TimeoutExpired(["train.py"], 600)

    monkeypatch.setattr(runner, "PROMISES", {"h": ("--compile plain keys", slow)})
    assert runner.run_check("template", None, Console(width=200)) == 1
    line = next(line for line in capsys.readouterr().out.splitlines() if "│ h " in line)
    assert "not held" in line and "a run took over 600 s" in line


# what a 2-process `accelerate launch` leaves on stderr when a worker aborts after its work: the
# worker's last words, torch elastic's log lines, the launcher's traceback and its report, whose
# last line is a rule of `=` (the only thing CI's "FSDP = plain" row said: "exit 1: ====")
ABORTED_LAUNCH = """\
exported /tmp/check/runs/fsdp/model
terminate called without an active exception
W1207 17:12:45.100000 21392 torch/distributed/elastic/multiprocessing/api.py:1028] Sending \
process 21505 closing signal SIGTERM
E1207 17:12:45.416000 21392 torch/distributed/elastic/multiprocessing/api.py:1002] failed \
(exitcode: -6) local_rank: 1 (pid: 21506) of binary: /usr/bin/python
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 386, in x
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
accel_common/tools/check/fsdp_on_cpu.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-07_17:12:45
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 21505)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 21505
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-07_17:12:45
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 21506)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 21506
============================================================
"""


@pytest.mark.parametrize(
    ("stderr", "line"),
    [
        (
            ABORTED_LAUNCH,
            "terminate called without an active exception "
            "(rank 1: exitcode -6, Signal 6 (SIGABRT) received by PID 21506)",
        ),
        (  # a worker's exception: its last line, and the rank's exit code (no signal)
            ABORTED_LAUNCH.replace(
                "terminate called without an active exception",
                'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n'
                "AttributeError: 'Settings' object has no attribute 'bs'",
            )
            .replace("-6 (pid", "1 (pid")
            .replace("Signal 6 (SIGABRT) received by PID 21506", "To enable traceback see: x"),
            "AttributeError: 'Settings' object has no attribute 'bs' (rank 1: exitcode 1)",
        ),
        (  # an uncaught exception after the group exists: torch prefixes it with the rank
            ABORTED_LAUNCH.replace(
                "terminate called without an active exception",
                "[rank1]: RuntimeError: Connection closed by peer [127.0.0.1]:4242",
            ).replace("Signal 6 (SIGABRT) received by PID 21506", "To enable traceback see: x"),
            "[rank1]: RuntimeError: Connection closed by peer [127.0.0.1]:4242 "
            "(rank 1: exitcode -6)",
        ),
        (  # the library's one-line error says it all
            "error: --bs 0: no batch\n" + ABORTED_LAUNCH,
            "error: --bs 0: no batch",
        ),
        (  # the rank died with nothing of its own said: the report's root cause
            ABORTED_LAUNCH.replace("terminate called without an active exception\n", ""),
            "rank 1: exitcode -6, Signal 6 (SIGABRT) received by PID 21506",
        ),
        (  # no launcher (the check's own ranks): the last error line, never a rule
            "RuntimeError: gloo: connection closed by peer\nnothing more\n=====\n-----\n",
            "RuntimeError: gloo: connection closed by peer",
        ),
        ("some output\n  last words  \n==========\n", "last words"),
        ("", ""),
    ],
    ids=[
        "abort",
        "exception",
        "ranked",
        "error-line",
        "signal-only",
        "no-launcher",
        "rules",
        "empty",
    ],
)
def test_a_failed_run_is_named_by_the_line_that_says_why(stderr, line):
    """CI's FSDP row said `the FSDP run failed (exit 1): ====...`, the last line of torch
    elastic's report, which says nothing: the line shown is the one naming the cause."""
    from accel_common.tools.check.processes import failure_line, finished

    assert failure_line(stderr) == line
    failed = subprocess.CompletedProcess(["launch"], 1, "", stderr)
    with pytest.raises(RuntimeError) as raised:
        finished(failed, "the FSDP run")
    assert str(raised.value) == f"the FSDP run failed (exit 1): {line}"
