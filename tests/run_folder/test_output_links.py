"""A run never writes through a link (accel_common/run_folder/outputs.py): its lock, its metrics
log, its export and its caches are opened without following one or written under a private name
renamed into place, so a file outside the folder that a link names is never changed. A lock that is
not a lock file is one line; a stale record in it never passes for the holder; a full disk, SIGTERM
or SIGKILL leaves no partial --out file or data set behind."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from accel_common.checkpoints.export import write_export
from accel_common.errors import CheckpointError, DataError
from accel_common.monitoring.tracking import METRICS_FILE, JSONLTracker, start_tracking
from accel_common.run_folder.outputs import (
    LOCK_FILE,
    lock_folder,
    new_file,
    partial_path,
    sweep_partials,
    write_output,
)
from tests.processes import BIN, recipe_env, run_recipe
from tests.run_folder.test_outputs import lock_in_another_process

THEIRS = "a file of the user's, outside the run folder\n"


def outside_file(tmp_path: Path) -> Path:
    victim = tmp_path / "elsewhere" / "notes.txt"
    victim.parent.mkdir()
    victim.write_text(THEIRS)
    return victim


def one_line(message: str | None, path: Path, kind: str) -> None:
    assert message is not None and "\n" not in message, message
    assert message.startswith(f"{path} is {kind}"), message
    assert message.endswith("remove it (or choose another --output-dir) and run again"), message


# --------------------------------------------------------------------------- the lock


@pytest.mark.parametrize("link_to", ["a file elsewhere", "/dev/null", "nowhere"])
def test_a_lock_that_is_a_link_is_refused_and_what_it_names_is_unchanged(tmp_path, link_to):
    run = tmp_path / "run"
    run.mkdir()
    victim = outside_file(tmp_path)
    target = {"a file elsewhere": victim, "/dev/null": Path("/dev/null")}.get(link_to)
    (run / LOCK_FILE).symlink_to(target or tmp_path / "missing")
    one_line(lock_folder(run), (run / LOCK_FILE).absolute(), "a symbolic link")
    assert victim.read_text() == THEIRS
    assert not (tmp_path / "missing").exists()  # a dangling link is not followed to create it


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def hard_link_elsewhere(path: Path) -> None:
    os.link(outside_file(path.parent.parent), path)


@pytest.mark.parametrize(
    ("make", "kind"),
    [(Path.mkdir, "a folder"), (make_fifo, "a FIFO"), (hard_link_elsewhere, "with other names")],
)
def test_a_lock_that_is_no_lock_file_is_one_line(tmp_path, make: Callable, kind: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    make(run / LOCK_FILE)
    refusal = lock_folder(run)
    if kind == "with other names":  # a file shared with a path outside: never truncated
        assert refusal is not None and "has 1 other name(s) (hard links)" in refusal
        assert (tmp_path / "elsewhere" / "notes.txt").read_text() == THEIRS
    else:
        one_line(refusal, (run / LOCK_FILE).absolute(), kind)


@pytest.mark.parametrize("plant", ["link", "fifo"])
def test_a_link_or_fifo_put_there_after_the_look_is_not_opened(tmp_path, monkeypatch, plant):
    """Between the look (lstat) and the open, another process swaps in a link to a file of the
    user's, or a FIFO: the open follows no link and waits on no FIFO, and what it finds is
    refused."""
    import accel_common.run_folder.outputs as outputs

    run = tmp_path / "run"
    run.mkdir()
    victim = outside_file(tmp_path)
    lock = (run / LOCK_FILE).absolute()
    looked = outputs.unfit_output

    def look_then_swap(path: Path, within: Path | None = None) -> str | None:
        found = looked(path, within)
        path.symlink_to(victim) if plant == "link" else os.mkfifo(path)
        return found

    monkeypatch.setattr(outputs, "unfit_output", look_then_swap)
    refusal = lock_folder(run)
    assert refusal is not None and refusal.startswith(f"{lock} is a ")
    assert "\n" not in refusal and refusal.endswith("and run again")
    assert victim.read_text() == THEIRS


def test_a_run_with_a_linked_lock_is_refused_before_training(tmp_path, template_data):
    victim = outside_file(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / LOCK_FILE).symlink_to(victim)
    args = ["--data", str(template_data), "--output-dir", "out", "--max-steps", "2"]
    result = run_recipe(args, cwd=tmp_path, check=False)
    assert result.returncode == 2, result.stderr
    error = result.stderr.strip()
    assert error.startswith(f"error: {tmp_path / 'out' / LOCK_FILE} is a symbolic link (to "), error
    assert "\n" not in error and "Traceback" not in result.stderr
    assert victim.read_text() == THEIRS
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [LOCK_FILE]  # nothing trained


@contextlib.contextmanager
def stale_record_over_a_live_lock(run: Path) -> Iterator[subprocess.Popen]:
    """A live holder of `run`'s lock, and over its .lock a record copied from a run that ended
    an hour ago (pid 999999999 on this host)."""
    holder = lock_in_another_process(run, hold_s=60)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "None"
        stale = {"pid": 999_999_999, "host": socket.gethostname(), "started": "an hour ago"}
        (run / LOCK_FILE).write_text(json.dumps({**stale, "command": "train.py old"}))
        yield holder
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_record_in_the_lock_is_not_named_as_its_holder(tmp_path: Path) -> None:
    """The refusal names the live holder (the kernel's word, on the folder's lock first), never
    the stale record."""
    with stale_record_over_a_live_lock(tmp_path / "run") as holder:
        refusal = lock_folder(tmp_path / "run")
    assert refusal is not None and "\n" not in refusal
    prefix = f"{tmp_path / 'run'} is in use by another run (pid {holder.pid} on this host: "
    assert refusal.startswith(prefix) and "999999999" not in refusal


def test_a_stale_record_in_a_lock_file_is_never_named_as_its_holder(tmp_path: Path) -> None:
    """The lock file's own refusal (a filesystem without folder locks): the record copied in is
    said not to be the holder's."""
    from accel_common.run_folder.lock_holder import describe_holder

    with stale_record_over_a_live_lock(tmp_path / "run") as holder:
        fd = os.open(tmp_path / "run" / LOCK_FILE, os.O_RDONLY)
        try:
            said = describe_holder(fd)
        finally:
            os.close(fd)
    assert said.startswith(f"pid {holder.pid} on this host: ")
    assert "the record inside its lock file, pid 999999999 on host" in said
    assert "is not the holder's" in said


