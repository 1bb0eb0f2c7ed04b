"""What a target's own config declares about the drafting layers it carries: MTP layers, or
DeepSeek-V4's DSpark stages, which are recognised so that they are refused with the reason and
never taken for MTP layers.

Knows: the config keys (`num_nextn_predict_layers`, `mtp_num_hidden_layers`; DeepSeek-V4's
`dspark_block_size`, `dspark_target_layer_ids`, `dspark_markov_rank`, `dspark_noise_token_id`,
which sit beside `mtp.{0,1,2}.*` tensors: HEADS.md §11.4, SGLang's and vLLM's DeepSeek-V4
DSpark configs). Must not know: tensors, array libraries, drafters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DSPARK_PREFIX = "dspark_"


def _text(config: Mapping[str, Any]) -> Mapping[str, Any]:
    return config.get("text_config") or config


def has_dspark_stages(config: Mapping[str, Any]) -> bool:
    """Whether the config declares DeepSeek-V4 DSpark stages (its `mtp.*` tensors are then
    DSpark's, not MTP layers)."""
    return any(str(key).startswith(DSPARK_PREFIX) for key in _text(config))


def mtp_layers(config: Mapping[str, Any]) -> int:
    """The native MTP layers the config declares; 0 where they are DSpark stages."""
    text = _text(config)
    if has_dspark_stages(config):
        return 0
    return int(text.get("num_nextn_predict_layers") or text.get("mtp_num_hidden_layers") or 0)


def dspark_stages_refusal(name: str, config: Mapping[str, Any]) -> str:
    """Why the DSpark stages of a DeepSeek-V4 checkpoint do not run here, and the fix."""
    text = _text(config)
    stages = int(text.get("num_nextn_predict_layers") or text.get("n_mtp_layers") or 0)
    counted = f"{stages} " if stages else ""
    return (f"{name} carries DeepSeek-V4 DSpark stages ({counted}stages under mtp.*, block "
            f"{text.get('dspark_block_size', '?')}), not MTP layers: each stage is a full "
            "DeepSeek-V4 block with MoE experts and hyper-connections, which specdeck does not "
            "implement, and the checkpoint is far too large to run here; pick another drafter "
            "(e.g. --drafter ngram)")
