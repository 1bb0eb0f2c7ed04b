"""Where a head's training runs and how a trained head joins the installed pairs.

Knows: how TARGET names a target (path, catalogue model id, pair id), the work folder
SPECDECK_HOME/train/<name>/, and registration: the head's files are installed like a pulled
model (SPECDECK_HOME/models/<head id>/torch/, sha256 records and marker) and a pair
`<target id>+eagle3-trained` is written to the catalogue of trained heads
(SPECDECK_HOME/trained.yaml, which the registry reads after the shipped catalogue).
Must not know: array libraries, training.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from app.catalogue import registry
from app.catalogue.registry import ModelSpec
from app.core.types import SpecdeckError
from app.paths import home
from app.store import layout

BACKEND = "torch"  # training and its heads run on the torch backend
HEAD_SUFFIX = "-eagle3-trained"
PAIR_SUFFIX = "+eagle3-trained"
DEFAULT_K = 4


@dataclass(frozen=True)
class Target:
    path: Path
    model: ModelSpec | None  # the catalogue model, when the target is one
    name: str                # names the work folder


def resolve_target(target: str) -> Target:
    catalogue = registry.load_catalogue()
    path = Path(target).expanduser()
    if path.exists():
        return Target(path, _model_at(path, catalogue), _slug(path.name))
    model = (catalogue.pairs[target].target if target in catalogue.pairs
             else catalogue.models.get(target))
    if model is None:
        raise SpecdeckError(f"no target {target!r}: give an HF folder or .gguf file, or an "
                            "installed model or pair id from `specdeck models`")
    installed = layout.model_path(model, BACKEND)
    if installed is None:
        pairs = [p.id for p in catalogue.pairs.values() if p.target.id == model.id]
        raise SpecdeckError(f"{model.id} is not downloaded for torch: run `specdeck pull "
                            f"{pairs[0] if pairs else target}` first")
    return Target(installed, model, model.id)


def _model_at(path: Path, catalogue: registry.Catalogue) -> ModelSpec | None:
    """The catalogue model whose installed files these are (a path under SPECDECK_HOME)."""
    for model in catalogue.models.values():
        where = layout.model_path(model, BACKEND)
        if where is not None and where.resolve() == path.resolve():
            return model
    return None


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-.") or "target"


def work_dir(name: str) -> Path:
    return home() / "train" / name


def install_head(target: Target, folder: Path, summary: dict[str, Any]) -> tuple[str, Path]:
    """Install the head folder's files as model `<target>-eagle3-trained` and list the pair;
    returns (pair id, installed folder)."""
    assert target.model is not None
    model = target.model
    head_id, pair_id = model.id + HEAD_SUFFIX, model.id + PAIR_SUFFIX
    layout.remove(head_id, BACKEND)  # a new head replaces the earlier one
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    layout.install(head_id, BACKEND, [(folder / name, name, None) for name in files],
                   load=".", source="trained")
    config = json.loads((layout.model_dir(head_id, BACKEND) / "config.json").read_text())
    _write_entry(head_id, pair_id, model, config, int(summary["head_params"]))
    return pair_id, layout.model_dir(head_id, BACKEND)


def _write_entry(head_id: str, pair_id: str, model: ModelSpec, config: dict[str, Any],
                 params: int) -> None:
    path = home() / registry.TRAINED_CATALOGUE
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError:
        data = {}
    data.setdefault("models", {})[head_id] = {
        "name": f"EAGLE-3 head for {model.name} (trained here)", "family": model.family,
        "license": model.license, "params": params,
        "arch": {"layers": 1, "hidden": config["hidden_size"],
                 "heads": config["num_attention_heads"],
                 "kv_heads": config["num_key_value_heads"], "head_dim": config["head_dim"],
                 "vocab": config["draft_vocab_size"], "context": model.arch.context},
        "sources": {BACKEND: [{"local": {}, "format": "safetensors-bf16"}]}}
    data.setdefault("pairs", {})[pair_id] = {
        "name": f"{model.name} with its EAGLE-3 head trained here", "target": model.id,
        "drafter": {"kind": "eagle3", "model": head_id}, "k": DEFAULT_K,
        "backends": [BACKEND], "license": model.license}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    tmp.replace(path)
