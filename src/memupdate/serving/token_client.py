"""verl's token-in/token-out ``generate`` over a vLLM OpenAI server's HTTP API.

:class:`VLLMTokenClient` serves the fixed model of two-stage training, verl's rollout on CPU and
evaluation; :class:`GenerationMeter` counts what a client generated and for how long.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from memupdate.serving.client import DEFAULT_MAX_CONCURRENCY, Endpoint, EndpointError, OpenAIClient
from memupdate.serving.decoding import VLLM_DEFAULTS
from memupdate.serving.readiness import get_models

logger = logging.getLogger(__name__)

#: Sampling keys vLLM's /v1/completions accepts that are passed through unchanged when given.
PASSTHROUGH_SAMPLING_KEYS = frozenset(
    {
        "presence_penalty",
        "frequency_penalty",
        "min_p",
        "seed",
        "ignore_eos",
        "min_tokens",
        "stop",
        "include_stop_str_in_output",
        "length_penalty",
    }
)
#: Keys verl sets that mean nothing over HTTP (log-probs are always returned).
_IGNORED_SAMPLING_KEYS = frozenset({"logprobs", "n", "detokenize"})


class VLLMTokenClient:
    """verl's ``generate(request_id, *, prompt_ids, sampling_params) -> TokenOutput`` against a vLLM server.

    The prompt goes as raw token ids to ``/v1/completions`` (no chat template is applied server-side:
    the agent loop already rendered it), and the answer comes back as token ids with their log-probs,
    so what the trainer sees is exactly what was sampled. ``max_tokens`` caps every request; a smaller
    ``sampling_params["max_tokens"]`` wins; and, like verl's own vLLM server, a request never asks
    for more than the context has left (``max_model_len``, read once from ``/v1/models`` unless
    given), because vLLM rejects that with HTTP 400. Every request states every sampling key
    (:data:`~memupdate.serving.decoding.SAMPLING_KEYS`): one the sampling params leave out is vLLM's
    ``SamplingParams`` default (:data:`~memupdate.serving.decoding.VLLM_DEFAULTS`, what verl's own
    server would decode with), never the model's generation config. One aiohttp session per event loop
    (verl runs one loop per worker; tests run one per ``asyncio.run``); timeouts and retries are the
    :class:`Endpoint`'s.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        max_tokens: int,
        *,
        max_model_len: int | None = None,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    ):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.endpoint = endpoint
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.max_concurrency = max_concurrency
        # loop -> (its client, the async generator that closes that client when the loop shuts down)
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[OpenAIClient, Any]] = (
            weakref.WeakKeyDictionary()
        )
        self._warned: set[str] = set()

    # Ray ships agent-loop arguments to workers by pickling; sessions belong to one process and loop.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_clients"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._clients = weakref.WeakKeyDictionary()

    async def _client(self) -> OpenAIClient:
        loop = asyncio.get_running_loop()
        entry = self._clients.get(loop)
        if entry is None:
            client = OpenAIClient(self.endpoint, max_concurrency=self.max_concurrency)
            # Neither step suspends, so no other coroutine can slip in and open a second session.
            await client.__aenter__()
            closer = _close_at_loop_shutdown(client)
            await closer.__anext__()
            entry = self._clients[loop] = (client, closer)
        return entry[0]

    async def close(self) -> None:
        """Close this event loop's session now (otherwise it closes when its loop shuts down)."""
        with contextlib.suppress(RuntimeError):
            entry = self._clients.pop(asyncio.get_running_loop(), None)
            if entry is not None:
                await entry[1].aclose()

    async def __aenter__(self) -> VLLMTokenClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _context_length(self) -> int | None:
        if self.max_model_len is None:
            cards = await asyncio.to_thread(
                get_models, self.endpoint.base_url, self.endpoint.timeout_s, api_key=self.endpoint.api_key
            )
            lengths = [c.get("max_model_len") for c in cards if c["id"] == self.endpoint.model]
            # 0 = unknown (not a vLLM server, or the model is not listed): no clamping, vLLM decides.
            self.max_model_len = int(lengths[0]) if lengths and lengths[0] else 0
        return self.max_model_len or None

    def build_payload(
        self, prompt_ids: Sequence[int], sampling_params: Mapping[str, Any], max_model_len: int | None = None
    ) -> dict[str, Any]:
        """The /v1/completions request body for verl-style ``sampling_params``.

        >>> c = VLLMTokenClient(Endpoint("http://127.0.0.1:1/v1", "m"), max_tokens=8)
        >>> p = c.build_payload([1, 2], {"temperature": 0, "max_tokens": 99, "logprobs": True})
        >>> p["prompt"], p["max_tokens"], p["logprobs"], p["return_token_ids"]
        ([1, 2], 8, 0, True)
        >>> {k: p[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty")}
        {'temperature': 0.0, 'top_p': 1.0, 'top_k': -1, 'repetition_penalty': 1.0}
        >>> c.build_payload([1, 2], {}, max_model_len=5)["max_tokens"]
        3
        """
        params = dict(sampling_params)
        requested = params.pop("max_tokens", None) or params.pop("max_new_tokens", None) or self.max_tokens
        max_tokens = min(int(requested), self.max_tokens)
        if max_model_len:
            room = max_model_len - len(prompt_ids)
            if room < 1:
                raise ValueError(
                    f"prompt of {len(prompt_ids)} tokens leaves no room to generate within max_model_len "
                    f"{max_model_len} of {self.endpoint.model} at {self.endpoint.base_url}"
                )
            max_tokens = min(max_tokens, room)
        payload: dict[str, Any] = {
            "model": self.endpoint.model,
            "prompt": [int(t) for t in prompt_ids],
            "max_tokens": max(1, max_tokens),
            "temperature": float(_take(params, "temperature")),
            "top_p": float(_take(params, "top_p")),
            # 0 means "no cut" as -1 does (verl's configs use both); older vLLM versions take only -1.
            "top_k": int(_take(params, "top_k")) or -1,
            "repetition_penalty": float(_take(params, "repetition_penalty")),
            "stop_token_ids": [int(t) for t in params.pop("stop_token_ids", None) or []],
            "return_token_ids": True,
            # 0 = the sampled token's own log-prob, no alternatives: what the policy loss needs.
            "logprobs": 0,
            # Special tokens (<|im_end|>, tool tags) are part of the trajectory; keep them in the text.
            "skip_special_tokens": False,
        }
        for key in list(params):
            if key in PASSTHROUGH_SAMPLING_KEYS:
                payload[key] = params.pop(key)
            elif key in _IGNORED_SAMPLING_KEYS:
                params.pop(key)
        unknown = sorted(set(params) - self._warned)
        if unknown:
            self._warned.update(unknown)
            logger.warning("VLLMTokenClient ignores sampling params it does not know: %s", unknown)
        return payload

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> Any:
        """Generate from ``prompt_ids``; returns verl's ``TokenOutput`` (token ids, log-probs, stop reason).

        ``request_id`` is logged on errors only: vLLM assigns its own ids, and verl's ids repeat
        across turns of one trajectory. Multi-modal ``kwargs`` (image_data, ...) are not supported.
        """
        from verl.workers.rollout.replica import TokenOutput

        if any(kwargs.get(k) is not None for k in ("image_data", "video_data", "audio_data")):
            raise NotImplementedError("VLLMTokenClient serves text models only (no image/video/audio data)")
        payload = self.build_payload(prompt_ids, sampling_params, await self._context_length())
        client = await self._client()
        try:
            data = await client._post(self.endpoint.completions_url, payload)
        except EndpointError as exc:
            raise EndpointError(f"request {request_id}: {exc}") from exc
        token_ids, log_probs, finish_reason = parse_completion(data, self.endpoint.completions_url)
        stop_reason = {"stop": "completed", "length": "completed", "abort": "aborted"}.get(
            finish_reason or "", finish_reason
        )
        # Like verl's own servers, log-probs come back only when asked for: an episode whose policy turns
        # carry none (calculate_log_probs off) cannot take them for the served role's turns either.
        if not sampling_params.get("logprobs", True):
            log_probs = None
        return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason=stop_reason)


