"""Drafter heads on MLX, over the target's hidden states the MLX session captures (EAGLE,
DFlash).

Head folders are read by backends/heads/eagle_format.py and backends/heads/dflash_format.py
(no array library), so both backends load the same files; this package file stays empty of
logic.
"""
