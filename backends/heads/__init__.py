"""Drafter heads' logic written once for every backend: checkpoint formats (no array library)
and drafting over the array adapter of backends/arrays; each backend keeps only the modules
that hold weights.
"""
