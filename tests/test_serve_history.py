"""`specdeck serve` with several API keys: each key's replies go to that key's history
partition, named by the key's hash, and a wrong key is refused."""

from __future__ import annotations

import os
import time

import httpx
import pytest

pytest.importorskip("torch")

from app.store import history  # noqa: E402
from tests.serving import save_tiny_model, specdeck_serve  # noqa: E402


def ask(url: str, key: str) -> int:
    reply = httpx.post(f"{url}/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"prompt": "w5 w9 w12 w5 w9", "max_tokens": 8, "temperature": 0},
                       timeout=120)
    return reply.status_code


def test_each_api_key_records_into_its_own_partition(tmp_path):
    folder = save_tiny_model(tmp_path / "tiny")
    keys_file = tmp_path / "keys"
    keys_file.write_text("# the team\nbob-key\n")
    args = ["--target", str(folder), "--api-key", "alice-key", "--api-keys-file",
            str(keys_file)]
    with specdeck_serve(args, tmp_path / "serve.log") as url:
        assert ask(url, "alice-key") == 200 and ask(url, "bob-key") == 200
        assert ask(url, "carol-key") == 401
        deadline = time.monotonic() + 30
        while len(history.stats()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # the history is written on a thread of its own
        metrics = httpx.get(f"{url.removesuffix('/v1')}/metrics",
                            headers={"Authorization": "Bearer bob-key"}).text
        assert "specdeck:history_tokens{" in metrics
        assert 'specdeck:history_max_tokens{model_name="' in metrics
    parts = {s.partition for s in history.stats()}
    assert parts == {history.partition_of("alice-key"), history.partition_of("bob-key")}
    assert all("key" not in p.removeprefix("key-") for p in parts)  # hashes, never the keys
    assert os.environ["SPECDECK_HISTORY"] in str(history.root())
