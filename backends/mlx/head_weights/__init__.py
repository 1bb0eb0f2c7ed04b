"""Drafter heads on MLX, over the target's hidden states the MLX session captures (EAGLE,
Medusa, DFlash, DSpark).

Head folders are read by backends/heads/eagle_format.py, dflash_format.py, dspark_format.py
and medusa_format.py (no array library), so both backends load the same files; this package
file stays empty of logic.
"""
