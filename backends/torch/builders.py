"""The torch backend's drafter builders, one a kind (backends/torch/__init__.py's BUILDERS
names them): each takes a DrafterRequest already checked by kinds.require_built; those built
alike on every backend are made by backends/builder_table.py from the loader named here.

Knows: each kind's loader and what a target lends a head. Must not know: which kinds exist
beyond its table, or whether a kind runs on a target (kinds.check says).
"""

from __future__ import annotations

from typing import Any

from app.core.protocols import DrafterRequest
from backends.builder_table import draft_model_builder, head_builder, own_layers_builder
from backends.torch.backend import FOUR_BIT, QUANTIZED
from backends.torch.layer_choice import quantize_linears

draft_model = draft_model_builder("app.drafters.draft_model", "DraftModelDrafter")
mtp = own_layers_builder("backends.torch.head_weights.mtp", "load_mtp_drafter")
dflash = head_builder("backends.torch.head_weights.dflash", "load_dflash_drafter")
dspark = head_builder("backends.torch.head_weights.dspark", "load_dspark_drafter")
medusa = head_builder("backends.torch.head_weights.medusa", "load_medusa_drafter")
assistant = head_builder("backends.torch.head_weights.assistant", "load_assistant_drafter")


def eagle(request: DrafterRequest) -> Any:
    """An EAGLE-3 ("eagle3") or EAGLE-1/2 ("eagle") head from its folder, checked against the
    target; tree=True drafts EAGLE-2 dynamic trees."""
    from backends.heads.eagle_drafter import EagleDrafter, TargetParts
    from backends.heads.head_rows import CHAIN_MIN_CONFIDENCE
    from backends.torch.arrays import TorchArrays
    from backends.torch.head_weights.eagle import load_eagle_head

    target = request.target
    config = target.hf.config.get_text_config()
    head, spec = load_eagle_head(request.head, kind=request.kind, target_name=target.name,
                                 hidden_size=int(config.hidden_size),
                                 vocab_size=int(config.vocab_size),
                                 n_layers=target.n_layers, dtype=target.hf.dtype,
                                 device=target.device)
    if target.dtype in QUANTIZED:
        # a head's matmuls read their weights once per draft token, as the target's do:
        # int8 halves that traffic, and drafts need no exactness. 8 bits under int4 too:
        # the head is trained unquantized, and 4-bit head weights took first-draft
        # acceptance from 0.109 to 0.087 for one SmolLM2-135M head (spec-bench), though
        # not for a longer-trained one (0.112 either way)
        quantize_linears(head, "w8a8" if target.dtype in FOUR_BIT else target.dtype)
    hf = target.hf
    parts = TargetParts(hf.get_input_embeddings(), getattr(hf.model, "norm", None),
                        hf.get_output_embeddings(), int(target.vocab_size), target.n_layers)
    return EagleDrafter(head, spec, TorchArrays(target.device), parts, tree=request.tree,
                        min_confidence=CHAIN_MIN_CONFIDENCE)
