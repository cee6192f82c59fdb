"""One writer per output: the lock on a run's folder and the files created in it without following
links or leaving halves (outputs), and who holds a lock (lock_holder).
"""
