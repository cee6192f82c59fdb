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
import re
import secrets
import shutil
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, TextIO

from accel_common.errors import CheckpointError, DataError
from accel_common.run_folder.lock_holder import alive, describe_holder, folder_holder

LOCK_FILE = ".lock"
# errors of a write that failed for want of room (a full disk, a quota, a file size limit)
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
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
        refusal = [lock_folder(Path(output_dir)) or linked_entry(Path(output_dir))]
    if accelerator.num_processes > 1:
        refusal = broadcast_object_list(refusal)
    if refusal[0] is not None:
        raise CheckpointError(refusal[0])


def lock_folder(output_dir: Path) -> str | None:
    """Take the lock on `output_dir` for this process's life: None, or why it cannot (another
    process holds it, or OUTPUT/.lock is not a lock file a run may write: a link, a folder, a
    FIFO, a device, another user's file). Taking it again in the process that holds it is a
    no-op."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = (output_dir / LOCK_FILE).absolute()
    held = _held.get(path)
    if held is not None and _same_file(held, path):
        return None
    folder = _lock_the_folder(output_dir)
    if isinstance(folder, str):
        return folder
    fd = _open_output(path, os.O_RDWR)
    if isinstance(fd, str):
        _close(folder)
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = describe_holder(fd)
        os.close(fd)
        _close(folder)
        return _in_use(output_dir, holder)
    except OSError as err:  # a filesystem without locks (NFSv3 without lockd, Lustre noflock)
        os.close(fd)
        _close(folder)
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
    _close(_held.pop(output_dir.absolute(), None))
    _held[path] = fd
    if folder is not None:
        _held[output_dir.absolute()] = folder
    return None


def _lock_the_folder(output_dir: Path) -> int | str | None:
    """The folder itself locked as well (its descriptor), or why not (another run holds it), or
    None where its filesystem takes no folder locks (NFS: the lock file alone then). A .lock
    removed or replaced by another file while a run lives would let a second run lock the new
    one; the folder cannot be swapped under a run (moved aside, its lock moves with it)."""
    fd = os.open(output_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = folder_holder(fd, output_dir / LOCK_FILE)
        os.close(fd)
        return _in_use(output_dir, holder)
    except OSError:
        os.close(fd)
        return None
    return fd


def _in_use(output_dir: Path, holder: str) -> str:
    return (
        f"{output_dir} is in use by another run ({holder}): wait for it to finish, or choose "
        "another --output-dir"
    )


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


_REMOVE_IT = "remove it (or choose another --output-dir) and run again"


def linked_entry(output_dir: Path) -> str | None:
    """Why a run must not write into `output_dir`: an entry in it is a link (checkpoints/,
    model/, logs/, ...), through which its saves, exports and pruning would reach a folder
    elsewhere; or None."""
    for entry in sorted(output_dir.iterdir()):
        if entry.is_symlink():
            return (
                f"{entry} is a symbolic link (to {os.readlink(entry)}): a run writes only inside "
                f"its --output-dir, never through a link; {_REMOVE_IT} (its target is untouched)"
            )
    return None


def unfit_output(path: Path, within: Path | None = None) -> str | None:
    """Why a run must not write `path` (a link, a folder, a FIFO, a device, another user's
    file, a file with other names; or under a link inside `within`, its output folder), or
    None: it is missing or fit. The main process asks before training, so that every process
    is refused alike."""
    folders = Path(path).parents if within is not None else ()
    for folder in folders:
        if folder == within:
            break
        if folder.is_symlink():
            return (
                f"{folder} is a symbolic link (to {os.readlink(folder)}): a run never writes "
                f"through a link; {_REMOVE_IT}"
            )
    try:
        return _unfit(path, os.lstat(path))
    except FileNotFoundError:
        return None


def append_file(path: Path) -> TextIO:
    """`path` opened to append lines to (created if missing, line-buffered), never through a
    link nor into a FIFO or device: a CheckpointError naming it otherwise."""
    fd = _open_output(path, os.O_WRONLY | os.O_APPEND)
    if isinstance(fd, str):
        raise CheckpointError(fd)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", buffering=1)


def _open_output(path: Path, flags: int) -> int | str:
    """A descriptor of `path` opened with `flags` (created if missing), or why a run must not
    write it. Looked at first, so that a FIFO or a device is never opened; then opened without
    following a link or waiting on a FIFO, against one put there meanwhile."""
    if refusal := unfit_output(path):
        return refusal
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            return f"{path} is a symbolic link: a run never writes through a link; {_REMOVE_IT}"
        return f"{path}: cannot open it ({err.strerror}): {_REMOVE_IT}"
    if refusal := _unfit(path, os.fstat(fd)):
        os.close(fd)
    return refusal or fd


def _unfit(path: Path, st: os.stat_result) -> str | None:
    """Why `path` (its lstat or fstat `st`) is no file a run may truncate or append to, or None:
    only a regular file with no other name, owned by this user or by its folder's owner."""
    if stat.S_ISLNK(st.st_mode):
        with contextlib.suppress(OSError):
            return (
                f"{path} is a symbolic link (to {os.readlink(path)}): a run never writes through "
                f"a link; {_REMOVE_IT}"
            )
        return f"{path} is a symbolic link: a run never writes through a link; {_REMOVE_IT}"
    kind = stat.S_IFMT(st.st_mode)
    kinds = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}
    kinds |= {stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}
    if kind in kinds:
        return f"{path} is {kinds[kind]}, not a file a run writes: {_REMOVE_IT}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file: {_REMOVE_IT}"
    if st.st_uid not in (os.geteuid(), _owner(path.parent)):
        return f"{path} belongs to another user (uid {st.st_uid}): {_REMOVE_IT}"
    if st.st_nlink > 1:
        return (
            f"{path} has {st.st_nlink - 1} other name(s) (hard links): a run never writes "
            f"into a file shared with another path; {_REMOVE_IT}"
        )
    return None


