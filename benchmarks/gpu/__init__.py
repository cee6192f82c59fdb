"""The GPU benchmark's parts, by concern: training steps (steps.py), the point-cloud ops one by
one (point_ops.py), and the tables, ratios and targets (report.py). benchmarks/bench_gpu.py runs
them in one process and writes what they measured."""
