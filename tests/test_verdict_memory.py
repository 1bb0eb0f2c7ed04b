"""`specdeck bench --streams`' memory columns count a stream as the planner and serve count it:
a windowed target (a tiny Gemma 3: 3 sliding layers of window 8, 1 full) keeps every token
in its full layer and the window in the others, a hybrid one (a tiny Qwen3.5: 3 Gated DeltaNet
layers, 1 full attention) its attention layer's KV and a fixed recurrent state; the draft
model adds its own KV per token; without a config every layer's KV per token times the
tokens stands, as before. The expected bytes are worked out by hand from the tiny configs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from app.bench import verdict  # noqa: E402
from app.bench.verdict import Memory, memory_of  # noqa: E402
from tests.tiny import save_hf_folder, tiny_llama  # noqa: E402
from tests.tiny_families import WINDOW, tiny_family  # noqa: E402

ROW = 2 * 8 * 2 * 4  # one layer's K and V of one token: 2 kv heads x head dim 8, float32
CONTEXT = 200
# a Gated DeltaNet layer's state, float32: the recurrent 4 value heads x 8 x 8, the conv
# 4 taps over 2 x 16 key + 32 value channels
DELTANET_STATE = (4 * 8 * 8 + 4 * (2 * 16 + 32)) * 4


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    model = tiny_family("gemma3_text")
    return model, str(save_hf_folder(model, tmp_path_factory.mktemp("gemma3") / "gemma3"))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    model = tiny_family("qwen3_5_text")
    return model, str(save_hf_folder(model, tmp_path_factory.mktemp("qwen3_5") / "qwen3_5"))


def test_a_windowed_target_serves_more_streams_than_its_per_token_kv_says(windowed):
    model, folder = windowed
    stream = ROW * (CONTEXT + 3 * WINDOW)  # the full layer's every token, 3 windows
    room = 4 * model.kv_bytes_per_token() * CONTEXT  # 4 streams by every layer per token
    memory = memory_of(model, None, room, CONTEXT, path=folder, backend="torch")
    assert memory == Memory(servable_context=model.context_length,
                            max_streams=room // stream, context=CONTEXT)
    assert memory.max_streams == 14 > 4


def test_a_windowed_targets_longest_stream_ends_where_its_full_layer_fills_the_room(windowed):
    model, folder = windowed
    room = 20_000
    memory = memory_of(model, None, room, CONTEXT, path=folder, backend="torch")
    longest = room // ROW - 3 * WINDOW  # ROW x (tokens + 3 x WINDOW) <= room
    assert memory.servable_context == longest == 132
    assert room // model.kv_bytes_per_token() == 39  # what every layer per token allowed


def test_a_hybrid_target_serves_streams_of_its_attention_kv_and_recurrent_state(hybrid):
    model, folder = hybrid
    stream = ROW * CONTEXT + 3 * DELTANET_STATE
    room = 1_000_000
    memory = memory_of(model, None, room, CONTEXT, path=folder, backend="torch")
    assert memory.max_streams == room // stream == 31
    assert room // (model.kv_bytes_per_token() * CONTEXT) == 9
    tight = memory_of(model, None, 30_000, CONTEXT, path=folder, backend="torch")
    assert tight.servable_context == (30_000 - 3 * DELTANET_STATE) // ROW == 186


def test_the_draft_models_own_kv_per_token_counts_beside_the_targets_stream(windowed):
    model, folder = windowed
    draft = tiny_llama(seed=2)
    room = 1_000_000
    memory = memory_of(model, draft, room, CONTEXT, path=folder, backend="torch")
    stream = ROW * (CONTEXT + 3 * WINDOW) + draft.kv_bytes_per_token() * CONTEXT
    assert memory.max_streams == room // stream < room // (ROW * (CONTEXT + 3 * WINDOW))


@pytest.mark.parametrize("path", [None, "/nonexistent/folder"], ids=["none", "unreadable"])
def test_without_a_config_every_layers_kv_per_token_times_the_tokens_stands(windowed, path):
    model, _ = windowed
    per_token, room = model.kv_bytes_per_token(), 20_000
    memory = memory_of(model, None, room, CONTEXT, path=path, backend="torch")
    assert memory == Memory(servable_context=room // per_token,
                            max_streams=room // (per_token * CONTEXT), context=CONTEXT)
    assert memory_of(model, None, None, CONTEXT, path=path, backend="torch") is None


def test_the_benchs_sources_count_the_pairs_target_by_its_config(windowed, monkeypatch):
    from app.pair import LoadSpec, Pair

    _, folder = windowed
    pair = Pair.open(LoadSpec(folder, backend="torch", device="cpu", dtype="float32"))
    room = 4 * pair.target.kv_bytes_per_token() * verdict.STREAM_CONTEXT
    monkeypatch.setattr(verdict, "_room", lambda backend, target: room)
    settings = SimpleNamespace(drafters=("none", "ngram"), auto_kind=None, ks=(3,),
                               draft_vocab=0)
    sources, unavailable = verdict.local_sources(pair, settings, 1, lambda line: None)
    context = pair.target.context_length  # under STREAM_CONTEXT: the stream is capped there
    expected = Memory(servable_context=context, context=context,
                      max_streams=room // (ROW * (context + 3 * WINDOW)))
    assert unavailable == {} and [s.name for s in sources] == ["plain", "ngram k=3"]
    assert all(s.memory == expected for s in sources) and expected.max_streams > 4
