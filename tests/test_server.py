"""The OpenAI-compatible server: a real uvicorn server on loopback, real clients (openai, httpx), SmolLM2."""

import concurrent.futures
import contextlib
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from specdec import SamplingParams, generate, make_drafter
from specdec.draft import Draft
from specdec.drafters.base import DraftCost, Drafter
from specdec.loop import SpecBatch
from specdec.models.base import ContextLengthError
from specdec.server import TextDeltas, create_app
from specdec.budget import parse_gamma
from specdec.server.serve import add_serve_arguments
from specdec.server.metrics import parse_metrics

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 384
GAMMA = 3
PROMPTS = [
    "List the first five planets of the solar system.",
    "Write a haiku about autumn leaves.",
    "What is 17 times 3? Explain briefly.",
    "Name three primary colors.",
    "Repeat after me: the quick brown fox jumps over the lazy dog.",
    "Give two tips for learning Python.",
    "Describe a cat in one sentence.",
    "Translate 'good morning' into French and Spanish.",
]


@contextlib.contextmanager
def running_server(app):
    """uvicorn on a free loopback port in a background thread; yields the base URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def drafter(smollm2):
    try:
        return make_drafter("pld", smollm2, gamma=GAMMA)
    except ValueError:  # pld not in this build: the random drafter still exercises verification
        return make_drafter("random", smollm2, gamma=GAMMA)


@pytest.fixture(scope="module")
def base_url(smollm2, drafter):
    app = create_app(smollm2, drafter, gamma=GAMMA, max_running=8, max_model_len=MAX_MODEL_LEN,
                     max_body_bytes=64 * 1024)
    with running_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(base_url, headers=None) -> dict[str, float]:
    response = httpx.get(base_url + "/metrics", headers=headers)
    assert response.status_code == 200
    return parse_metrics(response.text)


def reference(smollm2, drafter, prompt, max_tokens, stop=(), sampling=SamplingParams()):
    return generate(smollm2, prompt, drafter, max_new_tokens=max_tokens, sampling=sampling, stop=stop, gamma=GAMMA)


def test_chat_completion_equals_generate_and_reports_speculation(smollm2, drafter, client):
    prompt = PROMPTS[4]
    response = client.chat.completions.create(model=smollm2.name, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=20, temperature=0)
    expected = reference(smollm2, drafter, prompt, 20)
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].finish_reason == expected.finish_reason
    usage = response.usage
    assert usage.prompt_tokens == len(smollm2.encode_prompt(prompt))
    assert usage.completion_tokens == len(expected.tokens)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.drafted_tokens == expected.stats.drafted_tokens and usage.drafted_tokens > 0
    assert usage.accepted_tokens == expected.stats.accepted_tokens
    assert usage.mean_accepted_length == pytest.approx(expected.stats.tau, abs=1e-3)


def test_streaming_chat_concatenates_to_the_non_streamed_text(smollm2, drafter, client):
    prompt, stop = "Count from 1 to 20, separated by commas.", ["7"]
    chunks = list(client.chat.completions.create(
        model=smollm2.name, messages=[{"role": "user", "content": prompt}], max_tokens=40, temperature=0, stop=stop,
        stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    expected = reference(smollm2, drafter, prompt, 40, stop=stop)
    assert expected.finish_reason == "stop" and "7" not in expected.text
    assert "".join(pieces) == expected.text
    assert len(pieces) > 1  # really streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(expected.tokens)


def test_completions_plain_and_streaming(smollm2, drafter, client):
    prompt = "The three largest cities of Japan are"
    response = client.completions.create(model=smollm2.name, prompt=prompt, max_tokens=16, temperature=0)
    prompt_ids = list(smollm2.tokenizer(prompt)["input_ids"])  # completions: raw text, no chat template
    expected = reference(smollm2, drafter, prompt_ids, 16)
    assert response.choices[0].text == expected.text
    assert response.usage.prompt_tokens == len(prompt_ids)
    streamed = client.completions.create(model=smollm2.name, prompt=prompt, max_tokens=16, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected.text


def _request(prompt, options):
    return dict(messages=[{"role": "user", "content": prompt}], **options)


def test_eight_concurrent_clients_match_alone_and_generate(smollm2, drafter, client, base_url):
    greedy = [dict(max_tokens=12 + 2 * i, temperature=0) for i in range(5)]
    greedy[3]["stop"] = [","]
    sampled = [dict(max_tokens=16, temperature=0.8, top_p=0.9, seed=7),
               dict(max_tokens=14, temperature=1.0, seed=11, extra_body={"top_k": 20}),
               dict(max_tokens=16, temperature=0.8, top_p=0.9, seed=7)]  # same seed, different prompt
    options = greedy + sampled
    assert len(options) == len(PROMPTS) == 8

    def ask(index):
        return client.chat.completions.create(model=smollm2.name, **_request(PROMPTS[index], options[index]))

    before = metrics(base_url)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(8)))
    after = metrics(base_url)
    # the requests really shared forwards: some verify step ran more than one sequence
    steps = after["specdec_step_batch_size_count"] - before["specdec_step_batch_size_count"]
    single = after['specdec_step_batch_size_bucket{le="1"}'] - before['specdec_step_batch_size_bucket{le="1"}']
    assert single < steps
    for index, option in enumerate(greedy):
        expected = reference(smollm2, drafter, PROMPTS[index], option["max_tokens"], stop=option.get("stop", ()))
        assert together[index].choices[0].message.content == expected.text, index
    for index in range(len(greedy), 8):
        alone = ask(index)  # the same request served alone
        assert together[index].choices[0].message.content == alone.choices[0].message.content, index
        assert together[index].usage.completion_tokens == alone.usage.completion_tokens
    assert together[5].choices[0].message.content != together[7].choices[0].message.content
    # a seeded request equals the library run with the same sampling parameters
    option = sampled[0]
    expected = reference(smollm2, drafter, PROMPTS[5], option["max_tokens"],
                         sampling=SamplingParams(option["temperature"], 0, option["top_p"], option["seed"]))
    assert together[5].choices[0].message.content == expected.text


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "JSON"),
    (b"[1, 2]", 400, "object"),
    ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, 400, "exceeds the server's context length"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 7.5}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "finite number"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', 400, "finite number"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi \\ud800 there"}]}', 400,
     "messages[0].content is not valid Unicode: a lone surrogate (U+D800) at character 3"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 3}, 400, "n=1"),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, 400, "the prompt alone exceeds it"),
    ({"messages": [{"role": "user", "content": "word " * 300}], "max_tokens": 200}, 400, "lower max_tokens to at most"),
    ({"messages": [{"role": "user", "content": "x" * 70_000}]}, 413, "limit"),
])
def test_invalid_chat_requests_get_openai_style_errors(smollm2, base_url, body, status, words):
    if isinstance(body, dict):
        body = json.dumps({"model": smollm2.name, **body}).encode()
    body = body.replace(b'"M"', json.dumps(smollm2.name).encode())
    response = httpx.post(base_url + "/v1/chat/completions", content=body,
                          headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words.lower() in error["message"].lower() and error["type"]


def test_generate_the_loop_and_the_server_refuse_a_size_with_one_message(smollm2):
    """One size rule (Target.check_fits): past the model's window, the server (its context set to the
    window), generate and SpecBatch.add refuse with the same words (the server says max_tokens)."""
    window = smollm2.context_window
    prompt_ids = list(smollm2.tokenizer("The three largest cities of Japan are")["input_ids"])
    too_many = window - len(prompt_ids) + 1
    with pytest.raises(ContextLengthError) as by_generate:
        generate(smollm2, prompt_ids, max_new_tokens=too_many)
    with pytest.raises(ContextLengthError) as by_the_loop:
        SpecBatch(smollm2, max_batch=1, max_len=64).add([prompt_ids], [SamplingParams()], [too_many], [()])
    assert str(by_the_loop.value) == str(by_generate.value)
    assert f"lower max_new_tokens to at most {window - len(prompt_ids):,}" in str(by_generate.value)
    with running_server(create_app(smollm2, None, max_running=1, max_model_len=window)) as url:
        answer = httpx.post(url + "/v1/completions", timeout=60,
                            json={"model": smollm2.name, "prompt": prompt_ids, "max_tokens": too_many})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["message"] == str(by_generate.value).replace("max_new_tokens", "max_tokens")
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens")


def test_other_invalid_requests(smollm2, base_url):
    post = lambda path, **kw: httpx.post(base_url + path, timeout=60, **kw)  # noqa: E731
    assert post("/v1/completions", json={"model": smollm2.name, "prompt": ""}).status_code == 400
    assert post("/v1/completions", json={"model": smollm2.name, "prompt": ["a", "b"]}).status_code == 400
    assert post("/v1/completions", json={"model": smollm2.name, "prompt": [10**9]}).status_code == 400
    too_big = (b'{"model": "x", "prompt": "' + b"y" * 70_000 + b'"}' for _ in range(1))  # chunked: no Content-Length
    assert post("/v1/completions", content=too_big).status_code == 413
    missing = httpx.get(base_url + "/v1/nothing-here")
    assert missing.status_code == 404 and "error" in missing.json()
    assert httpx.get(base_url + "/health").json()["status"] == "ok"  # still serving


def test_models_and_health(smollm2, client, base_url):
    assert [model.id for model in client.models.list().data] == [smollm2.name]
    health = httpx.get(base_url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_metrics_change_as_requests_are_served(smollm2, client, base_url):
    before = metrics(base_url)
    response = client.chat.completions.create(model=smollm2.name, messages=[{"role": "user", "content": PROMPTS[0]}],
                                              max_tokens=12, temperature=0)
    after = metrics(base_url)
    route = 'specdec_requests_total{route="/v1/chat/completions",status="200"}'
    assert after[route] == before.get(route, 0) + 1
    assert after["specdec_prompt_tokens_total"] - before["specdec_prompt_tokens_total"] == response.usage.prompt_tokens
    assert (after["specdec_completion_tokens_total"] - before["specdec_completion_tokens_total"]
            == response.usage.completion_tokens)
    assert after["specdec_drafted_tokens_total"] - before["specdec_drafted_tokens_total"] == response.usage.drafted_tokens
    assert after["specdec_target_forwards_total"] > before["specdec_target_forwards_total"]
    assert after["specdec_time_to_first_token_seconds_count"] == before["specdec_time_to_first_token_seconds_count"] + 1
    assert 'specdec_acceptance_per_position{position="1"}' in after
    assert after["specdec_running_requests"] == 0 and after["specdec_queue_length"] == 0


# ---------------------------------------------------------------- a tiny server: one slot, one queue place, a key

KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tiny_url(smollm2):
    app = create_app(smollm2, None, max_running=1, max_queue=1, max_model_len=512, api_key=KEY)
    with running_server(app) as url:
        yield url


def _wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


LONG = {"messages": [{"role": "user", "content": "Write a very long story about a dragon who learns to cook."}],
        "max_tokens": 400, "temperature": 0, "stream": True}


def test_api_key_is_required(smollm2, tiny_url):
    body = {"model": smollm2.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(tiny_url + "/v1/chat/completions", json=body).status_code == 401
    wrong = httpx.post(tiny_url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(tiny_url + "/metrics").status_code == 401
    assert httpx.get(tiny_url + "/v1/models").status_code == 401
    assert httpx.get(tiny_url + "/health").status_code == 200  # liveness probes send no key
    keyed = openai.OpenAI(base_url=tiny_url + "/v1", api_key=KEY, max_retries=0)
    assert keyed.chat.completions.create(model=smollm2.name, **_request("hi", {"max_tokens": 2})).usage.completion_tokens >= 1


def test_disconnect_mid_stream_frees_the_slot_and_full_queue_gives_429(smollm2, tiny_url):
    cancelled = 'specdec_generations_total{finish_reason="cancelled"}'
    start = metrics(tiny_url, AUTH).get(cancelled, 0)
    with httpx.Client(timeout=60, headers=AUTH) as http:
        with http.stream("POST", tiny_url + "/v1/chat/completions", json={"model": smollm2.name, **LONG}) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            _wait_for(lambda: metrics(tiny_url, AUTH)["specdec_running_requests"] == 1)  # admitted, generating
            # the one slot is busy: the next request waits in the one queue place ...
            waiting = concurrent.futures.ThreadPoolExecutor(1).submit(
                http.post, tiny_url + "/v1/chat/completions",
                json={"model": smollm2.name, **_request("Say hello.", {"max_tokens": 4, "temperature": 0})})
            _wait_for(lambda: metrics(tiny_url, AUTH)["specdec_queue_length"] == 1)
            # ... and one more is refused
            refused = http.post(tiny_url + "/v1/chat/completions",
                                json={"model": smollm2.name, **_request("hi", {"max_tokens": 2})})
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
            assert int(refused.headers["Retry-After"]) >= 1
        # leaving the `with` closed the connection mid-stream: its row is freed and the queued request runs
        served = waiting.result(timeout=60)
    assert served.status_code == 200 and served.json()["choices"][0]["message"]["content"]
    _wait_for(lambda: metrics(tiny_url, AUTH)["specdec_running_requests"] == 0)
    after = metrics(tiny_url, AUTH)
    assert after[cancelled] == start + 1
    assert after["specdec_queue_length"] == 0


def test_non_streaming_client_that_gives_up_is_cancelled(smollm2, tiny_url):
    cancelled = 'specdec_generations_total{finish_reason="cancelled"}'
    start = metrics(tiny_url, AUTH).get(cancelled, 0)
    body = {"model": smollm2.name, **LONG, "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny_url + "/v1/chat/completions", json=body, headers=AUTH, timeout=1.5)
    _wait_for(lambda: metrics(tiny_url, AUTH).get(cancelled, 0) == start + 1)
    assert metrics(tiny_url, AUTH)["specdec_running_requests"] == 0


class _ExplodingDrafter(Drafter):
    """A drafter with a bug that only shows on prompts containing EXPLODE (the server must survive it)."""

    name = "exploding-test-drafter"
    cost = DraftCost(block=2)

    def begin(self, prompt_ids, target) -> None:
        self.explode = "EXPLODE" in target.decode(prompt_ids)

    def propose(self, ctx, budget):
        if self.explode:
            raise RuntimeError("drafter bug")
        return Draft.empty()


def test_a_failing_generation_is_a_500_and_the_server_keeps_serving(smollm2):
    app = create_app(smollm2, _ExplodingDrafter(), max_running=2, max_model_len=256)
    with running_server(app) as url:
        body = {"model": smollm2.name, "max_tokens": 6, "temperature": 0}
        failed = httpx.post(url + "/v1/chat/completions", timeout=60,
                            json={**body, "messages": [{"role": "user", "content": "EXPLODE now"}]})
        assert failed.status_code == 500 and "drafter bug" in failed.json()["error"]["message"]
        fine = httpx.post(url + "/v1/chat/completions", timeout=60,
                          json={**body, "messages": [{"role": "user", "content": "Say hi."}]})
        assert fine.status_code == 200
        assert fine.json()["choices"][0]["message"]["content"] == generate(smollm2, "Say hi.", max_new_tokens=6).text
        assert metrics(url)["specdec_running_requests"] == 0


# ---------------------------------------------------------------- pieces without a server


def test_text_deltas_hold_back_partial_characters_and_stop_prefixes(smollm2):
    text = "Caf\u00e9 \U0001f600 na\u00efve \u4e2d\u6587 END"
    ids = list(smollm2.tokenizer(text, add_special_tokens=False)["input_ids"])
    deltas = TextDeltas(smollm2.decode, stop_strings=["ENDX"])
    pieces = [deltas.push([token]) for token in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert not "".join(pieces).endswith("END")  # could still become "ENDX": held back
    assert "".join(pieces) + deltas.finish(smollm2.decode(ids)) == smollm2.decode(ids)


def test_serve_arguments():
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--model", "m", "--gamma", "4", "--max-running", "2"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.api_key is None and args.max_running == 2
    assert parse_gamma("auto") == "auto" and parse_gamma("4") == 4
    for bad in ("-1", "many"):
        with pytest.raises(ValueError, match="gamma"):
            parse_gamma(bad)


def test_server_schedules_confidence_drafts_across_its_running_requests(smollm2):
    """`--gamma auto` with a drafter that scores its positions: the server's batch step makes one
    scheduler call over every running request, cuts blocks differently per request, and greedy
    answers stay those of plain decoding."""
    from specdec.budget import AutoBudget
    from specdec.cost import CostTable

    class RecordingPolicy(AutoBudget):
        def verify_prefixes(self, seqs, drafts):
            cut = super().verify_prefixes(seqs, drafts)
            calls.append(([len(d) for d in drafts], [len(d) for d in cut]))
            return cut

    calls = []
    table = CostTable({}, [1, 2, 4, 8, 16, 64], [11.0, 12.0, 14.0, 18.0, 26.0, 74.0])
    drafter = make_drafter("tempered", smollm2, gamma=4, draft_temperature=0.7)
    policy = RecordingPolicy(table, draft_ms_per_token=0.0)  # the test drafter runs the target: price it at zero
    app = create_app(smollm2, drafter, budget_policy=policy, max_running=4, max_model_len=MAX_MODEL_LEN)
    with running_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda prompt: client.chat.completions.create(
                model=smollm2.name, max_tokens=10, temperature=0, messages=[{"role": "user", "content": prompt}]),
                PROMPTS[:4]))
    for prompt, answer in zip(PROMPTS[:4], answers):
        assert answer.choices[0].message.content == generate(smollm2, prompt, max_new_tokens=10).text
    shared = [(drafted, kept) for drafted, kept in calls if len(drafted) > 1]
    assert shared, "no step scheduled more than one request"
    assert any(len(set(kept)) > 1 for _, kept in shared)  # blocks cut to different lengths in one step
    assert all(k <= d for drafted, kept in calls for d, k in zip(drafted, kept))
    assert sum(map(sum, (kept for _, kept in calls))) < sum(map(sum, (drafted for drafted, _ in calls)))
