"""The MLX backend (Apple silicon; its CPU build on Linux) and its device-side drafter.
"""
