"""Issue 45: the planner counts a sliding window's KV as a fixed cost per stream and a full
layer's at its own geometry (Gemma 4), read from models.yaml and from config.json, and
`specdeck models`, --why and the Models tab show it beside KV per token."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from app import store
from app.catalogue import sizing, target_info
from app.catalogue.registry import Arch, load_catalogue
from app.core.types import SpecdeckError
from app.store.cli import models_table
from tests.test_registry import VALID

GB = 10**9
# six layers, five of them sliding over 1024 tokens: a Gemma 3-like pattern
WINDOWED = Arch(layers=6, hidden=256, heads=8, kv_heads=4, head_dim=64, vocab=1000,
                context=131072, window=1024, sliding_layers=5)
UNWINDOWED = replace(WINDOWED, window=0, sliding_layers=0)


def test_a_windowed_arch_keeps_every_token_in_its_full_layers_and_the_window_in_the_rest():
    target = sizing.arch_sizing(WINDOWED, 0, "torch", "bfloat16")
    assert target.kv_bytes_per_token == 1 * 4 * 64 * 2 * 2 == 1024  # the full layer only
    assert target.window_row_bytes == 5 * 4 * 64 * 2 * 2 == 5120
    # past the window: full layer x context + sliding layers x window
    assert target.kv_bytes(32768) == 1024 * 32768 + 5120 * 1024 == 38_797_312
    assert target.kv_bytes(32768, spare=4) == 1024 * 32768 + 5120 * 1028  # a verify of k 4
    assert target.kv_bytes(100) == (1024 + 5120) * 100  # within the window: every row
    # MLX's WindowCache keeps 64 rows past the window to cut back
    assert sizing.arch_sizing(WINDOWED, 0, "mlx", "bfloat16").kv_bytes(32768) == \
        1024 * 32768 + 5120 * (1024 + 64)
    assert sizing.arch_sizing(UNWINDOWED, 0, "torch", "bfloat16").kv_bytes(32768) == \
        6 * 1024 * 32768


def test_gemma_4_31b_counts_its_full_layers_at_their_own_heads():
    arch = load_catalogue().model("gemma-4-31b").arch
    assert (arch.window, arch.sliding_layers, arch.full_layers) == (1024, 50, 10)
    assert sizing.kv_bytes_per_token(arch, 2) == 10 * 4 * 512 * 2 * 2 == 81_920
    assert sizing.window_row_bytes(arch, 2) == 50 * 16 * 256 * 2 * 2 == 819_200
    assert sizing.kv_bytes_per_token(arch, 2, layers=1) == 16 * 256 * 2 * 2  # an MTP layer


def test_streams_and_context_that_fit_grow_with_the_window():
    windowed = sizing.arch_sizing(WINDOWED, GB, "", "bfloat16")
    plain = sizing.arch_sizing(UNWINDOWED, GB, "", "bfloat16")
    # 10 GB less the 10% reserve and 1 GB of weights: 8 GB for KV
    wide = sizing.fit(windowed, None, 10 * GB, 32768, verify=(5, 0), k=4)
    narrow = sizing.fit(plain, None, 10 * GB, 32768, verify=(5, 0), k=4)
    assert narrow.streams_plain == narrow.streams_spec == 8 * GB // (6 * 1024 * 32768) == 39
    assert wide.streams_plain == 8 * GB // (1024 * 32768 + 5120 * 1024) == 206
    assert wide.streams_spec == 8 * GB // (1024 * 32768 + 5120 * 1028) == 206
    assert narrow.max_context_plain == min(131072, 8 * GB // 6144) == 131072
    assert wide.max_context_plain == 131072
    tight = sizing.fit(windowed, None, int(1.2 * GB), 32768)  # 80 MB for KV
    assert tight.max_context_plain == (80_000_000 - 5120 * 1024) // 1024 == 73_005
    assert sizing.fit(plain, None, int(1.2 * GB), 32768).max_context_plain == \
        80_000_000 // 6144 == 13_020
    assert wide.window_bytes == (5120 * 1028, 0) and wide.memory_bytes == \
        GB + 1024 * 32768 + 5120 * 1028


def test_a_gemma_4_config_as_transformers_saves_it_reads_to_its_layers_and_window():
    from transformers import Gemma4TextConfig

    # the defaults: 30 layers, 5 sliding : 1 full, window 512, 4 kv heads of 256; the full
    # layers' heads 512 wide (global_head_dim), saved as per_layer_config overrides
    arch = target_info.arch_from_config(Gemma4TextConfig().to_dict())
    assert (arch.layers, arch.window, arch.sliding_layers, arch.full_layers) == (30, 512, 25, 5)
    assert (arch.kv_heads, arch.head_dim, arch.full_kv_heads, arch.full_head_dim,
            arch.k_eq_v) == (4, 256, 4, 512, False)
    # keys as values bring num_global_key_value_heads; the last 10 layers reuse the KV of
    # earlier ones, so of layers 0-19 three are full (5, 11, 17) and 17 slide
    shared = Gemma4TextConfig(attention_k_eq_v=True, num_global_key_value_heads=1,
                              num_kv_shared_layers=10)
    arch = target_info.arch_from_config(shared.to_dict())
    assert (arch.kv_layers, arch.sliding_layers, arch.full_layers) == (20, 17, 3)
    assert (arch.full_kv_heads, arch.full_head_dim, arch.k_eq_v) == (1, 512, True)
    assert sizing.kv_bytes_per_token(arch, 2) == 3 * 1 * 512 * 2 * 2


@pytest.mark.parametrize("config, window, sliding", [
    # Mistral lists no layer_types: transformers' cache windows every layer
    ({"model_type": "mistral", "sliding_window": 4096}, 4096, 4),
    ({"model_type": "mistral", "sliding_window": None}, 0, 0),
    # Qwen2's sliding_window is off unless use_sliding_window
    ({"model_type": "qwen2", "sliding_window": 32768, "use_sliding_window": False}, 0, 0),
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True,
      "max_window_layers": 3}, 4096, 1),
    # Gemma 3 without layer_types: all but every sliding_window_pattern-th layer
    ({"model_type": "gemma3_text", "sliding_window": 512, "sliding_window_pattern": 2}, 512, 2),
    ({"model_type": "gpt_oss", "sliding_window": 128}, 128, 2),
])
def test_config_windows_read_as_transformers_builds_them(config, window, sliding):
    base = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "vocab_size": 100}
    arch = target_info.arch_from_config({**base, **config})
    assert (arch.window, arch.sliding_layers) == (window, sliding)


def test_the_models_listing_shows_the_windows_bytes_beside_kv_per_token(tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path))
    rows = store.list_pairs("torch", "cuda", 64 * GB, 32768)
    text = models_table(rows, 32768, why=True)
    block = text.split("\ngpt-oss-20b+ngram")[1].split("\nvicuna")[0]
    # 12 sliding layers x 8 kv heads x 64 x K and V x bf16, over 128 rows + k 4 spare
    assert ("KV per token 24.0 KiB target + 0.0 KiB drafter; window per stream 3.2 MB "
            "target + 0.0 MB drafter (132 rows)") in block
    gpt_oss = next(r for r in rows if r.pair.id == "gpt-oss-20b+ngram").to_dict()["fit"]
    assert gpt_oss["window_bytes"] == [12 * 8 * 64 * 2 * 2 * 132, 0]
    smollm = text.split("\nsmollm2-135m+ngram")[1].split("\nqwen2.5-7b")[0]
    assert "window per stream" not in smollm


def test_the_models_tab_shows_the_windows_bytes_beside_kv_per_token(tmp_path, monkeypatch):
    pytest.importorskip("gradio")
    from app.ui.models import catalogue_frame
    from app.ui.workbench import Workbench

    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path))
    monkeypatch.setattr("backends.cpu.cpu_has_native_bf16", lambda: True)  # a bf16 KV cache
    table = catalogue_frame(Workbench(backend="torch", device="cpu")).set_index("pair")
    cell = table.loc["gpt-oss-20b+ngram", "KV / token target + drafter"]
    assert re.fullmatch(r"24\.0 KiB \+ 0 B, window 3\.\d MiB / stream", cell), cell
    assert "window" not in table.loc["smollm2-135m+ngram", "KV / token target + drafter"]


@pytest.mark.parametrize("arch_extra, message", [
    (", window: {size: 8, layers: 3}", "window.layers (3) is more than the layers that keep KV"),
    (", window: {size: 8}", "missing field 'layers'"),
    (", window: {size: 8, layers: 1, pattern: 2}", "unknown field 'pattern'"),
    (", window: {size: 8, layers: 2}, full: {kv_heads: 1, head_dim: 8}",
     "every KV layer slides"),
    (", full: {kv_heads: 1, head_dim: 8, k_eq_v: 1}", "'k_eq_v' must be a true or false"),
])
def test_a_broken_window_is_refused_with_its_line(tmp_path, arch_extra, message):
    old = "    arch: {layers: 2, hidden: 8, heads: 2, kv_heads: 1, head_dim: 4, vocab: 10, " \
          "context: 64}"
    text = VALID.replace(old, old[:-1] + arch_extra + "}", 1)
    path = tmp_path / "models.yaml"
    path.write_text(text)
    with pytest.raises(SpecdeckError) as error:
        load_catalogue(path)
    assert message in str(error.value)
    line = text[:text.index("    arch: {layers: 2")].count("\n") + 1
    assert re.search(rf"models\.yaml:{line}:", str(error.value)), str(error.value)


def test_a_valid_window_loads():
    arch = load_catalogue().model("gpt-oss-20b").arch
    assert (arch.window, arch.sliding_layers, arch.full_layers, arch.full_kv_heads) == \
        (128, 12, 12, 0)
    e4b = load_catalogue().model("gemma-4-e4b").arch
    assert (e4b.window, e4b.sliding_layers, e4b.full_layers, e4b.full_head_dim) == \
        (512, 20, 4, 512)


def _kv_held(session) -> int:
    """The bytes of keys and values a torch session's cache layers hold now."""
    return sum(t.numel() * t.element_size() for layer in session._cache.layers
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if t is not None)


