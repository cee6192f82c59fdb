"""The per-original parts of benchmarks/bench_trainers.py: for each workload, its example data
in the original's layout, the original's trainer as a process, and the recipe's preset as one."""
