"""`specdeck serve` without --target serves every installed pair by its id, like Ollama.

The pool's rules (load on first use, keep-alive, unload the least recently used idle pair
when the planner's sizes say another does not fit, never unload one in use) run against fake
loaders and a fake clock. The server runs as a process over a temporary SPECDECK_HOME with
tiny models installed under two catalogue pairs' model ids, driven by the official client.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import httpx
import pytest

from app.catalogue import sizing
from app.core.types import SamplingParams, SpecdeckError
from app.serve import prometheus
from app.serve.pool import Listed, Pool, parse_duration
from app.serve.requests import ApiError

GB = 10**9


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def listed(pair_id: str, need: int) -> Listed:
    return Listed(pair_id, pair_id, "ngram", "test", need, 4096)


def pool_of(needs: dict[str, int], budget: int, keep_alive: float = 300.0,
            max_loaded: int = 0) -> tuple[Pool, list[str], Clock]:
    loads: list[str] = []
    clock = Clock()

    def load(pair_id: str) -> object:
        loads.append(pair_id)
        return type("Served", (), {"model_id": pair_id})()

    items = [listed(p, n) for p, n in needs.items()]
    return Pool(items, load, budget, keep_alive, max_loaded, clock=clock), loads, clock


def use(pool: Pool, pair_id: str, keep_alive: object = None) -> None:
    pool.acquire(pair_id)
    pool.release(pair_id, keep_alive)


def test_a_pair_is_loaded_on_first_use_and_kept_for_the_next_request() -> None:
    pool, loads, _ = pool_of({"a": GB}, budget=10 * GB)
    assert pool.loaded() == []
    use(pool, "a")
    use(pool, "a")
    assert loads == ["a"] and pool.loaded() == ["a"]


def test_an_idle_pair_is_unloaded_once_its_keep_alive_has_passed() -> None:
    pool, loads, clock = pool_of({"a": GB}, budget=10 * GB, keep_alive=300)
    use(pool, "a")
    clock.now = 299
    assert pool.reap() == [] and pool.loaded() == ["a"]
    clock.now = 300
    assert pool.reap() == ["a"] and pool.loaded() == []
    use(pool, "a")
    assert loads == ["a", "a"]


def test_a_requests_keep_alive_overrides_the_servers_for_its_pair() -> None:
    pool, _, clock = pool_of({"a": GB, "b": GB}, budget=10 * GB, keep_alive=300)
    use(pool, "a", keep_alive=0)  # Ollama: 0 unloads as soon as the request ends
    assert pool.loaded() == []
    use(pool, "b", keep_alive="-1")  # negative: stays loaded
    clock.now = 10**9
    assert pool.reap() == [] and pool.loaded() == ["b"]
    use(pool, "b", keep_alive="10s")
    clock.now += 10
    assert pool.reap() == ["b"]


def test_the_keep_alive_thread_unloads_idle_pairs_on_its_own() -> None:
    pool = Pool([listed("a", GB)], lambda pair_id: object(), 10 * GB, keep_alive_s=0.2)
    pool.start_reaper()
    try:
        use(pool, "a")
        assert pool.loaded() == ["a"]
        deadline = time.monotonic() + 5
        while pool.loaded() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.loaded() == []
    finally:
        pool.stop()


def test_a_pair_that_does_not_fit_beside_an_idle_one_unloads_the_least_recently_used() -> None:
    # 10 GB budget: 9 GB usable after the planner's reserve; any two of the three exceed it
    pool, loads, clock = pool_of({"a": 5 * GB, "b": 5 * GB, "c": 3 * GB}, budget=10 * GB)
    use(pool, "a")
    clock.now = 1
    use(pool, "c")  # 5 + 3 fits
    assert sorted(pool.loaded()) == ["a", "c"]
    clock.now = 2
    use(pool, "b")  # 5 + 5 + 3 does not; a was used longest ago
    assert sorted(pool.loaded()) == ["b", "c"]
    assert loads == ["a", "c", "b"]


def test_max_loaded_caps_how_many_pairs_are_loaded_whatever_the_memory() -> None:
    pool, _, _ = pool_of({"a": GB, "b": GB}, budget=100 * GB, max_loaded=1)
    use(pool, "a")
    use(pool, "b")
    assert pool.loaded() == ["b"]


def test_a_pair_in_use_is_never_unloaded_a_load_that_needs_its_memory_waits() -> None:
    pool, _, _ = pool_of({"a": 5 * GB, "b": 5 * GB}, budget=10 * GB)
    pool.acquire("a")  # a request is generating on a
    got = threading.Event()
    waiter = threading.Thread(target=lambda: (pool.acquire("b"), got.set()), daemon=True)
    waiter.start()
    time.sleep(0.3)
    assert not got.is_set() and pool.loaded() == ["a"]
    pool.release("a")
    assert got.wait(5)
    assert pool.loaded() == ["b"]


def test_a_catalogue_pair_that_is_not_installed_is_a_404_naming_specdeck_pull() -> None:
    pool, _, _ = pool_of({"smollm2-135m+ngram": GB}, budget=10 * GB)
    with pytest.raises(ApiError) as missing:
        pool.acquire("qwen2.5-7b+0.5b")
    assert missing.value.status == 404
    assert "`specdeck pull qwen2.5-7b+0.5b`" in str(missing.value.body())
    with pytest.raises(ApiError) as unknown:
        pool.acquire("no-such-model")
    assert unknown.value.status == 404 and "specdeck pull" in str(unknown.value.body())


def test_a_pair_that_fails_to_load_is_a_500_naming_it_and_the_next_request_tries_again(
        ) -> None:
    attempts = []

    def load(pair_id: str) -> object:
        attempts.append(pair_id)
        if len(attempts) == 1:
            raise SpecdeckError("model.safetensors is corrupted: run `specdeck pull --verify`")
        return object()

    pool = Pool([listed("a", GB)], load, 10 * GB, keep_alive_s=300)
    with pytest.raises(ApiError) as failed:
        pool.acquire("a")
    assert failed.value.status == 500 and "could not load a: model.safetensors is corrupted" \
        in str(failed.value)
    assert pool.loaded() == []
    pool.acquire("a")
    assert pool.loaded() == ["a"] and attempts == ["a", "a"]


def test_a_request_cancelled_while_its_pair_loads_still_releases_it(monkeypatch) -> None:
    import asyncio

    from app.serve import routes

    go = threading.Event()

    def slow_load(pair_id: str) -> object:
        assert go.wait(5)
        return type("Served", (), {"model_id": pair_id})()

    pool = Pool([listed("a", GB)], slow_load, 10 * GB, keep_alive_s=0.0)
    monkeypatch.setattr(routes, "prepare_pooled",
                        lambda pool, chat, raw: (None, None, pool.acquire("a")))

    async def cancelled_mid_load() -> None:
        task = asyncio.create_task(routes._prepare_pooled_async(pool, False, b"{}"))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()
        for _ in range(100):  # the release runs when the load's thread ends
            await asyncio.sleep(0.02)
            if not pool.loaded():
                return

    asyncio.run(cancelled_mid_load())
    assert pool.loaded() == []  # released with keep-alive 0: unloaded, not leaked


def test_keep_alive_reads_ollama_durations_and_refuses_the_rest() -> None:
    assert parse_duration("5m") == 300 and parse_duration("1h30m") == 5400
    assert parse_duration("90s") == 90 and parse_duration(0) == 0 and parse_duration("2.5") == 2.5
    assert parse_duration(-1) == math.inf and parse_duration("-1m") == math.inf
    for bad in ("soon", "5 minutes", "", True):
        with pytest.raises(SpecdeckError, match="duration"):
            parse_duration(bad)


def test_serve_with_nothing_installed_names_the_pull_and_bad_flags_name_the_fix(
        tmp_path: Path, monkeypatch, capsys) -> None:
    from app.cli import main

    monkeypatch.setenv("SPECDECK_HOME", str(tmp_path))
    assert main(["serve", "--backend", "torch"]) == 2
    err = capsys.readouterr().err
    assert "no pair is installed" in err and "`specdeck pull qwen2.5-coder-1.5b+0.5b`" in err
    assert main(["serve", "--keep-alive", "soon"]) == 2
    assert "--keep-alive 'soon' is not a duration" in capsys.readouterr().err
    assert main(["serve", "--served-model-name", "x"]) == 2
    assert "--served-model-name needs --target" in capsys.readouterr().err


# ---- the server, as a process ----------------------------------------------------------

openai = pytest.importorskip("openai")

SMOL, QWEN = "smollm2-135m+ngram", "qwen2.5-1.5b+0.5b"
PROMPT = "w5 w9 w12 w5 w9"


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.installed import install_tiny

    home = tmp_path_factory.mktemp("home")
    install_tiny(home, "smollm2-135m-instruct", seed=1)
    install_tiny(home, "qwen2.5-1.5b-instruct", seed=3)
    install_tiny(home, "qwen2.5-0.5b-instruct", seed=3)  # a draft that agrees with its target
    return home


def serve_installed(home: Path, log: Path, *flags: str):
    from tests.serving import specdeck_serve

    return specdeck_serve(["--k", "4", *flags], log, env={"SPECDECK_HOME": str(home)})


@pytest.fixture(scope="module")
def roomy(home: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server with room for every pair, shared by the module: it lists the pairs' sizes and
    serves requests. A fixed budget: what is free on the machine would change the planner's
    drafter choice."""
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    with serve_installed(home, log, "--memory-limit", "64GB") as url:
        yield url


