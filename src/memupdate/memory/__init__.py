"""Memory environment: embedder, vector index, store, trial overlays.

Four separate pieces (``style-anchors.md`` §3): :class:`Embedder` (text → unit vectors),
:class:`EmbeddingCache` (sha256(text) → vector artifact), :class:`VectorIndex` (int id ↔ vector) and the
stores (:class:`BaseStore`, read-only initial memories; :class:`TrialStore`, one trajectory's overlay),
registered per trial by :class:`MemoryStoreManager`. None of them knows about LLMs or verl.
"""

from memupdate.memory.cache import (
    EmbeddingCache,
    EmbeddingCacheError,
    EmbeddingModelMismatch,
    MissingEmbeddings,
    build_embedding_cache,
)
from memupdate.memory.embedder import DEFAULT_MODEL, Embedder, EmbedderLoadError
from memupdate.memory.index import VectorIndex
from memupdate.memory.manager import MemoryStoreManager, NamespaceInUse, UnknownNamespace, trial_namespace
from memupdate.memory.store import (
    BaseStore,
    Hit,
    InvalidMemoryOperation,
    MemoryRecord,
    MemoryStoreError,
    TrialStore,
    UnknownMemoryId,
)

__all__ = [
    "DEFAULT_MODEL",
    "BaseStore",
    "Embedder",
    "EmbedderLoadError",
    "EmbeddingCache",
    "EmbeddingCacheError",
    "EmbeddingModelMismatch",
    "Hit",
    "InvalidMemoryOperation",
    "MemoryRecord",
    "MemoryStoreError",
    "MemoryStoreManager",
    "MissingEmbeddings",
    "NamespaceInUse",
    "TrialStore",
    "UnknownMemoryId",
    "UnknownNamespace",
    "VectorIndex",
    "build_embedding_cache",
    "trial_namespace",
]
