"""The Models tab's Verify button runs `specdeck pull --verify` and shows what it found."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("gradio")

from app import store  # noqa: E402
from app.ui.models import ModelsHandlers  # noqa: E402
from app.ui.workbench import Workbench  # noqa: E402


def test_verify_rehashes_through_the_store_and_names_what_it_repaired(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path))
    asked: list[bool] = []

    def fake_pull(pair_id, progress=None, backend=None, verify=False, **_):
        asked.append(verify)
        return store.PullResult(pair_id, "torch", Path("/x"), None, 100, 1.0,
                                {"smollm2-135m": "pypi"}, checked=1,
                                repaired=("smollm2-135m/model.gguf",))

    monkeypatch.setattr(store, "pull", fake_pull)
    handlers = ModelsHandlers(Workbench(backend="torch", device="cpu"), lambda: "")
    final = list(handlers.verify("smollm2-135m+ngram"))[-1]
    assert asked == [True]
    assert "repaired (failed the sha256 check): smollm2-135m/model.gguf" in final[0]
