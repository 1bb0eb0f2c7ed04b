"""The llama.cpp adapter: GGUF files run on llama.cpp's own CPU kernels under specdeck's engine;
RUNS: what it runs, read without importing llama_cpp.
"""

from __future__ import annotations

from app.core.protocols import Capabilities, Runs

# a draft model only: its targets return logits, no hidden states for heads, no tree attention
RUNS = Runs("llamacpp", frozenset({"draft"}),
            Capabilities(rewind=True, hidden_states=False, tree_attention=False,
                         reason="llama.cpp runs chains and returns logits only"))
