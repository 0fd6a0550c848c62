"""Async client for OpenAI-compatible servers (vLLM, or any hosted API) with timeouts, bounded retries
and a response cache.

A fixed model is a typed :class:`Endpoint`: the URL and the served model name are required and checked
up front, so a missing server name fails before a job is submitted, not at the first reward call.

A served model's Slurm job can be preempted and requeued; it comes back on another node and port and its
supervisor rewrites the readiness marker with the new address. So an endpoint read from a marker keeps the
marker's path, and a client that loses the server (connection refused or reset, timeouts) re-reads it and
retries with backoff, for the marker's ``reconnect_timeout_s`` (``serving.reconnect_timeout_s``), instead
of failing the trajectories of a training step after a few seconds of retries.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import random
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import aiohttp

from memupdate.serving.decoding import SAMPLING_KEYS
from memupdate.serving.markers import load_marker

logger = logging.getLogger(__name__)


#: Requests a client keeps in flight at once unless told otherwise; the others wait for a place before their
#: timeout starts.
DEFAULT_MAX_CONCURRENCY = 64


class EndpointError(RuntimeError):
    """The server could not be reached or kept failing; the message names the URL and the attempts."""


@dataclass(frozen=True)
class Endpoint:
    """Where a fixed model is served.

    >>> Endpoint("http://127.0.0.1:8000/v1", "qa-model").chat_url
    'http://127.0.0.1:8000/v1/chat/completions'

    ``api_key`` is the key of a server this project started (each has its own, recorded in its readiness
    marker; never shown in a repr or a log). ``api_key_env`` names an environment variable holding a hosted
    API's key (never the key itself), so configs can be committed. ``marker`` is the readiness marker the
    address was read from (:func:`memupdate.serving.readiness.read_marker` sets it): a client that loses the
    server re-reads it for the server's new address.

    >>> Endpoint("http://127.0.0.1:8000/v1", "qa-model", api_key="s3cret")
    Endpoint(base_url='http://127.0.0.1:8000/v1', model='qa-model', timeout_s=60.0, max_retries=3, api_key_env=None, marker=None)
    """

    base_url: str
    model: str
    timeout_s: float = 60.0
    max_retries: int = 3
    api_key_env: str | None = None
    marker: str | None = None
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        parsed = urlparse(self.base_url or "")
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(
                f"endpoint base_url {self.base_url!r} is not an http(s) URL; set it to the server's "
                "OpenAI-compatible root, e.g. http://127.0.0.1:8000/v1 (a readiness marker's 'endpoint')"
            )
        if not self.model:
            raise ValueError(
                f"endpoint {self.base_url} has no model name; set it to the server's served model name "
                "(vLLM --served-model-name, listed by GET /v1/models)"
            )
        if self.timeout_s <= 0 or self.max_retries < 0:
            raise ValueError(f"endpoint {self.base_url}: timeout_s must be > 0 and max_retries >= 0")
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError(f"endpoint {self.base_url}: give api_key or api_key_env, not both")

    @property
    def chat_url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"

    @property
    def completions_url(self) -> str:
        return self.base_url.rstrip("/") + "/completions"

    def headers(self) -> dict[str, str]:
        if self.api_key is not None:
            return {"Authorization": f"Bearer {self.api_key}"}
        if self.api_key_env is None:
            return {}
        key = os.environ.get(self.api_key_env)
        if not key:
            raise EndpointError(f"environment variable {self.api_key_env} (API key for {self.base_url}) is not set")
        return {"Authorization": f"Bearer {key}"}

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> Endpoint:
        if "api_key" in spec:
            raise ValueError(
                "an endpoint's key is not written in a config: name its environment variable (api_key_env)"
            )
        unknown = set(spec) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown endpoint keys {sorted(unknown)}")
        if spec.get("marker") and not spec.get("api_key_env"):
            # A served model's key is read where its address is, so no config file that names it holds the key.
            spec = {**spec, "api_key": load_marker(spec["marker"]).get("api_key")}
        return cls(**spec)


@dataclass
class ResponseCache:
    """An LRU cache of responses keyed by a hash of (model, request); identical requests at temperature 0
    are answered once, which is most of a judge's work across GRPO rollouts."""

    max_entries: int = 100_000
    hits: int = 0
    misses: int = 0
    _data: OrderedDict[str, Any] = field(default_factory=OrderedDict)

    @staticmethod
    def key(model: str, payload: dict[str, Any]) -> str:
        blob = json.dumps([model, payload], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(blob.encode()).hexdigest()

    def get(self, key: str) -> Any | None:
        if key in self._data:
            self._data.move_to_end(key)
            self.hits += 1
            return self._data[key]
        self.misses += 1
        return None

    def put(self, key: str, value: Any) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.max_entries:
            self._data.popitem(last=False)


class _Retry(Exception):
    """One attempt failed in a way worth retrying; ``lost``: the server did not answer at all."""

    def __init__(self, error: str, *, lost: bool):
        super().__init__(error)
        self.error, self.lost = error, lost


class OpenAIClient:
    """One aiohttp session per event loop; use as ``async with OpenAIClient(endpoint) as client``.

    ``endpoint`` changes when a request finds the server moved (its marker names another address); the
    requests that follow go to the new address, also those whose URL a caller built from the old one.
    """

    # Statuses worth retrying: overload and transient server errors. 4xx errors are the caller's bug.
    RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
    #: What a request's timeout allows per token it asks for (``max_tokens``), over the endpoint's ``timeout_s``: a
    #: full-scale turn may ask for 8,192 tokens, far past a flat 60 s at a loaded server's 20-50 ms a token.
    SECONDS_PER_TOKEN = 0.1
    #: How long a timed-out request's server has to answer ``GET /models``, which tells a slow generation from a
    #: lost server.
    PROBE_TIMEOUT_S = 10.0
    #: The longest pause between two tries while waiting for a lost server to come back.
    MAX_RECONNECT_DELAY_S = 30.0

    def __init__(
        self, endpoint: Endpoint, cache: ResponseCache | None = None, max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    ):
        self.endpoint = endpoint
        self.cache = cache if cache is not None else ResponseCache()
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._session: aiohttp.ClientSession | None = None
        # Every address the server had, so a URL built from an old one is sent to the current one.
        self._bases = [endpoint.base_url.rstrip("/")]
        self._reconnecting = 0

    async def __aenter__(self) -> OpenAIClient:
        timeout = aiohttp.ClientTimeout(total=self.endpoint.timeout_s)
        self.endpoint.headers()  # a hosted API's key variable that is not set fails here, before any request
        self._session = aiohttp.ClientSession(timeout=timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _path(self, url: str) -> str:
        """``url`` relative to the server's address (current or former), so it can be sent to the current one."""
        for base in (self.endpoint.base_url.rstrip("/"), *reversed(self._bases)):
            if url.startswith(base + "/"):
                return url[len(base) :]
        raise ValueError(f"{url} is not a URL of {self.endpoint.model} at {self.endpoint.base_url}")

    def _url(self, path: str) -> str:
        return self.endpoint.base_url.rstrip("/") + path

    def request_timeout_s(self, payload: Mapping[str, Any]) -> float:
        """A request's whole timeout: the endpoint's ``timeout_s`` and :data:`SECONDS_PER_TOKEN` for each token
        it asks for.

        >>> OpenAIClient(Endpoint("http://h:8000/v1", "qa")).request_timeout_s({"max_tokens": 8192})
        879.2
        """
        return round(self.endpoint.timeout_s + self.SECONDS_PER_TOKEN * int(payload.get("max_tokens") or 0), 3)

    async def _attempt(self, url: str, payload: dict[str, Any]) -> dict[str, Any]:
        """One POST; raises :class:`_Retry` for a failure worth retrying, :class:`EndpointError` otherwise."""
        assert self._session is not None
        timeout = self.request_timeout_s(payload)
        try:
            # Per request, not per session: a restarted server's marker may carry a new key.
            headers = self.endpoint.headers()
            async with (
                self._semaphore,
                self._session.post(
                    url, json=payload, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
                ) as response,
            ):
                if response.status == 200:
                    return await response.json()
                body = (await response.text())[:500]
                if response.status not in self.RETRY_STATUSES:
                    raise EndpointError(f"POST {url} returned {response.status}: {body}")
                raise _Retry(f"HTTP {response.status}: {body}", lost=False)
        except TimeoutError as exc:
            if await self._answers():
                # Alive, yet past a timeout that allows for every token asked: the same request would take as long
                # again (a fixed role decodes greedily), so it is not retried, nor is the server waited for.
                raise EndpointError(
                    f"POST {url} took more than {timeout:g} s (timeout_s {self.endpoint.timeout_s:g} s + "
                    f"{self.SECONDS_PER_TOKEN} s for each of its {payload.get('max_tokens')} max_tokens), while "
                    f"the server answers GET /models: it is overloaded or far slower than expected; give it fewer "
                    "concurrent requests (the client's max_concurrency) or raise the endpoint's timeout_s"
                ) from exc
            raise _Retry(f"TimeoutError after {timeout:g} s, and GET /models does not answer", lost=True) from exc
        except aiohttp.ClientError as exc:
            # Refused or reset: the server (or its node) may be gone, not just busy.
            raise _Retry(f"{type(exc).__name__}: {exc}", lost=isinstance(exc, aiohttp.ClientConnectionError)) from exc

    async def _answers(self) -> bool:
        """Whether the server answers ``GET /models`` within :data:`PROBE_TIMEOUT_S`."""
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.PROBE_TIMEOUT_S)
        try:
            async with self._session.get(
                self._url("/models"), headers=self.endpoint.headers(), timeout=timeout
            ) as response:
                return response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def _post(self, url: str, payload: dict[str, Any]) -> dict[str, Any]:
        if self._session is None:
            raise RuntimeError("OpenAIClient used outside 'async with'")
        path = self._path(url)
        last_error, lost = "", False
        attempts = self.endpoint.max_retries + 1
        for attempt in range(attempts):
            url = self._url(path)
            try:
                return await self._attempt(url, payload)
            except _Retry as exc:
                last_error, lost = exc.error, exc.lost
            if attempt + 1 < attempts:
                # Exponential backoff with jitter, so retries from many rollouts do not arrive together.
                await asyncio.sleep(min(8.0, 0.25 * 2**attempt) * (0.5 + random.random()))
        if lost and self.endpoint.marker:
            return await self._reconnect(path, payload, last_error)
        raise EndpointError(f"POST {url} failed after {attempts} attempts; last error: {last_error}")

    async def _reconnect(self, path: str, payload: dict[str, Any], last_error: str) -> dict[str, Any]:
        """Wait for a lost server: re-read its readiness marker (a restarted server rewrites it with its new
        address) and retry with backoff, for the marker's ``reconnect_timeout_s``; then fail naming the marker
        and the last address tried. A missing or unreadable marker fails at once: the run ended or stopped
        the server (the marker is replaced atomically, so a restart never leaves it missing)."""
        marker = self.endpoint.marker
        loop = asyncio.get_running_loop()
        start, delay = loop.time(), 1.0
        if not self._reconnecting:
            logger.warning(
                "%s at %s does not answer (%s); waiting for it, re-reading its readiness marker %s",
                self.endpoint.model,
                self.endpoint.base_url,
                last_error,
                marker,
            )
        self._reconnecting += 1
        try:
            while True:
                tried = self.endpoint.base_url
                try:
                    # A few hundred bytes: reading it in the event loop blocks nothing worth a thread.
                    content = load_marker(marker)
                except (FileNotFoundError, ValueError) as exc:
                    raise EndpointError(
                        f"{self.endpoint.model} at {tried} does not answer ({last_error}), and its readiness "
                        f"marker cannot be re-read for a new address: {exc}"
                    ) from None
                limit = float(content.get("reconnect_timeout_s") or 0.0)
                base = str(content["endpoint"]).rstrip("/")
                if base != self.endpoint.base_url.rstrip("/"):
                    logger.info("readiness marker %s: %s moved from %s to %s", marker, self.endpoint.model, tried, base)
                    self._bases.append(self.endpoint.base_url.rstrip("/"))
                    self.endpoint = dataclasses.replace(self.endpoint, base_url=base)
                if content.get("api_key") and self.endpoint.api_key_env is None:
                    self.endpoint = dataclasses.replace(self.endpoint, api_key=content["api_key"])
                tried = self.endpoint.base_url
                try:
                    result = await self._attempt(self._url(path), payload)
                except _Retry as exc:
                    last_error = exc.error
                else:
                    logger.info("%s answers again at %s after %.0f s", self.endpoint.model, tried, loop.time() - start)
                    return result
                waited = loop.time() - start
                if waited >= limit:
                    raise EndpointError(
                        f"POST {self._url(path)}: {self.endpoint.model} has not answered for {waited:.0f} s "
                        f"(reconnect_timeout_s {limit:.0f} s, from readiness marker {marker}); last address tried "
                        f"{tried}, last error: {last_error}. Is the server's job (the marker's slurm_job_id or pid) "
                        "still running?"
                    )
                await asyncio.sleep(min(delay, limit - waited))
                delay = min(2 * delay, self.MAX_RECONNECT_DELAY_S)
        finally:
            self._reconnecting -= 1

    async def chat(self, messages: list[dict[str, str]], **sampling: Any) -> str:
        """The assistant text for ``messages``; cached by (model, messages, sampling).

        ``sampling`` must state every one of :data:`~memupdate.serving.decoding.SAMPLING_KEYS` (extra
        body fields such as ``response_format`` may follow): a key left out would be filled from the
        served model's generation config, a decoder no other caller of the role asks for.
        ``client.chat(messages, **GREEDY.request(32))`` is a fixed role's request.
        """
        missing = [key for key in SAMPLING_KEYS if sampling.get(key) is None]
        if missing:
            raise ValueError(
                f"chat request to {self.endpoint.model} at {self.endpoint.base_url} leaves {missing} to the "
                f"server's generation config; give every one of {list(SAMPLING_KEYS)}, e.g. "
                "**memupdate.serving.decoding.GREEDY.request(max_tokens)"
            )
        payload = {"model": self.endpoint.model, "messages": messages, **sampling}
        key = ResponseCache.key(self.endpoint.model, payload)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        data = await self._post(self.endpoint.chat_url, payload)
        try:
            text = data["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError) as exc:
            raise EndpointError(f"{self.endpoint.chat_url}: unexpected response {str(data)[:300]}") from exc
        self.cache.put(key, text)
        return text
