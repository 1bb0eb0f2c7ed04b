"""The MLX backend (Apple silicon; its CPU build on Linux) and its device-side drafter; RUNS:
what it runs, read without importing mlx.
"""

from __future__ import annotations

from app.core.protocols import Capabilities, Runs

# a draft model and the EAGLE heads; no tree attention, so it verifies chains only
RUNS = Runs("mlx", frozenset({"draft", "eagle3", "eagle"}),
            Capabilities(rewind=True, hidden_states=True))
