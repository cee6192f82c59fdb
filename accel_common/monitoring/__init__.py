"""What a run shows and logs about itself: experiment tracking on the main process (tracking),
FLOPs, TFLOP/s and MFU (throughput), and each process's wait in the all-reduce (sync_wait).
"""
