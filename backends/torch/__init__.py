"""The PyTorch + transformers backend (CUDA and CPU), its row-invariant attention, int8
layers and the HF reference comparison; RUNS: what it runs, read without importing torch.
"""

from __future__ import annotations

from app.core.protocols import Capabilities, Runs

# kind -> its builder in backends/torch/builders.py (imported when a drafter is made): a draft
# model, each head, the target's own MTP layers
BUILDERS = {"draft": "draft_model", "eagle3": "eagle", "eagle": "eagle", "medusa": "medusa",
            "dflash": "dflash", "dspark": "dspark", "mtp": "mtp", "assistant": "assistant"}
# 4D masks verify trees
RUNS = Runs("torch", frozenset(BUILDERS),
            Capabilities(rewind=True, hidden_states=True, tree_attention=True))
