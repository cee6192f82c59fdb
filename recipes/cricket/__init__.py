"""What only the cricket recipe needs: `data` (the Cricsheet JSON reader, per-delivery features,
their Arrow cache, the graphs), `model` (the heterogeneous GNN) and `example` (the match
simulator that writes example files in Cricsheet's format).
"""
