"""A run's state on disk: resumable checkpoints (checkpoint), their files and manifest
(checkpoint_files), where a run is (progress), FSDP's sharded folders (dcp_reader), tied weights
(ties), and the export a run leaves for plain PyTorch (export).
"""