class GenerationMeter:
    """A verl ``generate`` client that counts generated tokens and the seconds generation was under way:
    the union of the requests' time in flight, so concurrent requests are not counted twice. Both only
    grow: a caller takes differences."""

    def __init__(self, client: Any):
        self.client = client
        self.generated_tokens = 0
        self.seconds = 0.0
        self._in_flight = 0
        self._since = 0.0

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs):
        if self._in_flight == 0:
            self._since = time.perf_counter()
        self._in_flight += 1
        try:
            output = await self.client.generate(
                request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs
            )
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self.seconds += time.perf_counter() - self._since
        self.generated_tokens += len(output.token_ids)
        return output


class SharedGreedyRequests:
    """A verl ``generate`` client that generates each greedy request once: identical requests at temperature 0
    share one generation, in flight or among the last ``size`` finished; a request that samples is sent as is.

    The fixed role decodes greedily, so the rollouts of a GRPO group send it identical requests: in a QA stage
    each of a group's 8 trajectories replays the fixed memory model's whole episode on the same question and
    store, and in a memory stage the QA phase asks the same question of stores the rollouts left alike. Without
    this the served model makes each episode 8 times per step (and again at every step that draws the question,
    the fixed model being fixed for the stage), while the trainer's GPUs wait. ``shared`` counts the requests
    answered from another's generation; ``seconds`` is the wrapped client's (a :class:`GenerationMeter`).
    """

    def __init__(self, client: Any, size: int = 4096):
        self.client = client
        self.size = size
        self.shared = 0
        self._done: OrderedDict[str, Any] = OrderedDict()
        self._pending: dict[str, asyncio.Future] = {}

    @property
    def seconds(self) -> float:
        return self.client.seconds

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs):
        if sampling_params.get("temperature") != 0 or any(value is not None for value in kwargs.values()):
            return await self.client.generate(
                request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs
            )
        key = json.dumps([list(prompt_ids), sampling_params], sort_keys=True, default=str)
        if key in self._done:
            self._done.move_to_end(key)
            self.shared += 1
            return self._done[key].model_copy(deep=True)
        pending = self._pending.get(key)
        if pending is None:
            pending = asyncio.ensure_future(
                self.client.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
            )
            self._pending[key] = pending
            pending.add_done_callback(lambda done: self._finish(key, done))
        else:
            self.shared += 1
        # Shielded: one caller cancelled must not cancel the generation the others wait for. A copy each: the
        # agent loop owns the lists it is given.
        return (await asyncio.shield(pending)).model_copy(deep=True)

    def _finish(self, key: str, done: asyncio.Future) -> None:
        self._pending.pop(key, None)
        if done.cancelled() or done.exception() is not None:
            return
        self._done[key] = done.result()
        while len(self._done) > self.size:
            self._done.popitem(last=False)


