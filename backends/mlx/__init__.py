"""The MLX backend (Apple silicon; its CPU build on Linux) and its device-side drafter; RUNS:
what it runs, read without importing mlx.
"""

from __future__ import annotations

from app.core.protocols import Capabilities, Runs

# kind -> its builder in backends/mlx/builders.py (imported when a drafter is made): every kind
# torch builds, all over the hidden states its sessions capture
BUILDERS = {"draft": "draft_model", "eagle3": "eagle", "eagle": "eagle", "medusa": "medusa",
            "dflash": "dflash", "dspark": "dspark", "mtp": "mtp", "assistant": "assistant"}
# its targets verify trees where backends/mlx/tree.py patches their attention (a loaded
# target's capabilities say)
RUNS = Runs("mlx", frozenset(BUILDERS),
            Capabilities(rewind=True, hidden_states=True, tree_attention=True))
