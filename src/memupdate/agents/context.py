"""What the agent loops of one worker share, owned by that worker.

verl builds a new agent loop for every trajectory, so what must outlive one trajectory lives in a
:class:`LoopContext` that the loop is given:

- the initial prompt's token ids, by (template, messages, tools): a GRPO batch holds every prompt ``n``
  times, and rendering the chat template with six tool schemas and tokenising ~2k tokens is the loop's
  largest per-episode CPU cost, on the event loop's executor while other episodes wait (bounded, oldest
  out first);
- the fixed model's clients, one per endpoint and answer cap: a client of each loop's own would open an
  HTTP session and ask the server for its context length every trajectory; their meters say how long the
  fixed role generated;
- deterministic request ids (``deterministic_ids``), a counter under a prefix the owner sets per rollout,
  so a rerun gives every trajectory the same id (reproducible in-process runs).

Owners: our in-process worker (:class:`memupdate.rollout.workers.MultiOutputAgentLoopWorker`, used by
evaluation, the cold start and benchmarks) holds one per worker and hands it to every loop it builds, and
its owner reads it (meters, ids); it goes with the worker. verl's own Ray workers build loops without one:
those share :func:`process_context`, which lives as long as the worker's process. The fixed-model clients'
HTTP sessions close with the event loop that opened them.

Request ids key trial stores in the process's store manager, so two contexts of one process must not
make the same ids: each context's ids carry its ``name`` (give in-process owners distinct names), and a
reused id is refused by the store manager (``NamespaceInUse``), never shared silently.

This module imports nothing of verl (see :mod:`memupdate.agents.fields`).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

PROMPT_CACHE_SIZE = 1024


class LoopContext:
    """The prompt-id cache, the fixed-model clients and the request-id sequence of one worker's loops.

    >>> context = LoopContext("eval")
    >>> context.reset_request_ids("seed:0"); first = context.next_request_id()
    >>> context.reset_request_ids("seed:0"); context.next_request_id() == first
    True
    >>> first.startswith("00000000") and len(first) == 32 and first != LoopContext("train").next_request_id()
    True
    """

    def __init__(self, name: str = "", *, prompt_cache_size: int = PROMPT_CACHE_SIZE):
        self.name = name
        self.prompt_cache_size = prompt_cache_size
        self._prompt_ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._fixed_clients: dict[str, Any] = {}
        self._prefix, self._counter = "", itertools.count()

    # ---------------------------------------------------------------------------------- request ids

    def reset_request_ids(self, prefix: str) -> None:
        """Restart the deterministic request ids (before each batch of a reproducible run)."""
        self._prefix, self._counter = prefix, itertools.count()

    def next_request_id(self) -> str:
        """8 hex digits of the counter (ids sort in the order they were made), then a hash of the context's
        name, the prefix and the counter."""
        n = next(self._counter)
        return f"{n:08x}" + hashlib.sha256(f"{self.name}:{self._prefix}:{n}".encode()).hexdigest()[:24]

    # ---------------------------------------------------------------------------------- prompt ids

    async def prompt_ids(self, key_parts: list[Any], build: Callable[[], Awaitable[list[int]]]) -> list[int]:
        """The token ids of the prompt ``key_parts`` describe, built by ``build`` on the first request."""
        key = hashlib.sha256(json.dumps(key_parts, sort_keys=True, default=str).encode()).hexdigest()
        ids = self._prompt_ids.get(key)
        if ids is None:
            ids = self._prompt_ids[key] = tuple(await build())
            if len(self._prompt_ids) > self.prompt_cache_size:
                self._prompt_ids.popitem(last=False)
        return list(ids)

    # ---------------------------------------------------------------------------------- fixed model

    def fixed_client(self, spec: Any, max_tokens: int) -> Any:
        """The fixed model's client: an object with verl's ``generate`` is used as is; an endpoint mapping
        (``{base_url, model, ...}``, as agent_loops.yaml gives it) becomes a ``VLLMTokenClient`` behind a
        ``GenerationMeter``, one per endpoint and cap, whose greedy requests are made once for all the
        trajectories that send them (``SharedGreedyRequests``). The mapping's ``max_tokens`` caps each of its
        turns (default ``max_tokens``), as the policy's own cap does."""
        if spec is None or hasattr(spec, "generate"):
            return spec
        if hasattr(spec, "items") and not isinstance(spec, Mapping):  # an OmegaConf DictConfig
            from omegaconf import OmegaConf

            spec = OmegaConf.to_container(spec, resolve=True)
        if not isinstance(spec, Mapping):
            raise ValueError(f"fixed_model must be an endpoint {{base_url, model}} or a client, got {spec!r}")
        spec = dict(spec)
        max_tokens = int(spec.pop("max_tokens", max_tokens))
        key = json.dumps([spec, max_tokens], sort_keys=True, default=str)
        client = self._fixed_clients.get(key)
        if client is None:
            # Imported here: the serving client is not needed by loops without a fixed model.
            from memupdate.serving.client import Endpoint
            from memupdate.serving.token_client import GenerationMeter, SharedGreedyRequests, VLLMTokenClient

            client = SharedGreedyRequests(
                GenerationMeter(VLLMTokenClient(Endpoint.from_dict(spec), max_tokens=max_tokens))
            )
            self._fixed_clients[key] = client
        return client

    def fixed_seconds(self) -> float:
        """Seconds the fixed model's clients have been generating (only grows: take differences)."""
        return sum(client.seconds for client in self._fixed_clients.values())


@functools.cache
def process_context() -> LoopContext:
    """The context of loops built by verl's own workers (which pass none): one per process, as long-lived
    as the Ray worker process that holds the loops."""
    return LoopContext("process")
