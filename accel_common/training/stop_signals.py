"""Stop signals as a request: SIGTERM or SIGUSR1 (a scheduler's warning) is noted, and the loop
saves and stops at the end of the optimizer step in progress (accel_common.training.loop)."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

# what a scheduler sends before it ends a job: SLURM (--signal=USR1@120, then SIGTERM at the end),
# Kubernetes and torchrun's agent (SIGTERM)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """While caught, the first stop signal received (`received`); the handlers it replaced
    come back on `release`."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous_handlers: dict[signal.Signals, Any] = {}

    def catch(self) -> None:
        """Note SIGTERM/SIGUSR1 instead of dying. The signal often arrives more than once (from
        the scheduler and again from the launcher); every copy after the first is ignored."""
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            self.received = self.received or signal.Signals(signum)

        for sig in STOP_SIGNALS:
            self._previous_handlers[sig] = signal.signal(sig, on_signal)

    def release(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()
