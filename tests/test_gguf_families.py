"""GGUF files of the sliding-window families run on their own blocks: a Gemma 3 file (norms
stored as llama.cpp stores them, 1 + w; rows scaled by sqrt(hidden) on the way in) and a
windowed Mistral compute what their source models compute past the window, and lookup
keeps plain decoding's tokens there."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as T

torch = pytest.importorskip("torch")

from app.core.engine import SpecEngine  # noqa: E402
from app.core.types import SamplingParams  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from backends.torch import gguf_model  # noqa: E402
from backends.torch.backend import TorchBackend  # noqa: E402
from tests.test_engine import oracle  # noqa: E402
from tests.tiny import save_gguf  # noqa: E402
from tests.tiny_families import WINDOW, tiny_family  # noqa: E402

pytestmark = pytest.mark.skipif(gguf_model.unavailable_reason() is not None,
                                reason=f"no GGUF kernel here: {gguf_model.unavailable_reason()}")
PROMPT = [5, 9, 12, 5, 9, 3, 7, 5, 9, 11, 13, 17, 19, 5, 9, 12]  # twice the window


@pytest.fixture(scope="module", params=["gemma3_text", "mistral"])
def pair(request, tmp_path_factory):
    source = tiny_family(request.param, seed=2)
    folder = tmp_path_factory.mktemp(request.param)
    # F32 matrices: computed in float32 end to end, so the twin's logits hold to rounding
    model = TorchBackend().load(str(save_gguf(source, folder / "model.gguf", int(T.F32))),
                                device="cpu", dtype="gguf")
    model.eos_token_ids = frozenset()
    return source, model


def test_a_windowed_gguf_computes_what_its_source_computes_past_the_window(pair):
    source, model = pair
    assert len(PROMPT) >= 2 * WINDOW
    ours = torch.as_tensor(model.start().forward(PROMPT, n_logits=len(PROMPT)).host_logits())
    theirs = torch.as_tensor(source.start().forward(PROMPT, n_logits=len(PROMPT)).host_logits())
    # a lost norm shift or embedding scale was off by 20-116%
    assert float((ours - theirs).norm() / theirs.norm()) < 1e-5
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_on_a_windowed_gguf_plain_is_the_oracle_and_lookup_keeps_it(pair):
    _, model = pair
    params = SamplingParams(max_new_tokens=24)
    plain = list(list(SpecEngine(model).generate(PROMPT, params))[-1].token_ids)
    assert plain == oracle(model, PROMPT, 24)
    drafter = build_drafter("ngram", model, backend=TorchBackend())
    done = list(SpecEngine(model).generate(PROMPT, params, drafter=drafter, k=4))[-1]
    assert list(done.token_ids) == plain
