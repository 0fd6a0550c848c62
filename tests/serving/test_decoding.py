"""Every request to a served model states every sampling key, so no server fills one from the model's
generation config. That the QA phase, the reader scorer and the evaluation ask the QA model alike is
shown in tests/agents/test_memory_loop.py, where the agent loop runs."""

import asyncio

import pytest

from memupdate.serving.client import Endpoint, OpenAIClient
from memupdate.serving.decoding import GREEDY, SAMPLING_KEYS, Decoding
from memupdate.serving.token_client import VLLMTokenClient

MESSAGES = [{"role": "user", "content": "capital?"}]


def test_chat_refuses_a_request_that_leaves_a_sampling_key_to_the_server(chat_server):
    async def main():
        async with chat_server(lambda m: "Paris") as server:
            async with OpenAIClient(Endpoint(server.url, "qa")) as client:
                with pytest.raises(ValueError, match=r"leaves \['top_k', 'repetition_penalty'\] to the server's"):
                    await client.chat(MESSAGES, temperature=0.0, top_p=1.0, max_tokens=8)
                # None is JSON null, which the server fills from the generation config just the same.
                with pytest.raises(ValueError, match=r"leaves \['repetition_penalty'\]"):
                    await client.chat(MESSAGES, **{**GREEDY.request(8), "repetition_penalty": None})
                reply = await client.chat(MESSAGES, **GREEDY.request(8), response_format={"type": "json_object"})
            return reply, server.requests

    reply, requests = asyncio.run(main())
    # The refused requests never left the client; the complete one went as given.
    assert reply == "Paris" and len(requests) == 1
    assert {k: requests[0][k] for k in SAMPLING_KEYS} == GREEDY.request(8)


def test_token_client_states_every_sampling_key_whatever_the_params_leave_out():
    client = VLLMTokenClient(Endpoint("http://127.0.0.1:1/v1", "qa"), max_tokens=16)

    def sampling(params):
        payload = client.build_payload([1, 2, 3], params)
        return {k: payload[k] for k in SAMPLING_KEYS}

    # Left out or None: vLLM's SamplingParams defaults, as verl's own vLLM server decodes, never the model's.
    defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "max_tokens": 16}
    assert sampling({}) == sampling({"top_k": 0, "repetition_penalty": None, "logprobs": True}) == defaults
    # What is given goes as given: a fixed role's greedy request, or any other decoder.
    assert sampling(GREEDY.request(8)) == GREEDY.request(8)
    penalised = Decoding(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05).request(8)
    assert sampling(penalised) == penalised


def test_a_decoder_needs_a_positive_cap():
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        GREEDY.request(0)
