"""Streaming text never splits a UTF-8 character and adds up to the full decode."""

from __future__ import annotations

import pytest
from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from app.core.text import IncrementalDetokenizer

CORPUS = ["def add(a, b):\n    return a + b", "héllo wörld ünïcode", "plain ascii text here"]


@pytest.fixture(scope="module")
def byte_tokenizer() -> PreTrainedTokenizerFast:
    core = ByteLevelBPETokenizer()
    core.train_from_iterator(CORPUS, vocab_size=300, min_frequency=1)
    return PreTrainedTokenizerFast(tokenizer_object=core._tokenizer)


@pytest.mark.parametrize("text", ["naïve café 😀 done", "日本語のテキスト", "a + b\n\tif x: 🎉🎉"])
def test_deltas_never_hold_a_broken_character_and_sum_to_the_decode(byte_tokenizer, text):
    ids = byte_tokenizer.encode(text)
    assert len(ids) > len(text) // 2, "the tokenizer should split multi-byte characters"
    detok = IncrementalDetokenizer(byte_tokenizer)
    deltas = [detok.push([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == byte_tokenizer.decode(ids) == text


def test_pushing_several_tokens_at_once_gives_the_same_text(byte_tokenizer):
    ids = byte_tokenizer.encode("héllo 😀 wörld")
    detok = IncrementalDetokenizer(byte_tokenizer)
    text = "".join(detok.push(ids[i:i + 3]) for i in range(0, len(ids), 3)) + detok.flush()
    assert text == "héllo 😀 wörld"
