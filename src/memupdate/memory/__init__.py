"""Memory environment: embedder, vector index, store, trial overlays.

Four separate pieces (``style-anchors.md`` §3): :class:`Embedder` (text → unit vectors),
:class:`EmbeddingCache` (sha256(text) → vector artifact), :class:`VectorIndex` (int id ↔ vector) and the
stores (:class:`BaseStore`, read-only initial memories; :class:`TrialStore`, one trajectory's overlay),
registered per trial by :class:`MemoryStoreManager`. None of them knows about LLMs or verl. Each is imported from
its own module (``memupdate.memory.store``, ...): the store, the cache and the embedder bring numpy, pyarrow and
faiss, which the CLI and the Snakefile need only for :mod:`memupdate.memory.environment`.
"""
