"""The MLX backend's drafter builders, one a kind (backends/mlx/__init__.py's BUILDERS names
them): each takes a DrafterRequest already checked by kinds.require_built; those built alike
on every backend are made by backends/builder_table.py from the loader named here.

Knows: each kind's loader and what a target lends a head. Must not know: which kinds exist
beyond its table, or whether a kind runs on a target (kinds.check says).
"""

from __future__ import annotations

from typing import Any

from app.core.protocols import DrafterRequest
from backends.builder_table import draft_model_builder, head_builder, own_layers_builder

draft_model = draft_model_builder("backends.mlx.drafters", "DraftModelDrafter")
mtp = own_layers_builder("backends.mlx.head_weights.mtp", "load_mtp_drafter")
dflash = head_builder("backends.mlx.head_weights.dflash", "load_dflash_drafter")
dspark = head_builder("backends.mlx.head_weights.dspark", "load_dspark_drafter")
medusa = head_builder("backends.mlx.head_weights.medusa", "load_medusa_drafter")
assistant = head_builder("backends.mlx.head_weights.assistant", "load_assistant_drafter")


def eagle(request: DrafterRequest) -> Any:
    """An EAGLE-3 or EAGLE-1/2 head from its folder, checked against the target; tree=True
    drafts EAGLE-2 dynamic trees, which the target verifies through backends/mlx/tree.py."""
    from backends.heads.eagle_drafter import EagleDrafter, TargetParts
    from backends.heads.head_rows import CHAIN_MIN_CONFIDENCE
    from backends.mlx.arrays import MlxArrays
    from backends.mlx.backend import _stored_dtype
    from backends.mlx.head_weights.eagle import load_eagle_head, target_parts

    target = request.target
    embed, final_norm, output = target_parts(target.net, target.name)
    head, spec = load_eagle_head(request.head, kind=request.kind, target_name=target.name,
                                 hidden_size=int(final_norm.weight.shape[-1]),  # never quantized
                                 vocab_size=target.vocab_size,
                                 n_layers=target.n_layers,
                                 dtype=_stored_dtype(target.net))
    parts = TargetParts(embed, final_norm, output, int(target.vocab_size), target.n_layers)
    return EagleDrafter(head, spec, MlxArrays(target.stream), parts, tree=request.tree,
                        min_confidence=CHAIN_MIN_CONFIDENCE)
