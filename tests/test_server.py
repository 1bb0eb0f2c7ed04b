"""`specdeck serve` speaks the OpenAI API to the official client, losslessly, with stats.

One server process per module, on 127.0.0.1, over the tiny model of tests/tiny.py saved to disk
(ngram drafter, k 4, an API key). The in-process engine over the same folder is the
reference the server's text and speculative statistics must match.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from app.core.engine import SpecEngine  # noqa: E402
from app.core.types import Done, SamplingParams  # noqa: E402
from app.drafters.ngram import NgramDrafter  # noqa: E402
from app.serve import prometheus  # noqa: E402
from backends.torch.backend import TorchBackend  # noqa: E402
from tests.serving import save_tiny_model, specdeck_serve  # noqa: E402

KEY = "test-key"
PROMPT = "w5 w9 w12 w5 w9"  # greedy continues in a loop: long replies, high acceptance


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def base_url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    args = ["--target", str(model_dir), "--drafter", "ngram", "--k", "4", "--api-key", KEY]
    with specdeck_serve(args, log) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str):
    with openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> SpecEngine:
    target = TorchBackend().load(str(model_dir), device="cpu", dtype="float32")
    return SpecEngine(target, NgramDrafter(), k=4)


def local(engine: SpecEngine, prompt_ids: list[int], **params) -> Done:
    *_, done = engine.generate(prompt_ids, SamplingParams(**params))
    assert done.error is None
    return done


def metrics(base_url: str) -> list[prometheus.Sample]:
    root = base_url.removesuffix("/v1")
    text = httpx.get(f"{root}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return prometheus.parse(text)


def test_models_lists_the_target_with_its_drafter_and_context(client) -> None:
    [card] = client.models.list().data
    assert card.owned_by == "specdeck"
    assert card.max_model_len == 4096
    assert card.specdeck["drafter"] == "ngram" and card.specdeck["k"] == 4
    streams = card.specdeck["streams"]  # lookup keeps no KV of its own: the same either way
    assert streams["fit_plain"] == streams["fit_speculating"] >= streams["slots"] >= 1


def test_metrics_say_how_many_streams_memory_holds_with_and_without_speculation(
        base_url: str) -> None:
    names = {sample.name: sample.value for sample in metrics(base_url)}
    assert names["specdeck:streams_fit_plain"] == names["specdeck:streams_fit_speculating"] >= 1


def test_completion_equals_the_engine_with_the_same_speculative_stats(
        client, model_id: str, reference: SpecEngine) -> None:
    reply = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=40,
                                      temperature=0)
    prompt_ids = reference.target.tokenizer.encode(PROMPT)
    done = local(reference, prompt_ids, max_new_tokens=40)
    choice = reply.choices[0]
    assert choice.text == done.text
    assert choice.token_ids == list(done.token_ids)
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 40
    assert reply.usage.prompt_tokens == len(prompt_ids)
    spec, stats = reply.speculative, done.stats
    assert spec["num_draft_tokens"] == stats.drafted > 0
    assert spec["num_accepted_draft_tokens"] == stats.accepted > 0
    assert spec["num_spec_steps"] == stats.target_forwards
    assert spec["accepted_per_position"] == list(stats.accepted_per_position)
    assert spec["acceptance_histogram"] == list(stats.accepted_length_histogram)
    assert spec["mean_acceptance_length"] == pytest.approx(39 / stats.target_forwards)
    assert spec["draft_acceptance_rate"] == pytest.approx(stats.accepted / stats.drafted)
    assert spec["decode_tok_s"] > 0
    assert sum(choice.from_draft) == stats.accepted  # every accepted draft token survives


def test_streamed_chat_adds_up_to_the_whole_reply_with_usage_and_stats(
        client, model_id: str) -> None:
    messages = [{"role": "system", "content": "w7"}, {"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model=model_id, messages=messages, max_tokens=30,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == whole.choices[0].finish_reason and set(finish[:-1]) == {None}
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert usage_chunk.speculative["num_accepted_draft_tokens"] == \
        whole.speculative["num_accepted_draft_tokens"]
    streamed_ids = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    assert streamed_ids == whole.choices[0].token_ids


def test_stop_sequence_cuts_the_reply_before_it(client, model_id: str) -> None:
    full = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=12,
                                     temperature=0).choices[0].text
    stop = full.split()[4]
    cut = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=12,
                                    temperature=0, stop=[stop, "w999"]).choices[0]
    assert cut.text == full[:full.index(stop)]
    assert cut.finish_reason == "stop"
    assert cut.stop_reason == stop
    streamed = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=12,
                                         temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_same_seed_gives_the_same_sample_and_other_seeds_differ(client, model_id: str) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=model_id, prompt=PROMPT, max_tokens=30,
                                         temperature=1.0, top_p=0.95, seed=seed,
                                         extra_body={"top_k": 20}).choices[0].text
    first = sample(7)
    assert sample(7) == first
    assert any(sample(seed) != first for seed in (8, 9, 10))


def test_per_request_drafter_and_k_change_stats_but_never_the_text(
        client, model_id: str) -> None:
    def run(**extra):
        return client.completions.create(model=model_id, prompt=PROMPT, max_tokens=25,
                                         temperature=0, extra_body=extra)
    default, plain, k1 = run(), run(drafter="none"), run(k=1)
    assert default.choices[0].text == plain.choices[0].text == k1.choices[0].text
    assert plain.speculative["drafter"] == "none"
    assert plain.speculative["num_draft_tokens"] == 0
    assert plain.speculative["mean_acceptance_length"] == 1.0
    assert k1.speculative["num_spec_tokens"] == 1
    assert len(k1.speculative["drafted_per_position"]) == 1
    # the server's own drafter and k are back after per-request ones
    assert untimed(run().speculative) == untimed(default.speculative)


def untimed(spec: dict) -> dict:
    return {k: v for k, v in spec.items() if not k.endswith("_s") and k != "decode_tok_s"}


def test_metrics_count_exactly_what_the_request_reported(
        client, model_id: str, base_url: str) -> None:
    def counters() -> dict[str, float]:
        samples = metrics(base_url)
        names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        out = {n: prometheus.total(samples, f"specdeck:spec_decode_{n}_total") or 0.0
               for n in names}
        out["generation"] = prometheus.total(samples, "specdeck:generation_tokens_total") or 0
        return out

    before = counters()
    spec = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=20,
                                     temperature=0).speculative
    after = counters()
    assert after["num_draft_tokens"] - before["num_draft_tokens"] == spec["num_draft_tokens"]
    assert after["num_accepted_tokens"] - before["num_accepted_tokens"] == \
        spec["num_accepted_draft_tokens"]
    assert after["num_drafts"] - before["num_drafts"] == spec["num_drafts"] > 0
    assert after["generation"] - before["generation"] == 20
    per_pos = prometheus.by_label(metrics(base_url),
                                  "specdeck:spec_decode_num_accepted_tokens_per_pos_total",
                                  "position")
    assert list(per_pos) == ["0", "1", "2", "3"]


def test_metrics_split_draft_tokens_by_the_drafter_that_proposed_them(
        client, model_id: str, base_url: str) -> None:
    def by_drafter() -> dict[str, float]:
        return prometheus.by_label(
            metrics(base_url), "specdeck:spec_decode_drafter_num_accepted_tokens_total",
            "drafter")

    before = by_drafter()
    spec = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=20,
                                     temperature=0).speculative
    after = by_drafter()
    reported = {d["name"]: d["accepted"] for d in spec["drafters"]}
    assert reported and set(reported) <= set(after)
    assert {name: after[name] - before.get(name, 0) for name in reported} == reported


BAD = [
    ("/completions", {"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ("/completions", {"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ("/completions", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ("/completions", {"prompt": PROMPT, "k": 99}, 400, "k"),
    ("/completions", {"prompt": PROMPT, "drafter": "draft"}, 400, "drafter"),
    ("/completions", {"prompt": PROMPT, "drafter": "eagle9"}, 400, "drafter"),
    ("/completions", {"prompt": PROMPT, "drafter": "none", "k": 3}, 400, "k"),
    ("/completions", {"prompt": PROMPT, "n": 2}, 400, "n"),
    ("/completions", {"prompt": PROMPT, "logprobs": 2}, 400, "logprobs"),
    ("/completions", {"prompt": PROMPT, "stop": [""]}, 400, "stop"),
    ("/completions", {"prompt": PROMPT, "seed": -3}, 400, "seed"),
    ("/completions", {"prompt": ""}, 400, "prompt"),
    ("/completions", {"prompt": [5, 9, 4800]}, 400, "prompt"),
    ("/completions", {"prompt": ["w5", "w9"]}, 400, "prompt"),
    ("/completions", {"prompt": "w5 " * 5000}, 400, "prompt"),
    ("/completions", {"prompt": PROMPT, "model": "gpt-4o"}, 404, "model"),
    ("/completions", {}, 400, "prompt"),
    ("/chat/completions", {"messages": []}, 400, "messages"),
    ("/chat/completions", {"messages": [{"role": "robot", "content": "w5"}]}, 400,
     "messages.0.role"),
    ("/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages.0.content"),
]


@pytest.mark.parametrize("path, body, status, param", BAD)
def test_malformed_requests_get_openai_error_objects_with_4xx(
        base_url: str, path: str, body: dict, status: int, param: str) -> None:
    response = httpx.post(base_url + path, json=body, timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["type"] == "invalid_request_error" and error["message"]


def test_body_that_is_not_json_and_unknown_routes_get_error_objects(base_url: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    bad = httpx.post(base_url + "/completions", content=b"{nope", headers=auth)
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    missing = httpx.get(base_url + "/nothing-here", headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong_method = httpx.get(base_url + "/completions", headers=auth)
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_the_official_client_raises_its_typed_errors(client, model_id: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model_id, prompt=PROMPT, temperature=5)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT)


def test_requests_without_the_api_key_are_refused(base_url: str, model_id: str) -> None:
    with openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
    assert httpx.get(base_url.removesuffix("/v1") + "/metrics").status_code == 401
    assert httpx.get(base_url.removesuffix("/v1") + "/health").status_code == 200


def test_client_leaving_mid_stream_cancels_and_leaves_the_engine_consistent(
        client, model_id: str, base_url: str) -> None:
    def aborted() -> float:
        return prometheus.by_label(metrics(base_url), "specdeck:request_success_total",
                                   "finished_reason").get("abort", 0.0)

    expected = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=30,
                                         temperature=0).choices[0].text
    before = aborted()
    stream = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=4000,
                                       temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 30
    while aborted() == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted() == before + 1  # cancelled long before its 4000 tokens
    again = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=30,
                                      temperature=0).choices[0].text
    assert again == expected


@pytest.mark.slow
def test_real_chat_model_replies_like_the_local_engine(smollm2_gguf: Path,
                                                       tmp_path: Path) -> None:
    import torch

    from app.core.prompt import chat_ids

    messages = [{"role": "user", "content": "Name three primary colors, comma separated."}]
    # float32 on both sides (auto would run this Q4_1 GGUF as int4)
    args = ["--target", str(smollm2_gguf), "--drafter", "ngram", "--k", "4",
            "--dtype", "float32"]
    with specdeck_serve(args, tmp_path / "serve.log") as url:
        with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120) as c:
            model = c.models.list().data[0].id
            whole = c.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                              temperature=0)
            streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                               c.chat.completions.create(model=model, messages=messages,
                                                         max_tokens=16, temperature=0,
                                                         stream=True))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the server: a 135M model gains nothing from threads
    try:
        target = TorchBackend().load(str(smollm2_gguf), device="cpu", dtype="float32")
        done = local(SpecEngine(target, NgramDrafter(), k=4),
                     chat_ids(target.tokenizer, messages), max_new_tokens=16)
    finally:
        torch.set_num_threads(threads)
    assert whole.choices[0].message.content == streamed == done.text
    assert done.text.strip()
    assert whole.usage.prompt_tokens == done.stats.n_prompt_tokens
    assert whole.speculative["num_draft_tokens"] == done.stats.drafted