def _owner(folder: Path) -> int:
    try:
        return os.stat(folder).st_uid
    except OSError:
        return os.geteuid()


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
    return target.with_name(f".{target.stem}.partial-{_token()}{target.suffix}")


def _token() -> str:
    """HOST-PID-RANDOM: whose a partial is, so that `sweep_partials` can tell a dead writer's."""
    return f"{_host()}-{os.getpid()}-{secrets.token_hex(3)}"


def _host() -> str:
    return re.sub(r"[^\w.]", "_", socket.gethostname())[:40] or "host"


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
    sweep_partials(target)
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
    never replacing a file another process wrote there meanwhile. A failed write (a full disk:
    one line), SIGTERM or Ctrl-C leaves nothing behind; what a SIGKILLed writer left is swept
    by the next."""
    target = Path(target)
    sweep_partials(target)
    partial = partial_path(target)
    try:
        with _removed_on_stop(target):
            yield partial
        with exclusive_outputs():
            place_file(partial, target, flag)
    except OSError as err:
        if err.errno not in WRITE_ERRNOS:
            raise
        raise unwritten(target, flag, err) from None
    finally:
        partial.unlink(missing_ok=True)


@contextlib.contextmanager
def new_folder(target: Path, flag: str = "DIR") -> Iterator[Path]:
    """Yield a private folder beside `target` to fill; once filled, it is renamed to `target`
    (replacing `target` only if that is an empty folder), never mixing with what another process
    wrote there meanwhile. A failed write leaves nothing behind, as in `new_file`."""
    target = Path(target)
    if target.is_symlink():  # rename would replace the link, not fill the folder it names
        target = target.resolve()
    sweep_partials(target)
    partial = partial_path(target)
    try:
        with _removed_on_stop(target):
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
    except OSError as err:
        if err.errno not in WRITE_ERRNOS:
            raise
        raise unwritten(target, flag, err) from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)


# --------------------------------------------------------------------------- failed writes


def disk_full(err: OSError) -> bool:
    return err.errno in (errno.ENOSPC, errno.EDQUOT)


def write_failure(err: OSError) -> str:
    """'no space left on device' (or the quota, or the system's own words for another error)."""
    if err.errno == errno.ENOSPC:
        return "no space left on device"
    if err.errno == errno.EDQUOT:
        return "disk quota exceeded"
    return f"could not write ({err.strerror or err})"


def unwritten(target: Path, flag: str, err: OSError, left: str = "nothing was left") -> DataError:
    """The one line for a write of `target` (named by `flag`) that failed with `err`."""
    advice = "free space on that disk" if disk_full(err) else "check that its disk is writable"
    return DataError(
        f"{flag} {target}: {write_failure(err)} while writing it; {left}: {advice} (or choose "
        f"another {flag}) and run again"
    )


@contextlib.contextmanager
def _removed_on_stop(target: Path) -> Iterator[None]:
    """While `target` is written, SIGTERM or SIGINT ends the command in one line, by SystemExit,
    so the callers' cleanup removes the partial (the default action would leave it, or print a
    traceback). A signal the process ignores (a background job's SIGINT) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        print(f"stopped by {name}: {target} was not written (nothing was left)", file=sys.stderr)
        raise SystemExit(128 + signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            previous[sig] = signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def sweep_partials(target: Path) -> None:
    """Remove what killed writers of `target` left beside it (a SIGKILL leaves no chance to
    clean up): the partials of processes of this host that have ended. A live writer's, or
    another host's (a shared filesystem), is left alone."""
    target = Path(target)
    stem, suffix = (target.stem, target.suffix) if target.suffix else (target.name, "")
    token = r"(?P<host>[\w.]+)-(?P<pid>\d+)-[0-9a-f]{6}"
    pattern = re.compile(re.escape(f".{stem}.partial-") + token + re.escape(suffix))
    try:
        names = os.listdir(target.parent)
    except OSError:
        return
    for name in names:
        found = pattern.fullmatch(name)
        if found is None or found["host"] != _host() or alive(int(found["pid"])):
            continue
        stale = target.parent / name
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(os.lstat(stale).st_mode):
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink()  # a link itself, never what it names
