"""The MLX backend (Apple silicon; its CPU build on Linux) and its device-side drafter; RUNS:
what it runs, read without importing mlx.
"""

from __future__ import annotations

from app.core.protocols import Capabilities, Runs

# every kind torch builds: a draft model, the EAGLE heads (chains and EAGLE-2 trees), Medusa
# heads, DFlash and DSpark block drafters, the target's own MTP layers, all over the hidden
# states its sessions capture; its targets verify trees where backends/mlx/tree.py patches
# their attention (a loaded target's capabilities say)
RUNS = Runs("mlx", frozenset({"draft", "eagle3", "eagle", "medusa", "dflash", "dspark", "mtp"}),
            Capabilities(rewind=True, hidden_states=True, tree_attention=True))
