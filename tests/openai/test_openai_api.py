"""pdserve's OpenAI-compatible API through the official `openai` client,
against real clusters of pd-router, pd-prefill and pd-decode processes
(conftest.py) serving stories260K."""
import asyncio
import json
import socket
import time

import openai
import pytest

from conftest import MODEL_NAME

PROMPT = "Once upon a time"


def client(cluster, **kwargs):
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused",
                         max_retries=0, timeout=60, **kwargs)


def test_models_lists_the_short_served_name(cluster):
    models = client(cluster).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completion_writes_the_story(cluster):
    c = client(cluster).completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    assert c.object == "text_completion"
    assert c.id.startswith("cmpl-")
    assert len(c.choices) == 1
    text = c.choices[0].text
    # Real sentences: words and spaces, not random bytes.
    assert len(text.split()) >= 8, text
    assert c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 24
    assert c.usage.total_tokens == c.usage.prompt_tokens + 24


def test_streamed_completion_equals_the_whole_one(cluster):
    api = client(cluster)
    whole = api.completions.create(model=MODEL_NAME, prompt=PROMPT,
                                   max_tokens=40, temperature=0)
    chunks = list(api.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 40


def test_chat_completion_whole_and_streamed(cluster):
    api = client(cluster)
    messages = [{"role": "user", "content": "Tom had a red ball."}]
    whole = api.chat.completions.create(model=MODEL_NAME, messages=messages,
                                        max_tokens=32, temperature=0)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert len(whole.choices[0].message.content.split()) >= 5
    stream = api.chat.completions.create(model=MODEL_NAME, messages=messages,
                                         max_tokens=32, temperature=0,
                                         stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        whole.choices[0].message.content


def test_chat_without_max_tokens_runs_to_the_end_of_the_story(cluster):
    c = client(cluster).chat.completions.create(
        model=MODEL_NAME, temperature=0,
        messages=[{"role": "user", "content": "Lily saw a cat."}])
    assert c.choices[0].finish_reason in ("stop", "length")
    assert c.usage.completion_tokens > 16


def test_n_choices_and_seed_reproducibility(cluster):
    api = client(cluster)

    def run():
        return api.completions.create(model=MODEL_NAME, prompt=PROMPT,
                                      max_tokens=20, temperature=1.0, n=3,
                                      seed=1234)

    first, second = run(), run()
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    again = [c.text for c in sorted(second.choices, key=lambda c: c.index)]
    assert texts == again
    assert len(set(texts)) > 1, texts  # Choices draw differently.
    assert first.usage.completion_tokens == 60
    # Choice 0 is the request with n = 1.
    single = api.completions.create(model=MODEL_NAME, prompt=PROMPT,
                                    max_tokens=20, temperature=1.0, seed=1234)
    assert single.choices[0].text == texts[0]


def test_stop_string_ends_the_text_before_it(cluster):
    api = client(cluster)
    free = api.completions.create(model=MODEL_NAME, prompt=PROMPT,
                                  max_tokens=40, temperature=0).choices[0].text
    word = free.split()[3]
    c = api.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40,
                               temperature=0, stop=[word, "zzzz"])
    assert c.choices[0].finish_reason == "stop"
    assert c.choices[0].text == free[:free.index(word)]


def test_completion_logprobs_and_echo(cluster):
    api = client(cluster)
    c = api.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5,
                               temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5
    assert all(len(top) == 2 for top in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs,
                                   lp.top_logprobs):
        assert logprob <= 0
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)
    echo = api.completions.create(model=MODEL_NAME, prompt=PROMPT,
                                  max_tokens=5, temperature=0, logprobs=1,
                                  echo=True)
    assert echo.choices[0].text == PROMPT + c.choices[0].text
    elp = echo.choices[0].logprobs
    prompt_tokens = echo.usage.prompt_tokens
    assert len(elp.tokens) == prompt_tokens + 5
    assert elp.token_logprobs[0] is None  # Nothing precedes the first.
    assert all(x is not None and x <= 0
               for x in elp.token_logprobs[1:prompt_tokens])
    assert elp.token_logprobs[prompt_tokens:] == pytest.approx(
        lp.token_logprobs, abs=1e-5)


def test_chat_logprobs(cluster):
    c = client(cluster).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi."}],
        max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content
               if "\ufffd" not in t.token)


def test_errors_are_openai_exceptions(cluster):
    api = client(cluster)
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=MODEL_NAME, prompt=PROMPT,
                               max_tokens=10000)  # Beyond the context.
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=MODEL_NAME, prompt=PROMPT,
                               temperature=-1)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="no-such-model", prompt=PROMPT)
    with pytest.raises(openai.NotFoundError):
        api.get("/no/such/path", cast_to=object)


def test_full_router_answers_429(start_cluster):
    # 32 blocks of 16 tokens on the decode worker, and no queue: a request
    # of 400 tokens leaves no room for one of 200.
    busy = start_cluster(1, 1, "--max_queued=0", "--kv_blocks=32")
    api = client(busy)
    stream = api.completions.create(model=MODEL_NAME, prompt=PROMPT,
                                    max_tokens=400, stream=True,
                                    extra_body={"ignore_eos": True})
    next(iter(stream))  # It holds most of the KV pool now.
    with pytest.raises(openai.RateLimitError) as e:
        api.completions.create(model=MODEL_NAME, prompt=PROMPT,
                               max_tokens=200)
    assert e.value.response.headers.get("retry-after") == "1"
    stream.close()


