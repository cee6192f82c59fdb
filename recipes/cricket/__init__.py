"""What only the cricket recipe needs: the Cricsheet JSON reader (`parsing`), per-innings
features (`innings`, with cricketmodel's in `features` and `schema`), the split (`split`), the
vocabulary (`vocab`), their Arrow cache (`loading`), the samples (`samples`), the phase baseline
(`baseline`) and the graphs (`graphs`); `data` re-exports them under their former module; `model`
(the heterogeneous GNN) and `example` (the match simulator that writes example files in
Cricsheet's format).
"""
