"""`specdeck cache`: seeding from a folder keys the history by the target's tokenizer; stats
and clear cover every partition."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from app.store import history
from app.store.cache_cli import seed
from app.store.history import LOCAL, SEEDED, HistoryStore


class Words:
    def encode(self, text, add_special_tokens=True):
        return [len(word) for word in text.split()]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_seeding_reads_text_files_and_skips_binaries_and_vcs_folders(home, tmp_path):
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / "src").mkdir()
    (repo / "src" / "a.py").write_text("def f(x): return x\n")
    (repo / "README").write_text("hello world\n")
    (repo / "blob.bin").write_bytes(b"\x00\x01\x02")
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    store = HistoryStore("words")
    done = seed(store, Words(), repo)
    assert (done.files, done.skipped) == (2, 1)
    records = store.load(LOCAL)
    assert [r.kind for r in records] == [SEEDED, SEEDED]
    assert [r.tokens for r in records] == [(5, 5), (3, 5, 6, 1)]  # sorted: README, src/a.py


def test_cache_build_stats_and_clear_through_the_command_line(home, tmp_path, capsys):
    from tests.tiny import save_hf_folder, tiny_llama

    folder = save_hf_folder(tiny_llama(seed=1), tmp_path / "tiny")
    (tmp_path / "notes.txt").write_text("w5 w6 w7 w8 w5 w6\n")
    assert main(["cache", "build", "--from", str(tmp_path / "notes.txt"), "--target",
                 str(folder)]) == 0
    assert "seeded 6 tokens from 1 files" in capsys.readouterr().out
    assert main(["cache", "stats", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == 6 and report["files"][0]["seeded_tokens"] == 6
    assert report["files"][0]["partition"] == LOCAL
    assert main(["cache", "clear"]) == 0
    assert "1 files removed" in capsys.readouterr().out
    assert history.stats() == []
    assert main(["cache", "stats"]) == 0 and "empty" in capsys.readouterr().out


def test_cache_build_without_a_target_names_the_flag(home, tmp_path, capsys):
    assert main(["cache", "build", "--from", str(tmp_path)]) == 2
    assert "--target" in capsys.readouterr().err
