"""Drafter heads that run on the target's own hidden states (EAGLE, and more as they land).

Each head family has its own modules here; this package file stays empty of logic.
"""
