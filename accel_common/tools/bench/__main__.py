"""`python -m accel_common.tools.bench`: the reference DDP loop (one process, or one worker of
`torchrun`)."""

import os
import sys

from accel_common.tools.bench.reference import reference_loop

if __name__ == "__main__":
    reference_loop()
    if "WORLD_SIZE" in os.environ:
        # A torchrun worker whose work is done and written ends here, without the interpreter's
        # teardown: on a loaded 2-core machine torch's gloo teardown at exit aborted about 1 run
        # in 4 ("terminate called without an active exception", torch 2.14.1; still 1 in 40
        # with the DDP model freed before the process group), after everything was written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
