"""One writer per output: a run's lock on its output folder, and files and folders created
exclusively (written under a private name, then moved into place without replacing anything).

A check that a path is free, made before the work, cannot stop a second process that passed
the same check meanwhile: two commands started at once would both write, and the later one
silently replaces the earlier's result (or mixes two data sets in one folder). So the check
stays (it fails before the work), and the move into place is the real guarantee:

- `hold_output_dir`: a training run holds `fcntl.flock` on OUTPUT/.lock for its whole life; a
  second run or resume into the folder is refused, naming the holder. The kernel releases the
  lock when its process dies (even by SIGKILL), so a killed run's lock never blocks a resume.
- `new_file` / `place_file`: a result is written to a private name beside it, then hard-linked
  to its name (`os.link` fails with EEXIST, atomically, when the name is taken);
  `exclusive_outputs(False)` lets a command's --force replace instead.
- `replacing_file` / `write_output`: a run's own file in its folder is written under a private
  name and renamed over its name, so a link planted there is replaced, never written through.
- `new_folder`: a data set is written to a private folder beside it, then renamed to its name
  (`os.rename` fails when the name is a non-empty folder; an empty one is replaced).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING

from accel_common.errors import CheckpointError, DataError

LOCK_FILE = ".lock"
# errors of os.link on a filesystem without hard links (some FUSE, SMB and FAT mounts)
NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV})
# the lock files this process holds (kept open: closing one would release its lock)
_held: dict[Path, int] = {}
_exclusive: ContextVar[bool] = ContextVar("exclusive_outputs", default=False)

if TYPE_CHECKING:
    from accelerate import Accelerator


def _forget_locks() -> None:
    """In a forked child (a DataLoader worker, a datasets.map process): close its copies of the
    lock files. A flock belongs to the open file, which a fork shares: a child outliving a
    SIGKILLed parent by seconds would otherwise hold the parent's folder that long. Closing a
    copy leaves the parent's lock as it is."""
    for fd in _held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_locks)


# --------------------------------------------------------------------------- a run's folder


def hold_output_dir(accelerator: Accelerator, output_dir: Path) -> None:
    """The main process locks `output_dir` (creating it) until it exits; a folder another live
    run holds is refused on every process, naming that run (collective)."""
    from accelerate.utils import broadcast_object_list  # late: --out writers need no torch

    refusal: list[str | None] = [None]
    if accelerator.is_main_process:
        refusal = [lock_folder(Path(output_dir))]
    if accelerator.num_processes > 1:
        refusal = broadcast_object_list(refusal)
    if refusal[0] is not None:
        raise CheckpointError(refusal[0])


def lock_folder(output_dir: Path) -> str | None:
    """Take the lock on `output_dir` for this process's life: None, or why it cannot (another
    process holds it). Taking it again in the process that holds it is a no-op."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = (output_dir / LOCK_FILE).absolute()
    held = _held.get(path)
    if held is not None and _same_file(held, path):
        return None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        return (
            f"{output_dir} is in use by another run ({holder}): wait for it to finish, or "
            "choose another --output-dir"
        )
    except OSError as err:  # a filesystem without locks (NFSv3 without lockd, Lustre noflock)
        os.close(fd)
        print(
            f"warning: {output_dir}: its filesystem takes no locks ({err.strerror}); nothing "
            "stops a second run from writing into it",
            file=sys.stderr,
            flush=True,
        )
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_this_process()).encode(), 0)
    if held is not None:  # the folder was moved aside (--overwrite): its old lock goes too
        os.close(held)
    _held[path] = fd
    return None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def _this_process() -> dict[str, object]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
    }


def _holder(fd: int, wait_s: float = 2.0) -> str:
    """'pid 1234 on host h, started ..., command ...', read from the lock file; the holder
    writes it just after taking the lock, so an empty file is read again for a moment."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            holder = json.loads(os.pread(fd, 4096, 0).decode() or "null")
        except (ValueError, UnicodeDecodeError):
            holder = None
        if isinstance(holder, dict) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if not isinstance(holder, dict):
        return "its process did not record itself"
    command = str(holder.get("command", ""))
    command = command if len(command) <= 100 else command[:97] + "..."
    return (
        f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}: "
        f"{command}"
    )


