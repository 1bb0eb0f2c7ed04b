"""llama.cpp adapter: a GGUF target (or draft model) on llama.cpp's kernels, through
llama-cpp-python's low-level API, under specdeck's engine, drafters and sampling.

Knows: llama.cpp's C API as llama-cpp-python binds it (a model, a context per session, a
batch with logits for chosen rows, KV removal by position), the GGUF's tokenizer as
transformers reads it (so token ids are the torch backend's), and the load-time check that
keeps verification lossless. Must not know: drafting or verification rules (app/), sampling
(app/core/sampling.py samples from the host logits, as on the other backends).

Lossless: plain decoding feeds one row per forward, a verify k + 1. llama.cpp may pick other
kernels for more rows (repacked weights run a gemm from 4 rows up), so at load the model
reads 320 tokens, decodes a few more one by one and then as blocks of 2..MAX_BLOCK rows, and
the largest block size whose every row has the same bits as alone is what a verify is split
into (on the 2-core Xeon: 1 row, so llama.cpp verifies row by row and speculation rarely pays).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp as ll
import numpy as np

from app.core.protocols import TargetOutput, collect_eos_ids
from app.core.types import SpecdeckError
from app.drafters.kinds import require_built
from backends.llamacpp import RUNS

MAX_CONTEXT = 32768  # KV cache tokens at most (the 1.5B Qwen's full 32k: 0.9 GB in f16)
PREFILL_BATCH = 512  # tokens per llama_decode while reading a prompt
MAX_BLOCK = 9  # verify rows checked at load (k <= 8); longer verifies are split
# any ids: the check compares the model to itself. Long: rows of one forward matched their
# one-row bits after 8 tokens but not after 300 (1.5B Qwen; llama.cpp's attention over a
# longer cache takes another path for several query rows), so the check reads 320
CHECK_PROMPT = tuple((i * 131 + 7) % 30000 + 10 for i in range(320))


@ll.llama_log_callback
def _quiet(level: int, text: bytes, user_data: Any) -> None:
    """llama.cpp logs every load to stderr; errors still surface as return codes."""


_READY = False


def _init_once() -> None:
    global _READY
    if not _READY:
        ll.llama_backend_init()
        ll.llama_log_set(_quiet, ctypes.c_void_p())
        _READY = True


def _threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


class LlamaCppSession:
    """One llama.cpp context (its own KV cache) over one token sequence."""

    def __init__(self, model: LlamaCppModel, exact: bool) -> None:
        self._model = model
        params = ll.llama_context_default_params()
        params.n_ctx = model.context_length
        params.n_batch = params.n_ubatch = PREFILL_BATCH
        params.n_threads = params.n_threads_batch = _threads()
        params.no_perf = True
        self._ctx = ll.llama_init_from_model(model.handle, params)
        if not self._ctx:
            raise SpecdeckError(f"llama.cpp could not create a context of "
                                f"{model.context_length} tokens for {model.name}: free memory "
                                "or use a smaller model")
        self._memory = ll.llama_get_memory(self._ctx)
        self._batch = ll.llama_batch_init(PREFILL_BATCH, 0, 1)
        self._ids: list[int] = []
        self._block = model.row_block if exact else PREFILL_BATCH

    def __del__(self) -> None:
        if getattr(self, "_ctx", None):
            ll.llama_batch_free(self._batch)
            ll.llama_free(self._ctx)
            self._ctx = None

    @property
    def length(self) -> int:
        return len(self._ids)

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._ids)

    def forward(self, token_ids: Sequence[int], n_logits: int = 1,
                parents: Sequence[int] | None = None,
                capture: Sequence[int] = ()) -> TargetOutput:
        if parents is not None and tuple(parents) != tuple(range(-1, len(token_ids) - 1)):
            raise SpecdeckError("the llama.cpp backend verifies chains only (no tree attention)")
        if capture:
            raise SpecdeckError("the llama.cpp backend does not capture hidden states: EAGLE, "
                                "MTP and other heads need --backend torch")
        ids = [int(t) for t in token_ids]
        if self.length + len(ids) > self._model.context_length:
            raise SpecdeckError(f"{self.length + len(ids)} tokens do not fit {self._model.name}'s "
                                f"context of {self._model.context_length}: shorten the prompt "
                                "or start a new chat")
        n_logits = min(max(n_logits, 1), len(ids))
        # a verify is split into blocks of the size checked exact at load; a prompt is read
        # in PREFILL_BATCH chunks (plain and speculative decoding read it the same way)
        verify = len(ids) <= MAX_BLOCK
        size = self._block if verify else PREFILL_BATCH
        rows: list[np.ndarray] = []
        for start in range(0, len(ids), size):
            part = ids[start:start + size]
            first_out = len(ids) - n_logits - start  # index in part of the first scored row
            rows.extend(self._decode(part, max(first_out, 0)))
        logits = np.concatenate(rows) if len(rows) > 1 else rows[0]
        argmax = tuple(int(i) for i in logits.argmax(-1))
        return TargetOutput(argmax=argmax, logits_fn=lambda: logits)

    def _decode(self, part: list[int], first_out: int) -> list[np.ndarray]:
        """Append part; [rows, vocab] logits of its rows from first_out on (none if past it)."""
        batch, base = self._batch, self.length
        for i, token in enumerate(part):
            batch.token[i] = token
            batch.pos[i] = base + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = int(i >= first_out)
        batch.n_tokens = len(part)
        code = ll.llama_decode(self._ctx, batch)
        if code != 0:
            ll.llama_memory_seq_rm(self._memory, 0, base, -1)  # nothing half-appended stays
            raise SpecdeckError(f"llama.cpp could not decode {len(part)} tokens at position "
                                f"{base} of {self._model.name} (code {code}"
                                f"{': no room in its KV cache' if code == 1 else ''})")
        self._ids.extend(part)
        n_out = len(part) - min(first_out, len(part))
        if n_out == 0:
            return []
        vocab = self._model.vocab_size
        pointer = ll.llama_get_logits(self._ctx)
        return [np.ctypeslib.as_array(pointer, shape=(n_out, vocab)).copy()]

    def keep(self, length: int, rows: Sequence[int]) -> None:
        if tuple(rows) != tuple(range(len(rows))):
            raise SpecdeckError("the llama.cpp backend keeps chain prefixes only")
        self.rewind(length + len(rows))

    def rewind(self, length: int) -> None:
        if length < 0 or length > self.length:
            raise ValueError(f"cannot rewind a cache of {self.length} tokens to {length}")
        if length < self.length:
            ll.llama_memory_seq_rm(self._memory, 0, length, -1)
            del self._ids[length:]


class LlamaCppModel:
    """A GGUF loaded by llama.cpp, with the tokenizer transformers reads from the same file."""

    def __init__(self, path: Path, tokenizer: Any = None, repack: bool = True) -> None:
        _init_once()
        params = ll.llama_model_default_params()
        params.use_extra_bufts = repack
        self.handle = ll.llama_model_load_from_file(str(path).encode(), params)
        if not self.handle:
            raise SpecdeckError(f"llama.cpp could not load {path}: the file is not a GGUF it "
                                "reads (a partial download? run specdeck pull --verify)")
        self.path = path
        self.name = path.name.removesuffix(".gguf")
        self.tokenizer = tokenizer if tokenizer is not None else _tokenizer(path)
        vocab = ll.llama_model_get_vocab(self.handle)
        self.vocab_size = int(ll.llama_vocab_n_tokens(vocab))
        self.eos_token_ids = collect_eos_ids(
            self.tokenizer.eos_token_id,
            [t for t in (ll.llama_vocab_eos(vocab), ll.llama_vocab_eot(vocab)) if t >= 0])
        self.context_length = min(int(ll.llama_model_n_ctx_train(self.handle)), MAX_CONTEXT)
        self.n_layers = int(ll.llama_model_n_layer(self.handle))
        self.capabilities = RUNS.capabilities
        self.device = "cpu"
        self.dtype = "gguf"
        self.row_block = MAX_BLOCK

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            ll.llama_model_free(self.handle)
            self.handle = None

    def start(self, capture_layers: Sequence[int] = (), exact: bool = True) -> LlamaCppSession:
        if capture_layers:
            raise SpecdeckError("the llama.cpp backend does not capture hidden states: EAGLE, "
                                "MTP and other heads need --backend torch")
        return LlamaCppSession(self, exact)

    def weights_bytes(self) -> int:
        return int(ll.llama_model_size(self.handle))

    def peak_memory_bytes(self) -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def check_exactness(self) -> int:
        """The largest verify block (1..MAX_BLOCK rows) whose rows have the bits of plain
        one-row decoding on this CPU; also kept as `row_block`."""
        prompt = [t % self.vocab_size for t in CHECK_PROMPT]
        tail = [(t * 7 + 3) % self.vocab_size for t in range(MAX_BLOCK)]
        session = LlamaCppSession(self, exact=False)
        session.forward(prompt)
        alone = [session.forward([t]).host_logits()[0] for t in tail]
        block = 1
        for m in range(2, MAX_BLOCK + 1):
            session.rewind(len(prompt))
            rows = session.forward(tail[:m], n_logits=m).host_logits()
            if not all(np.array_equal(rows[i], alone[i]) for i in range(m)):
                break
            block = m
        self.row_block = block
        return block


class LlamaCppBackend:
    """Loads .gguf files with llama.cpp; draft models run on it too."""

    name = "llamacpp"
    runs = RUNS

    def load(self, path: str, device: str = "auto", dtype: str = "auto") -> LlamaCppModel:
        if device not in ("auto", "cpu"):
            raise SpecdeckError(f"the llama.cpp backend runs on the CPU here (got --device "
                                f"{device}); use --backend torch for {device}")
        if dtype not in ("auto", "gguf"):
            raise SpecdeckError(f"the llama.cpp backend runs a GGUF's own quantization (got "
                                f"--dtype {dtype}); use --dtype auto, or --backend torch")
        gguf = _gguf_file(Path(path))
        model = LlamaCppModel(gguf)
        if model.check_exactness() < 2:
            # repacked weights are one cause (their gemm and gemv sum differently); unpacked
            # ones cost more per row, so they are kept only where they verify in larger blocks
            unpacked = LlamaCppModel(gguf, model.tokenizer, repack=False)
            if unpacked.check_exactness() > model.row_block:
                model = unpacked
        return model

    def make_drafter(self, kind: str, target: LlamaCppModel, *,
                     draft: LlamaCppModel | None = None, head: str | None = None,
                     tree: bool = False, vocab_limit: int = 0) -> Any:
        """A draft model's drafter ("draft"); heads are refused by the check (its targets
        return logits only)."""
        require_built(kind, self.runs, capabilities=target.capabilities, tree=tree,
                      has_draft=draft is not None, has_head=bool(head), target=target.name)
        from app.drafters.draft_model import DraftModelDrafter
        return DraftModelDrafter(target, draft, vocab_limit=vocab_limit)


def _gguf_file(path: Path) -> Path:
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if not found:
            raise SpecdeckError(f"{path} holds no .gguf file: the llama.cpp backend loads GGUF "
                                "only; use --backend torch for other formats")
        path = found[0]
    if path.suffix != ".gguf" or not path.is_file():
        raise SpecdeckError(f"{path} is not a .gguf file: the llama.cpp backend loads GGUF "
                            "only; use --backend torch for other formats")
    return path


def _tokenizer(gguf: Path) -> Any:
    """The GGUF's tokenizer as transformers reads it (the torch backend's ids). Reading it from
    the GGUF took 14.5 s for the 1.5B Qwen, so it is kept in a folder next to the file
    (`<file>.gguf.specdeck-tokenizer/`), used while the GGUF keeps its size and mtime; the
    torch backend's converted folder serves as well when it is fresh."""
    from transformers import AutoTokenizer

    from backends.gguf import converted_path

    for folder in (converted_path(gguf), tokenizer_path(gguf)):
        if (folder / "tokenizer_config.json").is_file() and _fresh(folder, gguf):
            return AutoTokenizer.from_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _keep(tokenizer, gguf)
    return tokenizer


TOKENIZER_SUFFIX = ".specdeck-tokenizer"
_STAT = ".specdeck-source.json"  # the converted folder's record has the same name


def tokenizer_path(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + TOKENIZER_SUFFIX)


def _stat_of(gguf: Path) -> dict[str, int]:
    st = gguf.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _fresh(folder: Path, gguf: Path) -> bool:
    """Whether the folder was made from the GGUF as it is now (same size and mtime; the
    converted folder's record holds them too)."""
    try:
        seen = json.loads((folder / _STAT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    now = _stat_of(gguf)
    return all(seen.get(key) == value for key, value in now.items())


def _keep(tokenizer: Any, gguf: Path) -> None:
    """Save the tokenizer next to the GGUF; it appears by rename only when complete. A
    read-only or full disk only costs the next load the same 15 s."""
    dest = tokenizer_path(gguf)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    try:
        tokenizer.save_pretrained(str(tmp))
        (tmp / _STAT).write_text(json.dumps(_stat_of(gguf)), encoding="utf-8")
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
