"""A launched worker's process group, freed before the interpreter exits.

`Accelerator.end_training()` destroys the process group (`destroy_process_group`), but torch
2.14.1 keeps the group's object alive afterwards, and with it gloo's worker threads:

- `torch.distributed.nn.functional` evaluates `group=group.WORLD` in its functions' defaults when
  it is imported, and DDP's constructor imports it (through `torch.distributed._shard`) after the
  group exists, so ten function defaults hold the default group for good;
- DTensor's caches (sharding propagation, redistribution plans, mesh topology: FSDP2's
  parameters) keep `DeviceMesh` objects, each holding its groups.

Left so, the group is freed only while Python finalises, and a gloo thread that releases the last
reference to a tensor Python had used then takes the GIL, which Python 3.11 answers with
`pthread_exit` from inside a C++ destructor: "terminate called without an active exception",
SIGABRT, after the run's work was all written (torch's launcher then fails the job, exit 1).
`release_at_exit` (called by `make_accelerator` in a multi-process launch) frees the group at
interpreter exit instead, with Python intact: an `atexit` handler, so it runs after everything
the script does after training, and lets it end as usual. What a script itself keeps to the end
(a model in a module-level variable) still holds the group; the recipes keep theirs in their
training function.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import sys
from types import FunctionType
from typing import Any

_held: list[Any] = []  # the default group, from the launch until the handler frees it
CACHED = type(functools.cache(len))  # what functools.cache and lru_cache return


def release_at_exit() -> None:
    """At interpreter exit, free the (destroyed) default process group of this launch, joining
    its threads while Python is intact. Call once the group exists; a second call does nothing."""
    import torch.distributed as dist

    if _held or not (dist.is_available() and dist.is_initialized()):
        return
    _held.append(dist.group.WORLD)
    atexit.register(release_destroyed_group)


def release_destroyed_group() -> None:
    """Drop torch's own references to the destroyed default group (function defaults and caches,
    DTensor's included) and this module's, freeing it and joining its threads now. Does nothing
    while the group is alive: a run that failed before `end_training` leaves as it was."""
    import torch.distributed as dist

    if not _held or dist.is_initialized():
        return
    drop_group_defaults()
    clear_dtensor_caches()
    gc.collect()  # the model and its optimizer, where a reference cycle holds them
    # the last reference is this Python one: torch's binding frees a group with the GIL released
    # (IntrusivePtrNoGilDestructor), so a gloo thread still finishing a collective can take the
    # GIL while its threads are joined; freed from C++ (a DDP reducer), it would wait for them
    # holding the GIL
    _held.clear()


def drop_group_defaults() -> None:
    """Forget the destroyed groups torch.distributed's functions hold: a group held as a default
    argument becomes None ("the default group", as when the module is imported before any group
    exists), and their caches (`functools.cache`: DTensor's mesh topology, ...) are emptied.
    Called once no group is alive: every group held there is a destroyed one."""
    from torch.distributed import ProcessGroup

    def is_group(value: Any) -> bool:
        return issubclass(type(value), ProcessGroup)

    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        for value in list(vars(module).values()):
            # type(), not isinstance(): some of torch's objects warn when asked for __class__
            found = [value]
            if issubclass(type(value), type) and value.__module__ == name:
                found += [unwrapped(member) for member in vars(value).values()]
            for function in found:
                if type(function) is CACHED:
                    function.cache_clear()
                    function = getattr(function, "__wrapped__", None)
                if type(function) is not FunctionType:
                    continue
                defaults = function.__defaults__ or ()
                if any(is_group(d) for d in defaults):
                    function.__defaults__ = tuple(None if is_group(d) else d for d in defaults)
                keywords = function.__kwdefaults__ or {}
                if any(is_group(v) for v in keywords.values()):
                    function.__kwdefaults__ = {
                        k: None if is_group(v) else v for k, v in keywords.items()
                    }


def unwrapped(member: Any) -> Any:
    """A class's member as a function: a static or class method's own."""
    return member.__func__ if type(member) in (staticmethod, classmethod) else member


def clear_dtensor_caches() -> None:
    """Empty DTensor's caches that are not plain functions' (sharding propagation, in Python and
    in C++; redistribution planners): they hold DeviceMesh objects, and through them their
    groups (torch's own clearing functions, where this torch has them; nothing without
    DTensor)."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import _redistribute, debug

    for clear in (
        getattr(debug, "_clear_sharding_prop_cache", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
    ):
        if clear is not None:
            clear()


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (Linux; [] elsewhere): none once every group
    was freed."""
    tasks = f"/proc/{os.getpid()}/task"
    if not os.path.isdir(tasks):
        return []
    names = []
    for task in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, task, "comm")) as comm:
                names.append(comm.read().strip())
        except OSError:  # ended meanwhile
            continue
    return sorted(name for name in names if "gloo" in name)
