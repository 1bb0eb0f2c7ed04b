"""The Medusa head folder (FasterDecoding/Medusa), read once for every backend.

Knows: the published tensor names (Medusa-1 `medusa_lm_head` files: `{i}.0.linear.weight`,
`{i}.0.linear.bias`, `{i}.{L}.weight`; Medusa-2 full models: the same under `medusa_head.`),
`medusa_num_layers` in config.json, that a `.pt` is a pickle specdeck never loads, and the
checks against a target given as numbers. Must not know: any array library, the head math
(backends/heads/medusa_drafter.py), drafting.

Only the safetensors headers are read here (names and shapes, with safetensors' numpy
framework): numpy has no bfloat16, and a Medusa-2 file holds the whole base model, so each
backend reads just the head tensors `MedusaSpec.sources` names, with its own reader.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.core.types import SpecdeckError

MEDUSA_2_PREFIX = "medusa_head."


@dataclass(frozen=True)
class MedusaSpec:
    """A checked head folder: n heads of `n_layers` shared ResBlocks, and where each of the
    modules' tensors is stored: (module name, file, stored name)."""

    path: Path
    n_heads: int
    n_layers: int
    sources: tuple[tuple[str, Path, str], ...]


def module_names(n_heads: int) -> tuple[str, ...]:
    """The weight modules' parameter names (each backend's module holds exactly these)."""
    return tuple(name for i in range(n_heads)
                 for name in (f"blocks.{i}.weight", f"blocks.{i}.bias", f"heads.{i}.weight"))


def read_medusa(path: str | Path, *, hidden: int, vocab: int) -> MedusaSpec:
    """Heads from a folder (or file): safetensors with Medusa-1 or Medusa-2 names, checked
    against the target's hidden size and vocabulary."""
    path = Path(path).expanduser()
    folder = path if path.is_dir() else path.parent
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        pt = folder / "medusa_lm_head.pt"
        hint = (f" ({pt.name} is a pickle, which specdeck never loads: save its state dict "
                "as medusa_lm_head.safetensors with safetensors.torch.save_file)"
                if pt.exists() else "")
        raise SpecdeckError(f"no Medusa heads in {path}: give a folder with safetensors "
                            f"files{hint}")
    layers = int(_config(folder).get("medusa_num_layers", 1))
    stored = _head_shapes(files)
    n_heads = len({k.split(".")[0] for k in stored if k.endswith(f".{layers}.weight")})
    if n_heads == 0:
        raise SpecdeckError(f"{path} has no Medusa head tensors ('{{i}}.{layers}.weight' or "
                            f"'{MEDUSA_2_PREFIX}{{i}}.{layers}.weight'); is it a Medusa head?")
    found = {ours: stored[_present(path, ours, layers, stored)]
             for ours in module_names(n_heads)}
    _check_target(path, found["heads.0.weight"][2], hidden, vocab)
    wrong = [f"{stored_name} {shape} != {_expected(ours, hidden, vocab)}"
             for ours, (_, stored_name, shape) in found.items()
             if shape != _expected(ours, hidden, vocab)]
    if wrong:
        raise SpecdeckError(f"{path}: these Medusa heads' tensors do not fit together: "
                            f"{wrong[:3]}")
    return MedusaSpec(path, n_heads, layers,
                      tuple((ours, file, name) for ours, (file, name, _) in found.items()))


def _present(path: Path, ours: str, layers: int, stored: dict[str, Any]) -> str:
    """The published name of a module parameter, refused when the files lack it. The
    reference repeats ONE ResBlock L times, so block 0's tensors are every layer's."""
    part, head, kind = ours.split(".")
    theirs = f"{head}.0.linear.{kind}" if part == "blocks" else f"{head}.{layers}.weight"
    if theirs not in stored:
        raise SpecdeckError(f"{path}: Medusa head {head} lacks {theirs}")
    return theirs


def _expected(ours: str, hidden: int, vocab: int) -> tuple[int, ...]:
    """A module parameter's shape on a target of these sizes."""
    part, _, kind = ours.split(".")
    if part == "heads":
        return (vocab, hidden)
    return (hidden, hidden) if kind == "weight" else (hidden,)


def _head_shapes(files: list[Path]) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """Published name -> (file, stored name, shape) of every head tensor in the files."""
    from safetensors import safe_open

    found: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            for key in f.keys():
                name = key.removeprefix(MEDUSA_2_PREFIX)
                if name.split(".")[0].isdigit():
                    found[name] = (file, key, tuple(f.get_slice(key).get_shape()))
    return found


def _config(folder: Path) -> dict[str, Any]:
    file = folder / "config.json"
    if not file.exists():
        return {}
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except ValueError as error:
        raise SpecdeckError(f"cannot read {file}: {error}") from error


def _check_target(path: Path, head: tuple[int, ...], hidden: int, vocab: int) -> None:
    """head: the shape of head 0's vocabulary projection [vocab, hidden]."""
    if head[1] != hidden:
        raise SpecdeckError(f"{path}: these Medusa heads read hidden size {head[1]}, the "
                            f"target has {hidden}: they were trained for another target")
    if head[0] != vocab:
        raise SpecdeckError(f"{path}: these Medusa heads predict {head[0]} tokens, the "
                            f"target's vocabulary has {vocab}: they were trained for another "
                            "target")
