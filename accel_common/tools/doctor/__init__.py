"""`accel-recipes doctor`: what to know about a machine before a distributed launch, in one report.

A failed launch costs a queue wait and usually says little: a port another job holds, an
NCCL_SOCKET_IFNAME copied from another cluster, a WORLD_SIZE left in the shell, a config asking for
8 GPUs on a node that shows 2. The doctor reads the machine, the environment and (optionally) the
accelerate config, names each blocker with what to do about it, and with `--check-comm` runs a real
all-reduce across local processes, so a broken or slow interconnect shows up before training does.

One module per concern: `base` (what it is asked, the form of a finding), `machine` (versions,
devices, the launch environment), `network` (master endpoint, port, interfaces), `config` (the
accelerate config against this machine, the recommended launch), `comm` (the all-reduce check),
`report` (collecting every finding, printing it, the exit code).
"""
