"""A drafter with another vocabulary is refused at load, naming both models and the difference."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from app.core.types import SpecdeckError
from app.drafters.draft_model import DraftModelDrafter
from app.drafters.pairing import check_vocab_compatible
from tests.tiny import tiny_llama


def renamed_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    words = {f"x{i}": i for i in range(vocab)}
    core = Tokenizer(models.WordLevel(words, unk_token="x0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="x0", eos_token="x1")


def test_same_tokenizer_with_padded_rows_is_accepted(target):
    padded = tiny_llama(seed=3, vocab=64)
    padded.tokenizer = target.tokenizer
    check_vocab_compatible(target, padded)


def test_other_token_texts_are_refused_naming_both_models(target):
    stranger = tiny_llama(seed=4)
    stranger.tokenizer = renamed_tokenizer(stranger.vocab_size)
    with pytest.raises(SpecdeckError) as error:
        DraftModelDrafter(target, stranger)
    message = str(error.value)
    assert target.name in message and stranger.name in message and "ids" in message


def test_a_much_larger_vocabulary_is_refused(target):
    big = tiny_llama(seed=5, vocab=2048)
    with pytest.raises(SpecdeckError, match="output sizes"):
        check_vocab_compatible(target, big)
