"""Readers of each workload's original format, and generators of small example sets in it.

A recipe imports its own workload's module (`accel_common.data.template`, ...); this package
imports none of them, so a recipe loads only what its workload needs (PIL only for images).
`accel-recipes make-data` finds the generators through `accel_common.tools.example_data`.
"""
