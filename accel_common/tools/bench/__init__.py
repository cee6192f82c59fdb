"""Scaling benchmark: samples/s of every recipe on 1 and 2 CPU processes (1..N GPUs where there
are GPUs), next to a hand-written `torch.distributed` DDP loop, measured in one run.

`accel-recipes bench` runs it (`report.run_benchmark`); `make bench` runs it after the overhead
benchmark. One module per job:

- `measuring`: the cases, their launches (alternating process counts within every repeat) and
  the throughput read back from each run's own `metrics.jsonl`;
- `report`: the table, the targets met or missed, the docs/BENCHMARKS.md section and the plot;
- `reference`: the reference DDP loop itself, `python -m accel_common.tools.bench`.
"""
