"""`specgraph serve` against a live server on 127.0.0.1, through the official openai client.

The served model is a tiny random Llama with SmolLM2's vocabulary, so the real tokenizer and chat
template apply while each forward costs microseconds. Every loop here is bounded in count and time.
"""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import uvicorn
from openai import OpenAI

import specgraph
from specgraph.runtime.server import build_app
from models import tiny_llama, uncached_greedy

MODEL = "tiny-smollm2-vocab"


@pytest.fixture(scope="module")
def tokenizer():
    return specgraph.load_model("smollm2-135m-instruct")[1]


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(layers=2, vocab=len(tokenizer), seed=3)


class LiveServer:
    """uvicorn in a background thread on an ephemeral port; stops (gracefully) on exit."""

    def __init__(self, app, graceful_timeout: float | None = None):
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    timeout_graceful_shutdown=graceful_timeout))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.client = OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "server did not stop"

    @property
    def engine(self) -> specgraph.Engine:
        return self.app.state.server.engine.engine


def serve(model, tokenizer, graceful_timeout=None, **engine_kwargs):
    max_pending = engine_kwargs.pop("max_pending", 256)
    engine = specgraph.Engine(model, tokenizer=tokenizer, page_size=8, **engine_kwargs)
    return LiveServer(build_app(engine, model_name=MODEL, max_pending=max_pending, shutdown_timeout=2.0),
                      graceful_timeout)


def _wait_until(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_completions_and_chat_equal_engine_generate(model, tokenizer):
    reference = specgraph.Engine(model, tokenizer=tokenizer, page_size=8, num_blocks=64)
    prompt = "def fibonacci(n):"
    want = reference.generate(prompt, max_new_tokens=12)[0]
    messages = [{"role": "user", "content": "Say hello."}]
    chat_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want_chat = reference.generate(chat_prompt, max_new_tokens=10)[0]
    with serve(model, tokenizer, num_blocks=64) as live:
        c = live.client
        got = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
        assert got.usage.completion_tokens == len(want.token_ids)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        by_ids = c.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
        assert by_ids.choices[0].text == want.text
        streamed = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
        chunks = list(streamed)
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.text
        assert chunks[-1].usage.completion_tokens == len(want.token_ids)

        chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
        assert chat.choices[0].message.content == want_chat.text
        stream = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in stream) == want_chat.text

        lp = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=3)
        top = lp.choices[0].logprobs.top_logprobs[0]
        assert len(top) == 3 and max(top.values()) == pytest.approx(lp.choices[0].logprobs.token_logprobs[0])
        two = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, n=2, seed=1)
        assert [ch.index for ch in two.choices] == [0, 1]
        assert [m.id for m in c.models.list().data] == [MODEL]
        health = httpx.get(live.url + "/health")
        assert health.status_code == 200
        metrics = httpx.get(live.url + "/metrics").text
        for name in ("specgraph_requests_total", "specgraph_time_to_first_token_seconds_bucket",
                     "specgraph_inter_token_latency_seconds_bucket", "specgraph_kv_pool_usage",
                     "specgraph_prefix_cache_hit_rate", "specgraph_preemptions_total",
                     "specgraph_generation_tokens_total"):
            assert name in metrics, name


def test_sixty_four_concurrent_streams_on_a_small_pool(model, tokenizer):
    prompts = [list(range(100 + 7 * i, 100 + 7 * i + 5 + i % 11)) for i in range(64)]
    want = []
    for p in prompts:  # the single-request greedy output, ended at EOS as the server ends it
        tokens = uncached_greedy(model, p, 8)
        if tokenizer.eos_token_id in tokens:
            tokens = tokens[:tokens.index(tokenizer.eos_token_id) + 1]
        want.append(tokenizer.decode(tokens, skip_special_tokens=True))
    with serve(model, tokenizer, num_blocks=12, max_num_seqs=8) as live:
        async def one(client, p):
            stream = await client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0,
                                                     stream=True)
            return "".join([chunk.choices[0].text async for chunk in stream])

        async def run_all():
            from openai import AsyncOpenAI

            client = AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=300)
            return await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in prompts)), timeout=300)

        got = asyncio.run(run_all())
        for p, w, g in zip(prompts, want, got):
            assert g == w, p
        engine = live.engine
        assert engine.stats["preemptions"] > 0
        _wait_until(lambda: not engine.has_unfinished())
        assert engine.stats["kv_pool_usage"] == 0.0


