"""The MLX backend's drafter builders, one a kind (backends/mlx/__init__.py's BUILDERS names
them): each takes a DrafterRequest already checked by kinds.require_built.

Knows: each kind's loader and what a target lends a head. Must not know: which kinds exist
beyond its table, or whether a kind runs on a target (kinds.check says).
"""

from __future__ import annotations

from typing import Any

from app.core.protocols import DrafterRequest


def draft_model(request: DrafterRequest) -> Any:
    from backends.mlx.drafters import DraftModelDrafter

    return DraftModelDrafter(request.target, request.draft, vocab_limit=request.vocab_limit)


def mtp(request: DrafterRequest) -> Any:
    """The target's own MTP layers (a SpecdeckError when it has none)."""
    from backends.mlx.heads.mtp import load_mtp_drafter

    return load_mtp_drafter(request.target)


def dflash(request: DrafterRequest) -> Any:
    from backends.mlx.heads.dflash import load_dflash_drafter

    return load_dflash_drafter(request.target, request.head)


def dspark(request: DrafterRequest) -> Any:
    from backends.mlx.heads.dspark import load_dspark_drafter

    return load_dspark_drafter(request.target, request.head)


def medusa(request: DrafterRequest) -> Any:
    from backends.mlx.heads.medusa import load_medusa_drafter

    return load_medusa_drafter(request.target, request.head)


def eagle(request: DrafterRequest) -> Any:
    """An EAGLE-3 or EAGLE-1/2 head from its folder, checked against the target; tree=True
    drafts EAGLE-2 dynamic trees, which the target verifies through backends/mlx/tree.py."""
    from backends.heads.eagle_drafter import EagleDrafter, TargetParts
    from backends.heads.head_rows import CHAIN_MIN_CONFIDENCE
    from backends.mlx.arrays import MlxArrays
    from backends.mlx.backend import _stored_dtype
    from backends.mlx.heads.eagle import load_eagle_head, target_parts

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
