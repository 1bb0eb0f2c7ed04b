"""The prompt scripts behind `train-head` data: what they write must be valid, repeatable text."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

_SENTINEL = object()


def _code_prompts():
    path = Path(__file__).parents[1] / "scripts" / "code_prompts.py"
    spec = importlib.util.spec_from_file_location("code_prompts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documented(a, b=2):
    """Add two numbers.

    Returns their sum."""
    return a + b


def with_sentinel(a, timeout=_SENTINEL):
    """Wait for a.

    The default is an object whose repr carries a memory address."""
    return a, timeout


def test_a_documented_function_becomes_a_prompt_that_parses_as_python():
    text = _code_prompts().prompt_for("documented", documented)
    assert text.startswith("def documented(a, b=2):")
    ast.parse(text + "    pass\n")


def test_a_default_printed_with_its_memory_address_is_left_out():
    assert _code_prompts().prompt_for("with_sentinel", with_sentinel) is None