def _take(params: dict[str, Any], key: str) -> Any:
    """Pop a sampling key; absent or None is vLLM's ``SamplingParams`` default, never the server's."""
    value = params.pop(key, None)
    return getattr(VLLM_DEFAULTS, key) if value is None else value


async def _close_at_loop_shutdown(client: OpenAIClient):
    """Suspended until closed: ``asyncio.run`` (``loop.shutdown_asyncgens``) closes every unfinished
    async generator before it closes the loop, which closes the session without the caller having to,
    as verl's agent loops never call ``close()``."""
    try:
        yield
    finally:
        await client.close()


def parse_completion(
    data: Mapping[str, Any], url: str = "/v1/completions"
) -> tuple[list[int], list[float], str | None]:
    """(generated token ids, their log-probs, finish_reason) from a vLLM /v1/completions response.

    vLLM puts the ids in ``choices[0].token_ids`` (with ``return_token_ids``) and the log-probs in
    ``choices[0].logprobs.token_logprobs`` (with ``logprobs: 0``), one per generated token.

    >>> parse_completion({"choices": [{"token_ids": [5, 7], "finish_reason": "length",
    ...                                "logprobs": {"token_logprobs": [-0.5, -1.25]}}]})
    ([5, 7], [-0.5, -1.25], 'length')
    """
    try:
        choice = data["choices"][0]
        token_ids = [int(t) for t in choice["token_ids"]]
        logprobs = choice.get("logprobs") or {}
        raw = logprobs.get("token_logprobs") or []
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise EndpointError(
            f"{url}: response has no choices[0].token_ids (is this vLLM with return_token_ids?): {str(data)[:300]}"
        ) from exc
    if len(raw) != len(token_ids):
        raise EndpointError(f"{url}: {len(token_ids)} token ids but {len(raw)} log-probs in {str(data)[:300]}")
    # vLLM sends -inf as -9999.0 (JSON has no infinity); None would mean "not computed".
    log_probs = [float("-inf") if lp is None else float(lp) for lp in raw]
    return token_ids, log_probs, choice.get("finish_reason")
