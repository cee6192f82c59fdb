"""What only the crystal recipe needs: `data` (the extended XYZ reader, targets, periodic k-NN
graphs, their Arrow cache and dataset), `model` (the iComformer-style graph transformer),
`example` (EMT-labelled example crystals) and `api` (the old path of recipes/crystal_api.py,
the original's `train_from_extxyz` and `train_from_list`, kept with a DeprecationWarning)."""
