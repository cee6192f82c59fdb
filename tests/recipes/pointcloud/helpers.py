"""What several of the point-cloud recipe's test files use."""

from __future__ import annotations

from tests.processes import POINTCLOUD_TINY

TINY = POINTCLOUD_TINY