def test_cancelled_stream_frees_its_kv_blocks(cluster):
    free, total = cluster.wait_all_blocks_free()
    assert total > 0 and free == total
    api = client(cluster)
    stream = api.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=500,
        extra_body={"ignore_eos": True}, stream=True)
    it = iter(stream)
    for _ in range(3):
        next(it)
    # The request holds blocks while it runs...
    deadline = time.time() + 5
    while time.time() < deadline and cluster.kv_blocks()[0] == total:
        time.sleep(0.05)
    assert cluster.kv_blocks()[0] < total
    stream.close()  # ...and the client hangs up.
    free, total = cluster.wait_all_blocks_free(timeout=5)
    assert free == total
    assert 'outcome="cancelled"' in cluster.metrics()


def test_disaggregated_output_equals_colocated(cluster, start_cluster):
    colocated = start_cluster(0, 1)
    for kwargs in ({"temperature": 0},
                   {"temperature": 0.9, "seed": 7, "top_p": 0.9},
                   {"temperature": 0.7, "seed": 3, "presence_penalty": 0.5,
                    "frequency_penalty": 0.4, "extra_body":
                        {"repetition_penalty": 1.3, "top_k": 20}},
                   {"temperature": 0, "logit_bias": {"400": 5}}):
        a = client(cluster).completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=48, **kwargs)
        b = client(colocated).completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=48, **kwargs)
        assert a.choices[0].text == b.choices[0].text, kwargs


def test_hundreds_of_concurrent_streams_all_complete(cluster):
    async def main():
        api = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="unused",
                                 max_retries=0, timeout=300)

        async def one(i):
            stream = await api.completions.create(
                model=MODEL_NAME, prompt=PROMPT, max_tokens=16,
                temperature=0.8, seed=i, stream=True)
            text, finish = "", None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
            return text, finish

        results = await asyncio.gather(*(one(i) for i in range(300)))
        await api.close()
        return results

    results = asyncio.run(main())
    assert len(results) == 300
    assert all(finish in ("length", "stop") for _, finish in results)
    assert all(text for text, _ in results)
    free, total = cluster.wait_all_blocks_free()
    assert free == total


def raw_http(port, request, read_timeout=5.0):
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as s:
        s.sendall(request)
        data = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except socket.timeout:
            pass
        return data


def test_bad_http_input_gets_clear_4xx(cluster):
    port = cluster.http_port

    def post(body, extra=b""):
        return raw_http(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                        b"Connection: close\r\nContent-Length: " +
                        str(len(body)).encode() + b"\r\n" + extra + b"\r\n" +
                        body)

    def status(reply):
        return int(reply.split(b" ", 2)[1])

    assert status(post(b"{not json")) == 400
    assert status(post(b'{"prompt": "\xff\xfe"}')) == 400  # Not UTF-8.
    assert status(post(b'{"prompt": 5}')) == 400
    assert status(post(b'{"prompt": "x", "max_tokens": 2, '
                       b'"unknown_field": [1, 2]}')) == 200
    huge = raw_http(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Length: 999999999\r\n\r\n")
    assert status(huge) == 413
    body = json.loads(post(b"{not json").split(b"\r\n\r\n", 1)[1])
    assert body["error"]["type"] == "invalid_request_error"
    # The router still serves.
    assert client(cluster).completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2).choices[0].text


def test_api_key_is_required_when_set(start_cluster):
    keyed = start_cluster(0, 1, "--api_key=sk-test-1,sk-test-2")
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=keyed.base_url, api_key="wrong",
                      max_retries=0).completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 401
    assert "Bearer" in str(e.value)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.base_url, api_key="wrong",
                      max_retries=0).models.list()
    ok = openai.OpenAI(base_url=keyed.base_url, api_key="sk-test-2",
                       max_retries=0)
    assert ok.completions.create(model=MODEL_NAME, prompt=PROMPT,
                                 max_tokens=2).choices[0].text
    # Health and metrics stay open.
    assert "pdserve_router_requests_total" in keyed.metrics()
    import urllib.request
    with urllib.request.urlopen(
            f"http://127.0.0.1:{keyed.http_port}/health") as r:
        assert r.status == 200


def test_no_decode_worker_is_503(start_cluster):
    import os
    import signal
    import urllib.error
    import urllib.request
    lone = start_cluster(0, 1)
    pid = int((lone.dir / "decode-0.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    health = f"http://127.0.0.1:{lone.http_port}/health"
    deadline = time.time() + 10
    status = 200
    while time.time() < deadline and status == 200:
        try:
            with urllib.request.urlopen(health) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        time.sleep(0.1)
    assert status == 503
    with pytest.raises(openai.InternalServerError) as e:
        client(lone).completions.create(model=MODEL_NAME, prompt=PROMPT,
                                        max_tokens=4)
    assert e.value.status_code == 503


def test_served_model_name_flag(start_cluster):
    named = start_cluster(0, 1, "--served_model_name=tiny-stories")
    api = client(named)
    assert [m.id for m in api.models.list().data] == ["tiny-stories"]
    assert api.completions.create(model="tiny-stories", prompt=PROMPT,
                                  max_tokens=2).choices[0].text
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
