"""Stop strings end a generation exactly where they appear; streamed text never leaks them."""

from __future__ import annotations

from app.core.engine import SpecEngine
from app.core.types import Done, SamplingParams, Step
from app.drafters.ngram import NgramDrafter

PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9]


def generate(engine: SpecEngine, **params) -> tuple[str, Done]:
    events = list(engine.generate(PROMPT, SamplingParams(**params)))
    streamed = "".join(e.text for e in events if isinstance(e, Step))
    return streamed, events[-1]


def test_a_stop_string_cuts_the_text_before_it_and_stops(target):
    free_text, free = generate(SpecEngine(target), max_new_tokens=20)
    words = free_text.split()
    stop = f"{words[3]} {words[4]}"
    for k in (1, 4):
        streamed, done = generate(SpecEngine(target, NgramDrafter(), k=k), max_new_tokens=20,
                                  stop=(stop,))
        assert done.stop_reason == "stop_string"
        assert done.text == free_text[:free_text.index(stop)]
        assert streamed == done.text, "the stop string must never be streamed"
        assert list(done.token_ids) == list(free.token_ids[:len(done.token_ids)])


def test_streamed_text_adds_up_to_the_final_text(target):
    streamed, done = generate(SpecEngine(target, NgramDrafter(), k=3), max_new_tokens=25,
                              stop=("never appears",))
    assert done.stop_reason == "length"
    assert streamed == done.text and len(done.text) > 0
