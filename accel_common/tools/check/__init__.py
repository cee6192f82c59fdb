"""`accel-recipes check NAME`: prove on the CPU what the library promises every recipe, a new one
included. The recipe runs on its example data (in a temporary folder) at the small, deterministic
size it declares (`CHECK_ARGS`, `CHECK_DATA`, `CHECK_COMMAND`: recipe.py); each promise
(promises.py) compares the runs it needs (session.py: started by processes.py), tensor by
tensor, the rounding-noise tensors held to their own spread (noise.py), and the table (runner.py)
says, per promise, held, not held, waived (CHECK_WAIVE) or skipped, with the numbers measured.
The tests start their recipe runs through processes.py too, and use its comparisons
(compare.py), its audit of opened files (opened.py) and its FSDP-on-CPU launch (fsdp_on_cpu.py).
"""
