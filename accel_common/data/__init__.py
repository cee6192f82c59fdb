"""Readers every recipe with files of that kind uses: numeric CSV and path lists (files), image
folders (images), and Arrow caches built once on the main process (cache).

A workload's own format (Cricsheet JSON, extxyz, SkullBreak point clouds, ...) is read by its
recipe's folder, `recipes/X/data.py`; its example generator is `recipes/X/example.py`.
"""
