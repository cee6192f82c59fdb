"""The hardware and the launch: the Accelerator a launch trains with (accelerator), refusals before
a launch does work (launch_guard), speed switches (speed), torch.compile (compilation),
--deterministic (determinism), FSDP's wrap policy (sharding), parameter counts (parameters), and
the process group freed before the interpreter exits (group_release).
"""
