"""The OpenAI-compatible client against a real HTTP server on loopback whose failures we control
(a vLLM server cannot be made to fail on demand; the real vLLM round trip is in the vllm-marked tests)."""

import asyncio

import pytest

from memupdate.rewards.scorers import JudgeScorer, QAItem, ReaderScorer, Retrieved
from memupdate.serving.client import Endpoint, EndpointError, OpenAIClient
from memupdate.serving.decoding import GREEDY, SAMPLING_KEYS


def run(coro):
    return asyncio.run(coro)


def test_endpoint_validation_says_how_to_fix():
    with pytest.raises(ValueError, match="is not an http\\(s\\) URL; set it to the server's OpenAI-compatible root"):
        Endpoint("localhost:8000", "qa")
    with pytest.raises(ValueError, match="no model name; set it to the server's served model name"):
        Endpoint("http://127.0.0.1:8000/v1", "")
    with pytest.raises(ValueError, match="unknown endpoint keys"):
        Endpoint.from_dict({"base_url": "http://h/v1", "model": "m", "temperature": 0})


def test_retries_transient_errors_then_caches(chat_server):
    async def main():
        async with chat_server(lambda m: "Paris", fail=2) as server:
            endpoint = Endpoint(server.url, "qa", max_retries=3)
            async with OpenAIClient(endpoint) as client:
                first = await client.chat([{"role": "user", "content": "capital?"}], **GREEDY.request(8))
                second = await client.chat([{"role": "user", "content": "capital?"}], **GREEDY.request(8))
            return first, second, server.requests, client.cache

    first, second, requests, cache = run(main())
    assert first == second == "Paris"
    assert len(requests) == 3 and requests[0]["model"] == "qa"  # two failures, one success, then the cache
    assert cache.hits == 1


def test_gives_up_after_bounded_retries_and_does_not_retry_client_errors(chat_server):
    async def main(status):
        async with chat_server(lambda m: "x", fail=99, status=status) as server:
            async with OpenAIClient(Endpoint(server.url, "qa", max_retries=1)) as client:
                with pytest.raises(EndpointError) as info:
                    await client.chat([{"role": "user", "content": "q"}], **GREEDY.request(8))
            return str(info.value), len(server.requests)

    message, attempts = run(main(503))
    assert "failed after 2 attempts; last error: HTTP 503: overloaded" in message and attempts == 2
    message, attempts = run(main(400))
    assert "returned 400" in message and attempts == 1


def test_timeout_is_enforced(chat_server):
    async def main():
        async with chat_server(lambda m: "late", delay=2.0) as server:
            async with OpenAIClient(Endpoint(server.url, "qa", timeout_s=0.2, max_retries=0)) as client:
                with pytest.raises(EndpointError, match="TimeoutError"):
                    await client.chat([{"role": "user", "content": "q"}], **GREEDY.request(8))

    run(main())


def test_a_request_has_time_for_every_token_it_asks_and_a_slow_live_server_is_not_waited_for(chat_server):
    """A request's timeout grows with its max_tokens (a full-scale turn may ask for 8,192); past it, a server that
    answers GET /models is slow, not lost: the request fails at once, saying so, instead of being generated again
    and then retried for the marker's reconnect time."""

    async def main(delay, max_tokens, marker=None):
        async with chat_server(lambda m: "late", delay=delay, models=True) as server:
            endpoint = Endpoint(server.url, "qa", timeout_s=0.2, max_retries=3, marker=marker)
            async with OpenAIClient(endpoint) as client:
                try:
                    return await client.chat([{"role": "user", "content": "q"}], **GREEDY.request(max_tokens))
                except EndpointError as err:
                    return err, len(server.requests)

    # 0.2 s + 0.1 s x 20 tokens: time enough for a 1 s generation.
    assert run(main(delay=1.0, max_tokens=20)) == "late"
    # 0.2 s + 0.1 s x 4 = 0.6 s: not for a 2 s one; one request, no retries, no wait on the (absent) marker.
    error, requests = run(main(delay=2.0, max_tokens=4, marker="/nonexistent/qa.ready.json"))
    assert requests == 1
    assert "more than 0.6 s (timeout_s 0.2 s + 0.1 s for each of its 4 max_tokens), while the server answers" in str(
        error
    )


def test_requests_past_the_clients_concurrency_wait_before_their_timeout_starts(chat_server):
    """What serving.max_in_flight relies on: a request waiting for a place at the client is not timed, so a
    server given a few requests at a time answers each within its timeout however many are queued."""

    async def main():
        async with chat_server(lambda m: "ok", delay=0.4) as server:
            endpoint = Endpoint(server.url, "qa", timeout_s=0.2, max_retries=0)
            async with OpenAIClient(endpoint, max_concurrency=1) as client:
                began = asyncio.get_running_loop().time()
                replies = await asyncio.gather(
                    *(client.chat([{"role": "user", "content": f"q{i}"}], **GREEDY.request(4)) for i in range(4))
                )
                return replies, asyncio.get_running_loop().time() - began

    # Each 0.4 s, within its 0.2 s + 0.1 s x 4 tokens; one after another, 1.6 s in all.
    replies, seconds = run(main())
    assert replies == ["ok"] * 4 and seconds >= 1.6


def test_reader_and_judge_scorers_speak_the_protocol(chat_server):
    def reader_reply(messages):
        prompt = messages[0]["content"]
        return "7 May 2023" if "7 May 2023" in prompt else "I don't know"

    def judge_reply(messages):
        prompt = messages[0]["content"]
        return '{"label": "CORRECT"}' if "Generated answer: 7 May 2023" in prompt else '{"label": "WRONG"}'

    item = QAItem("When did Caroline go to the support group?", "7 May 2023", 2)
    with_answer = [
        Retrieved("Caroline went to the support group on 7 May 2023.", date="8 May 2023", speaker="Caroline")
    ]
    without = [Retrieved("Caroline likes painting.")]

    async def main():
        async with chat_server(reader_reply) as reader_server, chat_server(judge_reply) as judge_server:
            async with (
                OpenAIClient(Endpoint(reader_server.url, "qa")) as rc,
                OpenAIClient(Endpoint(judge_server.url, "judge")) as jc,
            ):
                reader = ReaderScorer(rc, metric="locomo_f1")
                f1 = await reader.score([item, item], [with_answer, without])
                judged = await JudgeScorer(reader, jc).score([item, item], [with_answer, without])
            return f1, judged, reader_server.requests, judge_server.requests

    f1, judged, requests, judge_requests = run(main())
    assert f1 == [1.0, 0.0] and judged == [1.0, 0.0]
    prompt = requests[0]["messages"][0]["content"]
    # Mem0's ANSWER_PROMPT (the reader's default protocol): each speaker's memories as a JSON list.
    assert (
        'Memories for user Caroline:\n\n    [\n    "8 May 2023: Caroline went to the support group on 7 May 2023."\n]'
        in prompt
    )
    # Every sampling key stated (none left to the served model's generation config): greedy, the answer cap.
    assert {k: requests[0][k] for k in SAMPLING_KEYS} == GREEDY.request(32)
    assert all({k: r[k] for k in SAMPLING_KEYS} == GREEDY.request(256) for r in judge_requests)
    assert all(r["response_format"] == {"type": "json_object"} for r in judge_requests)
