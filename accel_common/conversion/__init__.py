"""Checkpoint conversion: foreign checkpoints (DDP, torch.compile, Accelerate and FSDP folders,
plain torch.save files) into the project's export (convert), what `accel-recipes convert` runs.
"""
