"""The recipes: `train_X.py` is the script a user launches, `X/` what only workload X needs.

A package so that tests, benchmarks and `accel-recipes` import a recipe as `recipes.train_X`
and a recipe imports its own parts as `recipes.X.model`; `python recipes/train_X.py` still runs
the script directly (the project's install puts the repository on the path).
"""
