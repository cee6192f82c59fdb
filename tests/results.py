"""What a finished run left, read back and compared: its exported weights, its metrics log
(accel_common.tools.check.compare, which `accel-recipes check` uses too)."""

from __future__ import annotations

from accel_common.tools.check.compare import (  # noqa: F401 (the tests' names for them)
    exported_params,
    global_relative_difference,
    max_relative_difference,
    metrics_log,
)