def loaded(url: str) -> list[str]:
    cards = httpx.get(f"{url}/models").json()["data"]
    return [c["id"] for c in cards if c["specdeck"]["loaded"]]


def test_without_a_target_the_client_lists_installed_pairs_completes_and_gets_404s(
        home: Path, roomy: str) -> None:
    from app.core.engine import SpecEngine
    from app.drafters.ngram import NgramDrafter
    from backends.torch.backend import TorchBackend

    url = roomy
    with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120) as client:
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {SMOL, QWEN}
        # auto's lookup is the suffix cache where history is kept, listed as it will run
        assert models[SMOL].specdeck["drafter"] == "suffix"
        assert models[QWEN].specdeck["drafter"] == "draft qwen2.5-0.5b-instruct"
        assert loaded(url) == []
        reply = client.completions.create(model=SMOL, prompt=PROMPT, max_tokens=24,
                                          temperature=0)
        assert loaded(url) == [SMOL]
        card = {m.id: m for m in client.models.list().data}[SMOL].specdeck
        assert card["drafter"] == "suffix"  # the same once loaded
        with pytest.raises(openai.NotFoundError, match="specdeck pull qwen3-8b\\+0.6b"):
            client.completions.create(model="qwen3-8b+0.6b", prompt=PROMPT, max_tokens=4)
        client.completions.create(model=QWEN, prompt=PROMPT, max_tokens=4,
                                  extra_body={"keep_alive": 0})  # Ollama's: unload when done
        assert loaded(url) == [SMOL]
    target = TorchBackend().load(str(home / "models/smollm2-135m-instruct/torch"), device="cpu",
                                 dtype="float32")
    ids = list(target.tokenizer.encode(PROMPT))
    *_, done = SpecEngine(target, NgramDrafter(), k=4).generate(
        ids, SamplingParams(max_new_tokens=24))
    assert reply.choices[0].text == done.text and done.text.strip()
    assert reply.speculative["drafter"] == "suffix"  # auto's lookup, with history on