def test_cancelled_stream_frees_its_blocks(model, tokenizer):
    with serve(model, tokenizer, num_blocks=64) as live:
        engine = live.engine
        with httpx.Client(timeout=60) as http:
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "stream": True,
                    "temperature": 0}
            with http.stream("POST", live.url + "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                for _ in range(3):
                    assert next(lines).startswith("data: ")
                    next(lines)  # blank separator
                assert engine.stats["kv_pool_usage"] > 0
        _wait_until(lambda: not engine.has_unfinished() and engine.stats["kv_pool_usage"] == 0.0)
        assert 'specgraph_requests_total{endpoint="completions",status="aborted"} 1.0' in \
            httpx.get(live.url + "/metrics").text


def test_shutdown_cancels_in_flight_streams_and_frees_their_blocks(model, tokenizer):
    live = serve(model, tokenizer, graceful_timeout=0.5, num_blocks=128)
    received = []

    def client():
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "stream": True, "temperature": 0}
        try:
            with httpx.Client(timeout=60) as http, http.stream("POST", live.url + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    received.append(line)
        except httpx.HTTPError:
            pass  # the server closed the connection: expected

    with live:
        engine = live.engine
        reader = threading.Thread(target=client, daemon=True)
        reader.start()
        _wait_until(lambda: len(received) >= 4)
    reader.join(timeout=30)
    assert not reader.is_alive()
    assert "data: [DONE]" not in received  # cut short, not run to its 900 tokens
    assert not engine.has_unfinished() and engine.stats["kv_pool_usage"] == 0.0


def test_bad_requests_get_openai_errors(model, tokenizer):
    with serve(model, tokenizer, num_blocks=16, max_pending=1) as live:
        post = lambda path, body: httpx.post(live.url + path, json=body, timeout=60)  # noqa: E731
        cases = [
            ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
            ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
            ({"model": MODEL, "prompt": []}, 400, "prompt"),
            ({"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo"),
            ({"model": MODEL, "prompt": "hi " * 40, "max_tokens": 200}, 400, "KV pool exhausted"),
            ({"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
            ({"model": MODEL, "prompt": "hi", "n": 2}, 400, "max_pending"),
        ]
        for body, status, needle in cases:
            r = post("/v1/completions", body)
            assert r.status_code == status, (body, r.text)
            assert needle in r.json()["error"]["message"] or needle == r.json()["error"]["param"], r.text
        r = post("/v1/chat/completions", {"model": MODEL, "messages": []})
        assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
        with httpx.Client(timeout=60) as http:  # one request in flight fills max_pending=1
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 100, "stream": True}
            with http.stream("POST", live.url + "/v1/completions", json=body) as first:
                lines = first.iter_lines()  # keep it: a dropped iterator closes the response
                next(lines)
                second = post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
                assert second.status_code == 429 and second.json()["error"]["type"] == "rate_limit_error"
        _wait_until(lambda: live.engine.stats["kv_pool_usage"] == 0.0)


def test_cli_bad_arguments_print_one_line_and_exit_2(capsys):
    from specgraph.runtime.cli import main

    for argv in (["generate", "hi", "--kv-dtype", "fp16x"], ["serve", "--port", "eighty"], ["bogus"],
                 ["generate", "hi", "--model", "/no/such/model"], ["distill", "--out", "h", "--self-asked", "-1"],
                 ["distill", "--out", "h", "--lr", "0"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("specgraph: error:"), (argv, err)


def test_cli_chat_streams_and_reuses_the_prefix_cache_across_turns(model, tokenizer, tmp_path, monkeypatch, capsys):
    from specgraph.runtime.cli import main

    folder = tmp_path / "tiny"
    model.config.use_cache = False
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    turns = iter(["Hello there, how are you today?", "And what about tomorrow?", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(turns))
    assert main(["chat", "--model", str(folder), "--max-new-tokens", "6", "--num-blocks", "64",
                 "--page-size", "8"]) == 0
    err = capsys.readouterr().err
    reports = [line for line in err.splitlines() if "prompt tokens from the prefix cache" in line]
    assert len(reports) == 2, err
    cached = int(reports[1].split(", ")[-1].split("/")[0])
    assert cached > 0, reports[1]  # the second turn's prompt starts with the first turn's blocks