def test_the_planners_window_is_what_a_tiny_torch_gemma_3_cache_keeps():
    pytest.importorskip("torch")
    from backends.torch import attention
    from tests.tiny_families import WINDOW, tiny_family

    target, k = tiny_family("gemma3_text", 2, attention=attention.register()), 4
    prompt = [5, 9, 3, 7, 11, 2, 4, 8, 13, 6, 10, 12, 5, 9, 3, 7]  # twice the window
    arch = target_info.arch_from_config(target.hf.config.to_dict())
    assert (arch.window, arch.sliding_layers, arch.full_layers) == (WINDOW, 3, 1)
    counted = sizing.arch_sizing(arch, 0, "torch", "float32")
    session = target.start()
    session.forward(prompt)
    session.rewind(len(prompt))  # commits: the window's layers keep window - 1 rows
    session.forward(prompt[:1])  # a plain step holds the window
    assert _kv_held(session) == counted.kv_bytes(len(prompt) + 1) == \
        1 * 2 * 8 * 2 * 4 * 17 + 3 * 2 * 8 * 2 * 4 * WINDOW
    session.rewind(len(prompt) + 1)
    session.forward(prompt[:k + 1], n_logits=k + 1)  # a verify of k drafts, before keep
    tokens = len(prompt) + 1 + k + 1
    assert _kv_held(session) == counted.kv_bytes(tokens, spare=k) == \
        1 * 2 * 8 * 2 * 4 * tokens + 3 * 2 * 8 * 2 * 4 * (WINDOW + k)


def test_a_served_windowed_targets_stream_counts_its_window_not_every_token(tmp_path):
    from app.catalogue.sizing import loaded_stream_bytes
    from tests.tiny import save_hf_folder
    from tests.tiny_families import WINDOW, tiny_family

    model = tiny_family("gemma3_text")  # 3 sliding layers (window 8) and 1 full, 2 x 8 wide
    folder = save_hf_folder(model, tmp_path / "gemma3")
    row = 2 * 8 * 2 * 4  # one layer's K and V of one token, float32
    assert loaded_stream_bytes(model, str(folder), "torch", 200) == row * (200 + 3 * WINDOW)
    assert loaded_stream_bytes(model, None, "torch", 200) == model.kv_bytes_per_token() * 200
