"""The PyTorch + transformers backend (CUDA and CPU), its row-invariant attention, int8
layers and the HF reference comparison; RUNS: what it runs, read without importing torch.
"""

from __future__ import annotations

from app.core.protocols import Capabilities, Runs

# every kind: a draft model, each head, the target's own MTP layers; 4D masks verify trees
RUNS = Runs("torch", frozenset({"draft", "eagle3", "eagle", "medusa", "dflash", "dspark",
                                 "mtp"}),
            Capabilities(rewind=True, hidden_states=True, tree_attention=True))
