"""Who holds a run folder's lock, for the refusal that names it: the record the holder wrote
into OUTPUT/.lock, checked against the kernel's word (Linux /proc/locks), so a record copied
or written into the file from elsewhere is never presented as the holder."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import time
from pathlib import Path


def describe_holder(fd: int, wait_s: float = 2.0) -> str:
    """'pid 1234 on host h, started ..., command ...', read from the lock file; the holder
    writes it just after taking the lock, so an empty file is read again for a moment. A record
    that is not the holder's (a .lock copied over, or written into) is never presented as it:
    the kernel's word on who holds the lock (Linux /proc/locks) comes first."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            record = json.loads(os.pread(fd, 4096, 0).decode() or "null")
        except (ValueError, UnicodeDecodeError):
            record = None
        if isinstance(record, dict) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    holders = _flock_holders(fd)
    if not isinstance(record, dict):
        if holders:
            return f"{_process(holders[0])}; it did not record itself"
        return "its process did not record itself"
    said = _said(record)
    here = record.get("host") == socket.gethostname()
    if holders and not (here and record.get("pid") in holders):
        return (
            f"{_process(holders[0])}; the record inside its lock file, {said}, is not the holder's"
        )
    if not holders and here and isinstance(record.get("pid"), int) and not alive(record["pid"]):
        return (
            f"holder unknown; the record inside its lock file, {said}, names a process that has "
            "ended"
        )
    return said


def folder_holder(fd: int, lock_file: Path, wait_s: float = 2.0) -> str:
    """Who holds the flock on the folder open as `fd`, by /proc/locks: its record in
    `lock_file` where that record is the holder's ('pid 1234 on host h, started ...'; it writes
    it just after taking its locks, so it is looked for again for a moment), else 'pid 1234 on
    this host: COMMAND' (the file was replaced or removed)."""
    holders = _flock_holders(fd)
    if not holders:
        return "a process this host does not list"
    deadline = time.monotonic() + wait_s
    while True:
        record = _read_record(lock_file)
        here = isinstance(record, dict) and record.get("host") == socket.gethostname()
        if here and record.get("pid") == holders[0]:
            return _said(record)
        if time.monotonic() > deadline:
            return _process(holders[0])
        time.sleep(0.05)


def _read_record(lock_file: Path) -> object:
    """The record in `lock_file`, read without following a link or waiting on a FIFO; None
    where there is no regular file with a record."""
    try:
        fd = os.open(lock_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return json.loads(os.pread(fd, 4096, 0).decode() or "null")
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)


def _said(record: dict) -> str:
    said = f"pid {record.get('pid')} on host {record.get('host')}"
    return f"{said}, started {record.get('started')}: {_short(str(record.get('command', '')))}"


def _short(command: str) -> str:
    command = " ".join(command.split())  # one line, whatever a `python -c` script holds
    return command if len(command) <= 100 else command[:97] + "..."


def _process(pid: int) -> str:
    """'pid 1234 on this host: COMMAND' from /proc."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except (OSError, UnicodeDecodeError):
        return f"pid {pid} on this host"
    return f"pid {pid} on this host: {_short(command)}"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _flock_holders(fd: int) -> list[int]:
    """The pids holding a flock on `fd`'s file, by Linux's /proc/locks ([] where it is not there
    or the holder is on another host). Its device numbers can differ from stat's (overlayfs,
    btrfs subvolumes), so a pid whose lock is elsewhere by them is asked whether it has the file
    open."""
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    mine = os.fstat(fd)
    where = f"{os.major(mine.st_dev):02x}:{os.minor(mine.st_dev):02x}:{mine.st_ino}"
    exact, others = [], []
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK" or not parts[4].isdigit() or parts[4] == "0":
            continue
        (exact if parts[5] == where else others).append(int(parts[4]))
    if exact:
        return exact
    return [pid for pid in dict.fromkeys(others) if pid != os.getpid() and _has_open(pid, mine)]


def _has_open(pid: int, file: os.stat_result) -> bool:
    with contextlib.suppress(OSError):
        for entry in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.path.samestat(os.stat(entry), file):
                    return True
    return False
