"""The batch and learning-rate math the project exists for: the global batch and its split
(batching), batches balanced by cost (balance), LR scaling and schedules counted in optimizer steps
(lr, onecycle), losses and BatchNorm over the global batch (losses, batchnorm), and the memory a
per- device batch needs (memory).
"""
