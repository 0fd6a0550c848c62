"""Registry of the open trial stores of one worker, keyed by trial namespace.

>>> trial_namespace("conv-26-qa0-ff702917", "1010e8efa1b2c3d4e5f6")
'conv-26-qa0-ff702917-1010e8efa1b2c3d4e5f6'

Example (an agent loop owns the trial from its first tool call to its reward)::

    manager = MemoryStoreManager("results/data/locomo/memories.parquet",
                                 "results/embeddings/all-MiniLM-L6-v2/memories", Embedder())
    trial = await manager.aopen(base_namespace, request_id, sample_id)
    hits = await trial.asearch("When did Caroline go to the support group?")
    ...
    delta = trial.export_delta()          # travels with the trajectory to the reward
    stats = manager.release(trial.namespace)

The caller creates the manager (one per worker process); nothing here is a global. All bookkeeping is
synchronous and the only awaits are embedding and first-time base loading in worker threads, so any
number of coroutines of one event loop can use the manager without locks of their own.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa

from memupdate.memory.cache import EmbeddingCache
from memupdate.memory.embedder import Embedder
from memupdate.memory.environment import MemoryEnvironment
from memupdate.memory.store import BaseStore, TrialStore
from memupdate.utils.io import read_parquet_columns

logger = logging.getLogger(__name__)

MEMORY_COLUMNS = ["sample_id", "memory_id", "content", "speaker", "session", "date", "evidence", "source"]


class UnknownNamespace(LookupError):
    """No trial store is open under this namespace (never opened, or already released)."""

    def __init__(self, namespace: str):
        self.namespace = namespace
        super().__init__(f"no open memory store for namespace {namespace!r}")

    def __str__(self) -> str:
        return str(self.args[0])


class NamespaceInUse(RuntimeError):
    """A trial store is already open under this namespace for another trajectory, or for this one when
    reopening was not asked for (a reused request id or a missing release)."""


def trial_namespace(base_namespace: str, request_id: str) -> str:
    """``f"{base_namespace}-{request_id}"``: the row's namespace plus the whole request id.

    The whole id, because a prefix is not unique: two of verl's uuid4 ids share their first 8 hex
    digits with probability 1 in 2**32 per pair, which a large batch over many steps does reach.
    """
    if not base_namespace or not request_id:
        raise ValueError(f"need a base namespace and a request id, got {base_namespace!r}, {request_id!r}")
    return f"{base_namespace}-{request_id}"


class MemoryStoreManager:
    """Opens, finds and releases :class:`TrialStore` overlays; loads each conversation's :class:`BaseStore`
    lazily, once, from the memories table and the embedding cache.

    ``memories`` is the memories parquet (or a table with its columns); ``cache`` the embedding cache
    directory (or an open cache). The ``embedder`` must be the cache's model: it embeds the trials' new
    texts and queries.
    """

    def __init__(
        self,
        memories: str | os.PathLike | pa.Table,
        cache: str | os.PathLike | EmbeddingCache,
        embedder: Embedder | None = None,
    ):
        self._memories_source = memories
        self._cache_source = cache
        self.embedder = embedder
        self._table: pa.Table | None = None
        self._cache: EmbeddingCache | None = None
        self._bases: dict[str, BaseStore] = {}
        self._trials: dict[str, TrialStore] = {}
        # Who opened each trial: (base namespace, request id, sample id, sessions). The namespace alone
        # does not say, as "a-b" + "c" and "a" + "b-c" join to the same string.
        self._owners: dict[str, tuple[str, str, str, int | None]] = {}
        # Stores the trials of a base namespace start from instead of the base, and the trial last opened
        # from each (see start_from).
        self._starts: dict[str, TrialStore] = {}
        self._started: dict[str, TrialStore] = {}
        # Guards lazy loading only, which may run in worker threads (aopen); never held across an await.
        self._load_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._trials)

    def __contains__(self, namespace: object) -> bool:
        return namespace in self._trials

    def namespaces(self) -> list[str]:
        return sorted(self._trials)

    # ------------------------------------------------------------------ base stores

    def _load_table(self) -> pa.Table:
        if self._table is None:
            source = self._memories_source
            self._table = (
                source
                if isinstance(source, pa.Table)
                else read_parquet_columns(source, dict.fromkeys(MEMORY_COLUMNS), "a memories table")
            )
            logger.info("memories table: %d rows", self._table.num_rows)
        return self._table

    def _load_cache(self) -> EmbeddingCache:
        if self._cache is None:
            source = self._cache_source
            if isinstance(source, EmbeddingCache):
                if self.embedder is not None and source.model_name != self.embedder.model_name:
                    raise ValueError(
                        f"embedding cache {source.path} is for {source.model_name!r}, "
                        f"the embedder is {self.embedder.model_name!r}"
                    )
                self._cache = source
            else:
                self._cache = EmbeddingCache.open(Path(source), self.embedder, must_exist=True)
        return self._cache

    def base(self, sample_id: str) -> BaseStore:
        """The base store of one conversation, loaded on first use (blocking; see :meth:`aopen`)."""
        base = self._bases.get(sample_id)
        if base is not None:
            return base
        with self._load_lock:
            if sample_id not in self._bases:
                self._bases[sample_id] = BaseStore.from_table(self._load_table(), sample_id, self._load_cache())
                logger.info("loaded base memories of %s: %d records", sample_id, len(self._bases[sample_id]))
            return self._bases[sample_id]

    # ------------------------------------------------------------------ trials

    def start_from(self, base_namespace: str, store: TrialStore | None) -> None:
        """Trials opened under ``base_namespace`` from now on start as a :meth:`TrialStore.fork` of
        ``store`` (``None``: from the base again). Question-agnostic evaluation uses it to continue each
        session's episode from the store the conversation's earlier sessions built."""
        self._started.pop(base_namespace, None)
        if store is None:
            self._starts.pop(base_namespace, None)
        else:
            self._starts[base_namespace] = store

    def started(self, base_namespace: str) -> TrialStore | None:
        """The trial last opened from ``base_namespace``'s registered start store (it stays readable after its
        release), or None if none was: the store an episode built, for the next session to start from."""
        return self._started.get(base_namespace)

    def open(
        self,
        base_namespace: str,
        request_id: str,
        sample_id: str,
        *,
        sessions: int | None = None,
        exist_ok: bool = False,
    ) -> TrialStore:
        """A new overlay on ``sample_id``'s base store under ``trial_namespace(base_namespace, request_id)``:
        empty, seeing the conversation up to session ``sessions`` (``None``: all of it), or a fork of the
        store registered with :meth:`start_from`.

        With ``exist_ok``, the trial this same trajectory (base namespace, request id, sample and sessions)
        already opened is returned; a live trial under that namespace that belongs to any other
        trajectory is never handed out.
        """
        namespace = trial_namespace(base_namespace, request_id)
        existing = self._trials.get(namespace)
        if existing is not None:
            owner, asked = self._owners[namespace], (base_namespace, request_id, sample_id, sessions)
            if owner == asked:
                if exist_ok:
                    return existing
                raise NamespaceInUse(
                    f"a memory store is already open for namespace {namespace!r} (sample {sample_id!r}); "
                    "release it first, or pass exist_ok=True to reopen it"
                )
            raise NamespaceInUse(
                f"the memory store open under namespace {namespace!r} belongs to another trajectory "
                f"(base namespace, request id, sample, sessions = {owner}, not {asked}): trajectories never "
                "share a store"
            )
        start = self._starts.get(base_namespace)
        if start is None:
            trial = TrialStore(self.base(sample_id), self.embedder, namespace=namespace, sessions=sessions)
        elif start.base.sample_id != sample_id:
            raise ValueError(
                f"the start store of {base_namespace!r} is of sample {start.base.sample_id!r}, not {sample_id!r}"
            )
        else:
            trial = self._started[base_namespace] = start.fork(namespace=namespace, sessions=sessions)
        self._trials[namespace] = trial
        self._owners[namespace] = (base_namespace, request_id, sample_id, sessions)
        return trial

    async def aopen(
        self,
        base_namespace: str,
        request_id: str,
        sample_id: str,
        *,
        sessions: int | None = None,
        exist_ok: bool = False,
    ) -> TrialStore:
        """:meth:`open`, loading the base store in a thread the first time so the event loop keeps running.

        Parallel tool calls of one trajectory may each call ``aopen(..., exist_ok=True)``: the namespace
        is checked after the await, so they all get the same store.
        """
        if sample_id not in self._bases:
            await asyncio.to_thread(self.base, sample_id)
        return self.open(base_namespace, request_id, sample_id, sessions=sessions, exist_ok=exist_ok)

    def get(self, namespace: str) -> TrialStore:
        try:
            return self._trials[namespace]
        except KeyError:
            raise UnknownNamespace(namespace) from None

    def release(self, namespace: str) -> dict[str, Any]:
        """Close a trial and return its growth statistics (export its delta first if it is needed)."""
        trial = self._trials.pop(namespace, None)
        if trial is None:
            raise UnknownNamespace(namespace)
        del self._owners[namespace]
        stats = {"namespace": namespace, "sample_id": trial.base.sample_id, **trial.stats()}
        logger.debug("released %s: %s", namespace, stats)
        return stats


@functools.lru_cache(maxsize=8)
def shared_manager(memories: str, embeddings: str, embedding_model: str) -> MemoryStoreManager:
    """One manager per worker process and data set, shared by the tools, the agent loop and the rewards.

    Keyed by the paths, so two configurations in one process never share stores by accident.
    """
    return MemoryStoreManager(memories, embeddings, Embedder(embedding_model))


def manager_for(environment: MemoryEnvironment) -> MemoryStoreManager:
    """The process's manager for a run's memory environment, shared by its tools, agent loops and rewards."""
    return shared_manager(environment.memories, environment.embeddings, environment.embedding_model)
