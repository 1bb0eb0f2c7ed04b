"""The history store: records survive a reload, damage is set aside, bounds hold, and two
processes writing at once lose nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.store import history
from app.store.history import LOCAL, REPLY, SEEDED, Bounds, HistoryStore, Record

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def store(tmp_path, monkeypatch) -> HistoryStore:
    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path))
    return HistoryStore("d1g35t")


def test_records_survive_a_reload(store):
    store.append(LOCAL, [Record((1, 2, 3)), Record((4, 5), SEEDED)])
    again = HistoryStore("d1g35t")
    assert again.load(LOCAL) == [Record((1, 2, 3), REPLY), Record((4, 5), SEEDED)]
    assert store.path(LOCAL).is_relative_to(history.root())


def test_a_damaged_file_is_set_aside_with_a_message_and_history_starts_empty(store, caplog):
    store.append(LOCAL, [Record((1, 2, 3))])
    path = store.path(LOCAL)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.load(LOCAL) == []
    assert "is damaged" in caplog.text and "set aside as" in caplog.text
    assert not path.exists() and list(path.parent.glob(f"*{history.SET_ASIDE}*"))
    store.append(LOCAL, [Record((7, 8))])  # and the app keeps recording
    assert store.load(LOCAL) == [Record((7, 8))]


@pytest.mark.parametrize("content,why", [
    (b"not a history at all", "is not a specdeck history file"),
    (b'{"format": "specdeck-history", "version": 99}\n', "its version is 99"),
])
def test_a_foreign_file_is_set_aside_naming_why(store, content, why):
    path = store.path(LOCAL)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    assert store.load(LOCAL) == []
    assert why in store.notices[0] and str(path) in store.notices[0]


def test_another_tokenizers_file_is_foreign(store):
    store.append(LOCAL, [Record((1, 2))])
    other = HistoryStore("other")
    other.folder.mkdir(parents=True)
    store.path(LOCAL).rename(other.path(LOCAL))
    assert other.load(LOCAL) == [] and "its tokenizer is 'd1g35t'" in other.notices[0]


def test_the_token_bound_evicts_the_oldest_records_first(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path))
    store = HistoryStore("d", bounds=Bounds(max_tokens=100))
    for i in range(30):
        store.append(LOCAL, [Record((i,) * 10)])
    kept = store.load(LOCAL)
    assert sum(len(r.tokens) for r in kept) <= 100
    assert kept[-1].tokens[0] == 29 and [r.tokens[0] for r in kept] == sorted(
        r.tokens[0] for r in kept)


def test_the_byte_bound_holds_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path))
    store = HistoryStore("d", bounds=Bounds(max_bytes=2000))
    for i in range(20):
        store.append(LOCAL, [Record(tuple(range(i, i + 50)))])
        assert store.path(LOCAL).stat().st_size <= 2000 + 400  # the header line on top
    assert sum(s.bytes for s in history.stats()) <= 2400


def test_stats_and_clear_cover_every_partition(store):
    store.append(LOCAL, [Record((1, 2, 3))])
    store.append(history.partition_of("secret"), [Record((4, 5), SEEDED)])
    found = {s.partition: s for s in history.stats()}
    assert found[LOCAL].tokens == 3 and found[history.partition_of("secret")].seeded_tokens == 2
    assert all("secret" not in s.partition for s in found.values())
    assert history.clear_all() == 2 and history.stats() == []


WRITER = textwrap.dedent("""
    import sys
    from app.store.history import LOCAL, HistoryStore, Record
    store, who = HistoryStore("d"), int(sys.argv[1])
    for i in range(40):
        store.append(LOCAL, [Record((who, i, *range(50)))])
""")


def test_two_writer_processes_at_once_lose_nothing_and_corrupt_nothing(store, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(who)], env=env)
               for who in (1, 2)]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    kept = HistoryStore("d").load(LOCAL)
    assert sorted(r.tokens[:2] for r in kept) == sorted((w, i) for w in (1, 2) for i in range(40))
    assert not HistoryStore("d").notices


def test_a_tokenizer_digest_follows_the_vocabulary_only():
    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    assert history.tokenizer_digest(Tok({"a": 0, "b": 1})) == \
        history.tokenizer_digest(Tok({"b": 1, "a": 0}))
    assert history.tokenizer_digest(Tok({"a": 0, "b": 1})) != \
        history.tokenizer_digest(Tok({"a": 1, "b": 0}))


def test_a_recorded_reply_is_drafted_from_at_once_and_on_disk_after_a_restart(store):
    live = history.History(store, prompt_tail=2)
    live.record(LOCAL, [1, 2, 3, 4], [5, 6])
    assert live.tokens(LOCAL) == 4  # the prompt's tail and the reply, indexed before the disk
    live.flush()
    assert history.History(HistoryStore("d1g35t")).index(LOCAL).n_tokens == 4
    assert HistoryStore("d1g35t").load(LOCAL) == [Record((3, 4, 5, 6))]


def test_a_reply_recorded_by_another_process_is_indexed_on_the_next_write(store):
    live = history.History(store)
    live.record(LOCAL, [1, 2], [3])
    live.flush()
    HistoryStore("d1g35t").append(LOCAL, [Record((7, 8, 9))])  # a server beside this UI
    live.record(LOCAL, [4], [5])
    live.flush()
    assert live.tokens(LOCAL) == 3 + 3 + 2
