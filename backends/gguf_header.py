"""How finely a GGUF file stores its weights, and its architecture, read from its header in
milliseconds.

Knows: the GGUF header layout (magic, version, counts, typed key/value pairs), llama.cpp's
`general.file_type` numbers and `general.architecture`. Must not know: tensors (the gguf
package's reader parses every tensor's description, 46 s for the 1.5B Qwen on a busy 2-core
machine), backends, dtypes.

`--dtype auto` uses it so a model never runs coarser than its source: a Q4_K file may run
4-bit weights, a Q8_0 one 8-bit, an F16 one 16-bit.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

# general.file_type -> (name, bits per weight of its main tensors, llama.cpp's figures)
FILE_TYPES = {
    0: ("F32", 32.0), 1: ("F16", 16.0), 32: ("BF16", 16.0), 2: ("Q4_0", 4.5), 3: ("Q4_1", 5.0),
    7: ("Q8_0", 8.5), 8: ("Q5_0", 5.5), 9: ("Q5_1", 6.0), 10: ("Q2_K", 2.6),
    11: ("Q3_K_S", 3.4), 12: ("Q3_K_M", 3.9), 13: ("Q3_K_L", 4.3), 14: ("Q4_K_S", 4.6),
    15: ("Q4_K_M", 4.9), 16: ("Q5_K_S", 5.5), 17: ("Q5_K_M", 5.7), 18: ("Q6_K", 6.6),
}
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9


def file_type(path: Path) -> tuple[str, float] | None:
    """(name, bits per weight) of a GGUF's `general.file_type`; None when the file is not a
    GGUF, is damaged, or does not say."""
    value = header_value(path, "general.file_type")
    return FILE_TYPES.get(value, (f"type {value}", 0.0)) if isinstance(value, int) else None


def architecture(path: Path) -> str | None:
    """A GGUF's `general.architecture` (llama, qwen2, qwen35, gemma4 ...); None when the file
    is not a GGUF, is damaged, or does not say."""
    value = header_value(path, "general.architecture")
    return value if isinstance(value, str) else None


def header_value(path: Path, key: str) -> object:
    """One scalar or string of a GGUF's header (arrays read as None); None when the file is
    not a GGUF, is damaged, or lacks the key."""
    try:
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                return None
            version, _tensors, pairs = struct.unpack("<IQQ", f.read(20))
            if version < 2:
                return None
            for _ in range(pairs):
                name = read_string(f)
                value = read_value(f, struct.unpack("<I", f.read(4))[0])
                if name == key:
                    return value
    except (OSError, struct.error, ValueError, UnicodeDecodeError):
        return None
    return None


def read_string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    if length > 1 << 24:
        raise ValueError("implausible string length")
    return f.read(length).decode("utf-8")


def read_value(f: BinaryIO, kind: int) -> object:
    if kind == _STRING:
        return read_string(f)
    if kind == _ARRAY:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _SCALARS:  # skipped whole: token scores and types are long
            f.seek(count * struct.calcsize("<" + _SCALARS[item]), 1)
        else:
            for _ in range(count):
                read_value(f, item)
        return None
    if kind not in _SCALARS:
        raise ValueError(f"unknown GGUF value type {kind}")
    fmt = "<" + _SCALARS[kind]
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