# --------------------------------------------------------------------------- a run's other files


def test_the_metrics_log_is_never_appended_through_a_link(tmp_path, accelerator) -> None:
    victim = outside_file(tmp_path)
    log = tmp_path / "out" / "logs" / METRICS_FILE
    log.parent.mkdir(parents=True)
    log.symlink_to(victim)
    with pytest.raises(CheckpointError, match=f"^{log} is a symbolic link"):
        start_tracking(
            accelerator, project="p", run_name=None, output_dir=tmp_path / "out", config={}
        )
    with pytest.raises(CheckpointError, match=f"^{log} is a symbolic link"):
        JSONLTracker(log.parent).start()  # a link put there after that look
    assert victim.read_text() == THEIRS


def test_the_export_replaces_links_at_its_names_and_leaves_what_they_name(tmp_path) -> None:
    victim = outside_file(tmp_path)
    model = tmp_path / "out" / "model"
    model.mkdir(parents=True)
    for name in ("model.safetensors", "model.json"):
        (model / name).symlink_to(victim)
    write_export({"w": torch.ones(2)}, model, {"recipe": "template"})
    assert victim.read_text() == THEIRS
    assert not any(p.is_symlink() for p in model.iterdir())
    assert json.loads((model / "model.json").read_text())["recipe"] == "template"


def test_write_output_replaces_a_link_and_leaves_no_partial(tmp_path) -> None:
    victim = outside_file(tmp_path)
    target = tmp_path / "fit.json"
    target.symlink_to(victim)
    write_output(target, '{"ok": 1}')
    assert victim.read_text() == THEIRS and not target.is_symlink()
    assert target.read_text() == '{"ok": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "fit.json"]


# --------------------------------------------------------------------------- stopped writes


def test_a_full_disk_while_writing_an_out_file_is_one_line_and_leaves_nothing(tmp_path) -> None:
    out = tmp_path / "predictions.csv"
    with pytest.raises(DataError) as raised, new_file(out) as partial:
        partial.write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert str(raised.value) == (
        f"--out {out}: no space left on device while writing it; nothing was left: free space on "
        "that disk (or choose another --out) and run again"
    )
    assert list(tmp_path.iterdir()) == []


def limit_file_size() -> None:
    """A file size limit as a full disk without root: writes past it fail (EFBIG, not a signal)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


@pytest.mark.parametrize("force", [False, True])
def test_make_data_past_a_file_size_limit_is_one_line(tmp_path: Path, force: bool) -> None:
    data = tmp_path / "data"
    command = [str(BIN / "accel-recipes"), "make-data", "template", str(data)]
    result = subprocess.run(
        [*command, *(["--force"] if force else [])],
        capture_output=True,
        text=True,
        env=recipe_env(tmp_path),
        preexec_fn=limit_file_size,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    left = "the files written so far are in it" if force else "nothing was left"
    assert result.stderr == (
        f"error: DIR {data}: could not write (File too large) while writing it; {left}: check "
        "that its disk is writable (or choose another DIR) and run again\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == (["data"] if force else [])


WRITE_UNTIL_STOPPED = """
import sys, time
from pathlib import Path
from accel_common.run_folder.outputs import new_file
with new_file(Path(sys.argv[1])) as partial:
    partial.write_text("half")
    print("written", flush=True)
    time.sleep(60)
"""


def as_a_foreground_command() -> None:
    """The child's signals as a shell gives a foreground command: an ignored or blocked SIGINT
    is inherited through exec, and some library in the pytest worker (once, in a full suite
    run) left it ignored: the writer then slept on, as `_removed_on_stop` intends for a
    background job."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_out_writer_removes_its_partial(tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "predictions.csv"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITE_UNTIL_STOPPED, str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=recipe_env(tmp_path),
        preexec_fn=as_a_foreground_command,
    )
    assert writer.stdout is not None and writer.stdout.readline() == "written\n"
    writer.send_signal(sig)
    _, error = writer.communicate(timeout=60)
    assert writer.returncode == 128 + sig
    assert error == f"stopped by {sig.name}: {out} was not written (nothing was left)\n"
    assert list(tmp_path.iterdir()) == []


def test_a_killed_writers_partial_is_swept_by_the_next(tmp_path: Path) -> None:
    """SIGKILL leaves no chance to clean up: the next writer of the name removes the partials
    of this host's ended processes, and leaves a live writer's and another host's."""
    out = tmp_path / "predictions.csv"
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    mine = partial_path(out)
    killed = mine.with_name(mine.name.replace(f"-{os.getpid()}-", f"-{dead.pid}-"))
    elsewhere = out.with_name(f".predictions.partial-otherhost-{dead.pid}-abcdef.csv")
    other_name = out.with_name(f".predictions.partial-{dead.pid}.npy")
    for path in (mine, killed, elsewhere, other_name):
        path.write_text("half")
    sweep_partials(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (mine, elsewhere, other_name)
    )