def test_two_pairs_that_do_not_fit_together_are_loaded_one_at_a_time(
        home: Path, roomy: str, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    # what each pair needs depends on the dtype this CPU runs (fp32, or bf16 where native):
    # ask the server, then give it a limit that holds either pair but not both
    with openai.OpenAI(base_url=roomy, api_key="none", max_retries=0, timeout=120) as client:
        needs = {m.id: m.specdeck["memory_bytes"] for m in client.models.list().data}
    usable = (max(needs.values()) + sum(needs.values())) // 2
    # the pool keeps 10% back, and the runtime's share, as the planner does
    limit = int((usable + sizing.RUNTIME_BYTES["torch"]) / 0.9) + 1
    with serve_installed(home, log, "--memory-limit", str(limit)) as url, \
            openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120) as client:
        assert all(n <= usable for n in needs.values()) and sum(needs.values()) > usable
        for model in (SMOL, QWEN, SMOL):
            reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                              temperature=0)
            assert reply.model == model and loaded(url) == [model]
        exposition = httpx.get(url.removesuffix("/v1") + "/metrics").text
    # one family per metric, a sample per pair, counted across its unloads
    assert exposition.count("# TYPE specdeck:generation_tokens_total ") == 1
    generated = {s.label("model_name"): s.value for s in prometheus.parse(exposition)
                 if s.name == "specdeck:generation_tokens_total"}
    assert set(generated) == {SMOL, QWEN} and all(v > 0 for v in generated.values())
    text = log.read_text()
    assert f"unloaded {SMOL} (to make room for {QWEN})" in text
    assert f"unloaded {QWEN} (to make room for {SMOL})" in text


@pytest.mark.slow
def test_real_smollm2_installed_is_listed_and_answers_by_its_pair_id(
        smollm2_gguf: Path, tmp_path: Path) -> None:
    from tests.installed import link_installed

    home = tmp_path / "home"
    if link_installed(home, "smollm2-135m-instruct") is None:
        pytest.skip("SmolLM2 is not installed in the store")
    messages = [{"role": "user", "content": "Name three primary colors, comma separated."}]
    with serve_installed(home, tmp_path / "serve.log") as url, \
            openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300) as client:
        assert [m.id for m in client.models.list().data] == [SMOL]
        reply = client.chat.completions.create(model=SMOL, messages=messages, max_tokens=16,
                                               temperature=0)
        with pytest.raises(openai.NotFoundError, match=f"specdeck pull {QWEN.replace('+', '.')}"):
            client.chat.completions.create(model=QWEN, messages=messages, max_tokens=4)
    assert reply.model == SMOL and reply.choices[0].message.content.strip()
    assert reply.speculative["drafter"] == "suffix" and reply.usage.completion_tokens > 0
