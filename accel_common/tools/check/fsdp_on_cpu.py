"""FSDP on CPU processes over gloo, for the check and the tests: `accelerate launch --config_file
FSDP_CONFIG accel_common/tools/check/fsdp_on_cpu.py RECIPE [FLAGS]` runs RECIPE unchanged as FSDP.

Accelerate enables FSDP only with an accelerator: it builds its state as MULTI_CPU on the CPU and
drops the FSDP plugin (and the recipes refuse that launch rather than train unsharded). This sets
the state back to what the same launch gets on GPUs; everything after that is Accelerate's real
FSDP2 code, whose `fully_shard` and DCP run on CPU/gloo. Rank 0 prints each unit it shards
(`fsdp unit: NAME`).
"""

from __future__ import annotations

import os
import runpy
import sys


def enable_fsdp_on_cpu() -> None:
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    build = AcceleratorState.__init__

    def build_with_fsdp(self, *args, **kwargs) -> None:
        build(self, *args, **kwargs)
        if os.environ.get("ACCELERATE_USE_FSDP") == "true" and self.distributed_type == "MULTI_CPU":
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = FullyShardedDataParallelPlugin()

    AcceleratorState.__init__ = build_with_fsdp
    import torch.distributed.fsdp as fsdp

    shard = fsdp.fully_shard

    def shard_and_say(module, **kwargs):
        if os.environ.get("RANK") == "0":
            print(f"fsdp unit: {type(module).__name__}", flush=True)
        return shard(module, **kwargs)

    fsdp.fully_shard = shard_and_say  # Accelerate imports it when it prepares the model


if __name__ == "__main__":
    enable_fsdp_on_cpu()
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # what `python script` puts first
    runpy.run_path(sys.argv[0], run_name="__main__")
