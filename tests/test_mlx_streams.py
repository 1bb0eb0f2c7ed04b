"""Batched streams on MLX: the scheduler steps every stream of an MLX target together and
each stream keeps its solo tokens. MLX models run no batched forward yet (README: each
stream's forward runs alone within the tick), so the claim here is the scheduler's, not a
kernel's."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("mlx_lm")

from app.core.engine import SpecEngine, last_done  # noqa: E402
from app.core.types import Done, SamplingParams  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from app.runtime.streams import Request, Streams, fork_engines  # noqa: E402
from backends.mlx.backend import MlxBackend  # noqa: E402

PROMPTS = ([5, 9, 12, 5, 9, 12, 5, 9], [7, 8, 7, 8, 7, 8, 7], [20, 21, 22, 23, 20, 21, 22])
KINDS = (("none", 0), ("ngram", 4), ("draft", 3))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_new_tokens=16),
                                    SamplingParams(temperature=1.0, seed=5, max_new_tokens=16)],
                         ids=["greedy", "seeded"])
def test_mlx_streams_under_load_give_their_solo_tokens(mlx_target, mlx_unrelated, params):
    backend = MlxBackend()

    def build(kind):
        return build_drafter(kind, mlx_target, backend=backend, draft=mlx_unrelated)

    streams = Streams(fork_engines(SpecEngine(mlx_target), len(PROMPTS)), build)
    requests = [streams.submit(Request(list(p), params, kind, k, "local", threading.Event()))
                for p, (kind, k) in zip(PROMPTS, KINDS)]
    for prompt, (kind, k), request in zip(PROMPTS, KINDS, requests):
        done = [e for e in request.events() if isinstance(e, Done)][-1]
        solo = last_done(SpecEngine(mlx_target).generate(
            prompt, params, drafter=None if kind == "none" else build(kind), k=k))
        assert done.error is None and done.token_ids == solo.token_ids, kind
    assert streams.batches > 0