# --------------------------------------------------------------------------- files and folders


@contextlib.contextmanager
def exclusive_outputs(exclusive: bool = True) -> Iterator[None]:
    """Within it, `place_file` never replaces an existing file (a command without --force);
    outside, it replaces (a training run's own export, under the run's lock)."""
    token = _exclusive.set(exclusive)
    try:
        yield
    finally:
        _exclusive.reset(token)


def partial_path(target: Path) -> Path:
    """A private name beside `target` to write it under: unique to this process and call, with
    `target`'s suffix (np.save and image writers choose their format by it)."""
    target = Path(target)
    token = f"{os.getpid()}-{secrets.token_hex(3)}"
    return target.with_name(f".{target.stem}.partial-{token}{target.suffix}")


def place_file(partial: Path, target: Path, flag: str = "") -> None:
    """Move the written `partial` to `target`: without replacing anything inside
    `exclusive_outputs()` (the loser of a race is told, its file removed), else replacing."""
    if not _exclusive.get():
        os.replace(partial, target)
        return
    try:
        os.link(partial, target)
    except FileExistsError:
        partial.unlink(missing_ok=True)
        raise taken(target, flag) from None
    except OSError as err:
        if err.errno not in NO_HARD_LINKS:
            raise
        # no hard links here: claim the name exclusively first (an empty file, briefly)
        try:
            os.close(os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        except FileExistsError:
            partial.unlink(missing_ok=True)
            raise taken(target, flag) from None
        os.replace(partial, target)
        return
    partial.unlink()


def taken(target: Path, flag: str) -> DataError:
    """The loser's message: `target` was written by another process after this one checked."""
    named = f"{flag} {target}" if flag else str(target)
    return DataError(
        f"{named}: another process wrote it meanwhile; its file is kept as written (nothing was "
        f"overwritten): choose another {flag or 'output'} and run again"
    )


@contextlib.contextmanager
def replacing_file(target: Path) -> Iterator[Path]:
    """Yield a private path beside `target` to write to; once written, it is renamed over
    `target`. A link planted at `target` is replaced, never written through (nothing outside
    the folder is touched), a reader never sees half a file, and a failed write leaves nothing
    behind."""
    partial = partial_path(target)
    try:
        yield partial
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def write_output(target: Path, data: bytes | str) -> None:
    """Write `data` (text as UTF-8) to `target` through `replacing_file`. The private file is
    created exclusively, without following links, so a name planted there is refused."""
    with replacing_file(Path(target)) as partial:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(partial, flags, 0o666), "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)


@contextlib.contextmanager
def new_file(target: Path, flag: str = "--out") -> Iterator[Path]:
    """Yield a private path to write `target`'s contents to; once written, it becomes `target`,
    never replacing a file another process wrote there meanwhile. A failed write leaves
    nothing behind."""
    partial = partial_path(target)
    try:
        yield partial
        with exclusive_outputs():
            place_file(partial, Path(target), flag)
    finally:
        partial.unlink(missing_ok=True)


@contextlib.contextmanager
def new_folder(target: Path, flag: str = "DIR") -> Iterator[Path]:
    """Yield a private folder beside `target` to fill; once filled, it is renamed to `target`
    (replacing `target` only if that is an empty folder), never mixing with what another process
    wrote there meanwhile. A failed write leaves nothing behind."""
    target = Path(target)
    if target.is_symlink():  # rename would replace the link, not fill the folder it names
        target = target.resolve()
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}-{secrets.token_hex(3)}")
    try:
        yield partial
        try:
            os.rename(partial, target)
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise DataError(
                    f"{flag} {target}: cannot move the written data into place ({err.strerror})"
                ) from None
            raise DataError(
                f"{flag} {target}: another process wrote into it meanwhile; what it wrote is kept "
                "(nothing was mixed in): choose another folder and run again"
            ) from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
