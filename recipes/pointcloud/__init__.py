"""What only the point-cloud recipe (recipes/train_pointcloud.py) needs: the SkullBreak layout's
reader (data), the point-voxel denoiser (model), the diffusion process and its samplers
(diffusion), the example-skull generator (example), `prepare` from .nrrd volumes (prepare) and
the PNG quick-look of `complete` (viz).
"""
