"""EAGLE head folders, read without torch: config keys, tensor names, layer ids, target checks.

Knows: the published EAGLE-3 layouts (the authors' `midlayer.*`, SpecForge/HF `layers.0.*`
with or without its own `embed_tokens`, the vLLM `speculators` format) and EAGLE-1/2 (`fc`
over 2 x hidden, optional bias, the target's output layer); the two layer-index conventions
and the default layer rule (../shared/docs/HEADS.md 0.1, 1.1, 2.1). Must not know: torch,
how a head runs, the engine. Tensor names come from the safetensors header (8-byte length,
then JSON), so reading a folder costs no weight I/O; `.bin` pickles are refused (safetensors
only). Both backends' head loaders (torch here, backends/mlx/head_weights) read folders through this
module: it imports neither array library, so MLX-only installs import it too.

Layer ids are returned as HF hidden-state indices in the capture-before convention: id L is
the residual stream entering layer L (= the output of layer L - 1); `hs_ids` sorts them.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.core.types import SpecdeckError


@dataclass(frozen=True)
class EagleSpec:
    """What a head folder says about itself, in one convention whatever its layout.

    kind: "eagle3" or "eagle" (EAGLE-1/2). layout: "midlayer" (authors), "layers" (SpecForge/HF),
    "speculators" (vLLM) or "eagle1". prefix: the stored name prefix of the decoder layer.
    layer_ids: the ids as written (None: the default rule); ids_add_one: they name the output of
    a layer (SpecForge/SGLang convention) rather than the stream entering it.
    """

    kind: str
    layout: str
    name: str
    hidden_size: int
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str
    vocab_size: int  # the target's vocabulary (embedding rows)
    draft_vocab_size: int
    max_position_embeddings: int
    rope: dict[str, Any] = field(default_factory=dict)  # HF rope_parameters, rope_type included
    layer_ids: tuple[int, ...] | None = None
    ids_add_one: bool = False
    n_layers: int = 1  # decoder layers of the head (EAGLE-1 may have more than one)
    prefix: str = "midlayer."
    own_embed: bool = False
    fc_bias: bool = False
    attention_bias: bool = False  # q/k/v/o biases (Llama attention_bias)
    qkv_bias: bool = False  # q/k/v biases only (Qwen2 EAGLE-1 heads)
    qk_norm: bool = False  # per-head q/k RMSNorm (Qwen3 speculators heads)
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False
    verifier: str = ""  # the target the head names, if it does (speculators)
    weights: str = ""  # the safetensors file

    @property
    def n_features(self) -> int:
        """Target states concatenated into fc: 3 for EAGLE-3 unless the ids say otherwise."""
        return len(self.layer_ids) if self.layer_ids else 3

    def hs_ids(self, n_target_layers: int) -> tuple[int, ...]:
        """Sorted hidden-state indices (capture-before) this head reads from a target, one
        per fc input chunk (a 6-layer target's default rule names layer 3 twice)."""
        if self.kind == "eagle":
            return (n_target_layers,)  # final post-norm state (the caller applies the norm)
        if not self.layer_ids:
            n = n_target_layers
            return tuple(sorted((2, n // 2, n - 3)))  # repeats kept: fc reads three states
        shift = 1 if self.ids_add_one else 0
        return tuple(sorted(i + shift for i in self.layer_ids))


def read_eagle_spec(path: str | Path) -> EagleSpec:
    """The EagleSpec of a head folder; SpecdeckError naming the fix when it is not one."""
    folder = Path(path).expanduser()
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise SpecdeckError(f"{folder} is not an EAGLE head folder (no config.json): give "
                            "--draft the folder holding the head's config.json and safetensors")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        raise SpecdeckError(f"cannot read {config_file}: {error}") from error
    weights = folder / "model.safetensors"
    if not weights.is_file():
        hint = (" (it holds pytorch_model.bin: specdeck loads safetensors only; convert it with "
                "safetensors' save_file)") if (folder / "pytorch_model.bin").exists() else ""
        raise SpecdeckError(f"{folder} has no model.safetensors{hint}")
    names = frozenset(safetensors_names(weights))
    return _spec_from(config, names, folder.name, str(weights))


def head_kind(path: str | Path) -> str | None:
    """"eagle3" or "eagle" when the folder holds an EAGLE head, else None (a model, a file);
    reads config.json and the safetensors header only, never raises."""
    try:
        return read_eagle_spec(path).kind
    except (SpecdeckError, OSError, ValueError, KeyError, TypeError):
        return None


def safetensors_names(path: Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> {dtype, shape} from a safetensors header, without reading weights."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _spec_from(config: dict[str, Any], names: frozenset[str], name: str,
               weights: str) -> EagleSpec:
    if "speculators_model_type" in config:
        return _speculators_spec(config, names, name, weights)
    if any(n.startswith("midlayer.") for n in names) or "layers.0.hidden_norm.weight" in names:
        return _eagle3_spec(config, names, name, weights)
    if "fc.weight" in names and any(n.startswith("layers.0.") for n in names):
        return _eagle1_spec(config, names, name, weights)
    raise SpecdeckError(f"{name} is not an EAGLE head: its tensors have neither midlayer.* nor "
                        "layers.0.* with fc (is it a model rather than a head?)")


def _layer_common(llm: dict[str, Any], names: frozenset[str], prefix: str) -> dict[str, Any]:
    """Decoder-layer hyper-parameters from a Llama/Qwen-style config dict."""
    hidden = int(llm["hidden_size"])
    heads = int(llm["num_attention_heads"])
    return dict(
        hidden_size=hidden, num_heads=heads,
        num_kv_heads=int(llm.get("num_key_value_heads") or heads),
        head_dim=int(llm.get("head_dim") or hidden // heads),
        intermediate_size=int(llm["intermediate_size"]),
        rms_norm_eps=float(llm.get("rms_norm_eps", 1e-6)),
        hidden_act=str(llm.get("hidden_act", "silu")),
        vocab_size=int(llm["vocab_size"]),
        max_position_embeddings=int(llm.get("max_position_embeddings") or 2048),
        rope=_rope(llm),
        attention_bias=bool(llm.get("attention_bias", False)) or
        f"{prefix}self_attn.o_proj.bias" in names,
        qk_norm=f"{prefix}self_attn.q_norm.weight" in names,
        own_embed="embed_tokens.weight" in names,
    )


def _rope(llm: dict[str, Any]) -> dict[str, Any]:
    """HF rope_parameters: the head's own theta (Llama default 10000), scaling if any."""
    params = dict(llm.get("rope_parameters") or {})
    scaling = llm.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if k != "type"})
    params["rope_type"] = params.get("rope_type") or scaling.get("type") or "default"
    params["rope_theta"] = float(params.get("rope_theta") or llm.get("rope_theta") or 10000.0)
    return params


def _eagle3_spec(config: dict[str, Any], names: frozenset[str], name: str,
                 weights: str) -> EagleSpec:
    prefix = "midlayer." if any(n.startswith("midlayer.") for n in names) else "layers.0."
    _refuse_extra_layers(names, name)
    common = _layer_common(config, names, prefix)
    eagle = config.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise SpecdeckError(f"{name} reads the target's last state only (use_aux_hidden_state "
                            "false), a variant specdeck does not run: use a head with fc over "
                            "three layers")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    ids = tuple(int(i) for i in ids) if ids else None
    return EagleSpec(
        kind="eagle3", layout="midlayer" if prefix == "midlayer." else "layers", name=name,
        target_hidden_size=int(config.get("target_hidden_size") or common["hidden_size"]),
        draft_vocab_size=int(config.get("draft_vocab_size") or common["vocab_size"]),
        # SpecForge/SGLang name a layer's output; ids starting at >= 2 are boundary ids
        layer_ids=ids, ids_add_one=bool(ids) and ids[0] < 2, prefix=prefix,
        fc_bias="fc.bias" in names,
        norm_before_fc=bool(config.get("norm_before_fc", eagle.get("norm_before_fc", False))),
        fc_norm=bool(config.get("fc_norm") or config.get("use_aux_norm")),
        norm_output=bool(config.get("norm_output", False)),
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        weights=weights, **common)


def _speculators_spec(config: dict[str, Any], names: frozenset[str], name: str,
                      weights: str) -> EagleSpec:
    if config["speculators_model_type"] != "eagle3":
        raise SpecdeckError(f"{name} is a speculators {config['speculators_model_type']!r} "
                            "head: only eagle3 speculators heads load as --drafter eagle3")
    _refuse_extra_layers(names, name)
    llm = config.get("transformer_layer_config") or {}
    common = _layer_common(llm, names, "layers.0.")
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {})
    return EagleSpec(
        kind="eagle3", layout="speculators", name=name,
        target_hidden_size=int(config.get("target_hidden_size") or common["hidden_size"]),
        draft_vocab_size=int(config.get("draft_vocab_size") or common["vocab_size"]),
        layer_ids=tuple(int(i) for i in ids) if ids else None, ids_add_one=False,
        prefix="layers.0.", fc_bias="fc.bias" in names,
        norm_before_fc=bool(config.get("norm_before_fc", False)),
        fc_norm=bool(config.get("fc_norm", False)),
        norm_output=bool(config.get("norm_output", False)),
        # vLLM's reading of speculators configs: a missing key means True
        norm_before_residual=bool(config.get("norm_before_residual", True)),
        verifier=str(verifier.get("name_or_path") or ""), weights=weights, **common)


def _eagle1_spec(config: dict[str, Any], names: frozenset[str], name: str,
                 weights: str) -> EagleSpec:
    layers = {int(n.split(".")[1]) for n in names if n.startswith("layers.")}
    common = _layer_common(config, names, "layers.0.")
    return EagleSpec(
        kind="eagle", layout="eagle1", name=name,
        target_hidden_size=common["hidden_size"], draft_vocab_size=common["vocab_size"],
        n_layers=max(layers) + 1, prefix="layers.0.", fc_bias="fc.bias" in names,
        qkv_bias=bool(config.get("qkv_bias", False)) or "layers.0.self_attn.q_proj.bias" in names,
        weights=weights, **common)


def _refuse_extra_layers(names: frozenset[str], name: str) -> None:
    if any(n.startswith("layers.1.") for n in names):
        raise SpecdeckError(f"{name} has more than one EAGLE-3 decoder layer: specdeck runs "
                            "one-layer EAGLE-3 heads (the published ones)")


def checked_spec(path: str | Path, *, kind: str, target_name: str, hidden_size: int,
                 vocab_size: int, n_layers: int) -> EagleSpec:
    """The EagleSpec of a head folder, refused when it is not `kind` ("eagle3" or "eagle") or
    was built for another target (both named); each backend's loader starts here."""
    spec = read_eagle_spec(path)
    if spec.kind != kind:
        raise SpecdeckError(f"{spec.name} is an {spec.kind.upper()} head, not {kind}: "
                            f"use --drafter {spec.kind}")
    check_target(spec, target_name, hidden_size, vocab_size, n_layers)
    return spec


def module_name(stored: str, spec: EagleSpec) -> str | None:
    """The head module's name for a stored tensor (`layers.0.` is `midlayer.` for EAGLE-3);
    None for what the head does not use (a speculators save may keep its verifier's)."""
    if stored.startswith("verifier"):
        return None
    if spec.kind == "eagle3" and stored.startswith("layers.0."):
        return "midlayer." + stored.removeprefix("layers.0.")
    return stored


VOCAB_MAPS = ("d2t", "t2d")  # stored by heads with a draft vocabulary; absent: identity


def head_tensors(stored: dict[str, Any], spec: EagleSpec) -> dict[str, Any]:
    """A head file's tensors under the head module's names, those it does not use left out."""
    return {renamed: tensor for name, tensor in stored.items()
            if (renamed := module_name(name, spec)) is not None}


def check_tensor_names(spec: EagleSpec, wanted: set[str], stored: set[str]) -> None:
    """Refuse a file whose tensors are not the head's (the vocabulary maps may be absent)."""
    missing = sorted(wanted - stored - set(VOCAB_MAPS))
    unexpected = sorted(stored - wanted)
    if missing or unexpected:
        raise SpecdeckError(f"{spec.name}'s tensors do not match its config: missing "
                            f"{missing[:6]}, unexpected {unexpected[:6]}")


def check_vocab_map(spec: EagleSpec, lowest: int, highest: int, marked: int) -> None:
    """Refuse a damaged draft-vocabulary map: d2t sends draft ids to target ids lowest ..
    highest; t2d marks `marked` target ids (0: not stored)."""
    if lowest < 0 or highest >= spec.vocab_size:
        raise SpecdeckError(f"{spec.name}'s d2t maps draft ids outside the target vocabulary "
                            f"of {spec.vocab_size}: the head file is damaged")
    if spec.draft_vocab_size != spec.vocab_size and marked not in (0, spec.draft_vocab_size):
        raise SpecdeckError(f"{spec.name}'s t2d marks {marked} tokens but its draft "
                            f"vocabulary has {spec.draft_vocab_size}: damaged head file")


def check_target(spec: EagleSpec, target_name: str, hidden_size: int, vocab_size: int,
                 n_layers: int) -> None:
    """Refuse a head built for another target, naming both (hidden size, vocabulary, layers)."""
    problems = []
    if spec.target_hidden_size != hidden_size:
        problems.append(f"hidden size {spec.target_hidden_size} != {hidden_size}")
    if spec.vocab_size != vocab_size:
        problems.append(f"vocabulary {spec.vocab_size} != {vocab_size}")
    ids = spec.hs_ids(n_layers)
    if spec.kind == "eagle3" and (ids[0] < 1 or ids[-1] > n_layers or
                                  len(ids) != spec.n_features):
        problems.append(f"layers {list(ids)} do not fit a target of {n_layers} layers")
    if not spec.own_embed and spec.hidden_size != hidden_size:
        problems.append(f"the head ships no embedding and its width {spec.hidden_size} is not "
                        f"the target's {hidden_size}")
    if problems:
        named = f" (made for {spec.verifier})" if spec.verifier else ""
        raise SpecdeckError(f"the head {spec.name}{named} does not fit the target {target_name}: "
                            f"{'; '.join(problems)}. Use a head trained for {target_name}")


def new_eagle3_spec(name: str, *, target_hidden_size: int, vocab_size: int,
                    draft_vocab_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    intermediate_size: int, rms_norm_eps: float = 1e-6,
                    rope_theta: float = 10000.0, max_position_embeddings: int = 2048,
                    hidden_size: int | None = None, layer_ids: tuple[int, ...] | None = None,
                    own_embed: bool = False) -> EagleSpec:
    """The spec of a fresh EAGLE-3 head (authors' layout). layer_ids: capture-before hidden
    state ids; None = the default rule [2, N//2, N-3]."""
    return EagleSpec(
        kind="eagle3", layout="midlayer", name=name,
        hidden_size=hidden_size or target_hidden_size, target_hidden_size=target_hidden_size,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        intermediate_size=intermediate_size, rms_norm_eps=rms_norm_eps, hidden_act="silu",
        vocab_size=vocab_size, draft_vocab_size=draft_vocab_size,
        max_position_embeddings=max_position_embeddings,
        rope={"rope_type": "default", "rope_theta": float(rope_theta)},
        layer_ids=layer_ids, own_embed=own_embed)


def eagle3_config(spec: EagleSpec) -> dict[str, Any]:
    """config.json of the authors' layout. Layer ids, when not the default rule, are written
    in SpecForge's output-of-layer convention (id - 1) under eagle_config, which SGLang reads
    as such; vLLM reads those ids as boundaries, so heads on default layers write none."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "num_hidden_layers": 1, "rms_norm_eps": spec.rms_norm_eps,
        "hidden_act": spec.hidden_act, "vocab_size": spec.vocab_size,
        "draft_vocab_size": spec.draft_vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope.get("rope_theta", 10000.0), "tie_word_embeddings": False,
        "attention_bias": spec.attention_bias,
    }
    if spec.target_hidden_size != spec.hidden_size:
        config["target_hidden_size"] = spec.target_hidden_size
    if spec.layer_ids:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": _written_ids(spec)}
    return config


def _written_ids(spec: EagleSpec) -> list[int]:
    """Ids that read back to the same layers under read_eagle_spec's rule (and SGLang PR
    #25454's): output-of-layer ids when the first is below 2, boundary ids otherwise."""
    boundary = sorted(i + 1 if spec.ids_add_one else i for i in (spec.layer_ids or ()))
    return [i - 1 for i in boundary] if boundary[0] - 1 < 2 else boundary
