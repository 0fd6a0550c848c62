"""Memory environment: embedder, vector index, store, trial overlays.

Four separate pieces (``style-anchors.md`` §3): :class:`Embedder` (text → unit vectors),
:class:`EmbeddingCache` (sha256(text) → vector artifact), :class:`VectorIndex` (int id ↔ vector) and the
stores (:class:`BaseStore`, read-only initial memories; :class:`TrialStore`, one trajectory's overlay),
registered per trial by :class:`MemoryStoreManager`. None of them knows about LLMs or verl.
"""

import importlib
from typing import TYPE_CHECKING, Any

#: Where each name lives. Imported on first use: the store, the cache and the embedder bring numpy, pyarrow
#: and faiss (a second at start-up), which the CLI and the Snakefile need only for the defaults in
#: :mod:`memupdate.memory.environment`.
_EXPORTS = {
    "EmbeddingCache": "cache",
    "EmbeddingCacheError": "cache",
    "EmbeddingModelMismatch": "cache",
    "MissingEmbeddings": "cache",
    "build_embedding_cache": "cache",
    "Embedder": "embedder",
    "EmbedderLoadError": "embedder",
    "MemoryEnvironment": "environment",
    "VectorIndex": "index",
    "MemoryStoreManager": "manager",
    "NamespaceInUse": "manager",
    "UnknownNamespace": "manager",
    "trial_namespace": "manager",
    "BaseStore": "store",
    "Hit": "store",
    "InvalidMemoryOperation": "store",
    "MemoryRecord": "store",
    "MemoryStoreError": "store",
    "TrialStore": "store",
    "UnknownMemoryId": "store",
}
__all__ = [
    "BaseStore",
    "Embedder",
    "EmbedderLoadError",
    "EmbeddingCache",
    "EmbeddingCacheError",
    "EmbeddingModelMismatch",
    "Hit",
    "InvalidMemoryOperation",
    "MemoryEnvironment",
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

if TYPE_CHECKING:
    from memupdate.memory.cache import (
        EmbeddingCache,
        EmbeddingCacheError,
        EmbeddingModelMismatch,
        MissingEmbeddings,
        build_embedding_cache,
    )
    from memupdate.memory.embedder import Embedder, EmbedderLoadError
    from memupdate.memory.environment import MemoryEnvironment
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


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
