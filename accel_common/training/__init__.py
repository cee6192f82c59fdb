"""The training loop, written once (loop) with what it does between steps (policy), evaluation's
draws and metrics (evaluation), NaN/inf checks (nonfinite), stop signals (stop_signals), and the run
it trains: its record, identity, output folder and checkpoints' owner (run).
"""
