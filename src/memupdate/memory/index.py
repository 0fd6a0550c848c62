"""Exact cosine-similarity index from int64 ids to vectors, with ids that stay put when others go.

>>> import numpy as np
>>> index = VectorIndex.from_vectors([10, 11], np.array([[1, 0], [0, 1]], dtype=np.float32))
>>> ids, scores = index.search(np.array([[1, 0.2]], dtype=np.float32), k=2)
>>> ids.tolist(), [round(s, 3) for s in scores[0].tolist()]
([[10, 11]], [0.981, 0.196])
>>> index.remove([10]); index.search(np.array([[1, 0]], dtype=np.float32), k=2)[0].tolist()
1
[[11]]

A sequential faiss ``IndexFlat`` renumbers later vectors when one is removed (faiss wiki, "Special
operations on indexes"); ``IndexIDMap2`` keeps caller ids, and unlike ``IndexIDMap`` can also give
vectors back. Inner product on L2-normalised vectors is cosine similarity, so scores are "higher =
more similar", in [-1, 1]. The index holds no text.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import faiss
import numpy as np


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run faiss on the calling thread only. A conversation's index holds a few hundred vectors: an exact
    search is microseconds on one thread, while faiss's OpenMP fan-out competes with torch and vLLM for the
    cores (measured under a loaded 2-core machine: search p50 7.5 ms with faiss's threads, 0.13 ms with one).
    Not set once at import: faiss and torch share one OpenMP runtime, whose thread count is per calling
    thread, so that would leave torch's training on that thread one core (measured: SFT at 100% CPU of 200%)."""
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(threads)


def normalize_rows(vectors: np.ndarray) -> np.ndarray:
    """A float32, C-contiguous copy of ``vectors`` (``[n, d]`` or ``[d]`` → ``[1, d]``) with unit rows.

    All-zero rows stay zero instead of turning into NaN.
    """
    x = np.array(vectors, dtype=np.float32, ndmin=2, order="C", copy=True)
    if x.ndim != 2:
        raise ValueError(f"expected vectors of shape [n, d] or [d], got shape {np.shape(vectors)}")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    np.divide(x, norms, out=x, where=norms > 0)
    return x


class VectorIndex:
    """faiss ``IndexIDMap2(IndexFlatIP)`` over normalised vectors; ``update`` = remove + add, same id."""

    def __init__(self, dim: int):
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        self.dim = dim
        self._index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        # faiss does not refuse duplicate ids (search would then return one id twice), so track them here.
        self._ids: set[int] = set()

    @classmethod
    def from_vectors(cls, ids: Iterable[int], vectors: np.ndarray) -> VectorIndex:
        vectors = np.asarray(vectors)
        if vectors.ndim != 2:
            raise ValueError(f"expected vectors of shape [n, d], got shape {vectors.shape}")
        index = cls(vectors.shape[1])
        index.add(ids, vectors)
        return index

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, id_: object) -> bool:
        return id_ in self._ids

    def ids(self) -> np.ndarray:
        return np.array(sorted(self._ids), dtype=np.int64)

    def _check(self, ids: Iterable[int], vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        id_array = np.fromiter((int(i) for i in ids), dtype=np.int64)
        x = normalize_rows(vectors)
        if x.shape != (len(id_array), self.dim):
            raise ValueError(
                f"{len(id_array)} ids need vectors of shape ({len(id_array)}, {self.dim}), got {np.shape(vectors)}"
            )
        if len(set(id_array.tolist())) != len(id_array):
            raise ValueError("ids must be distinct")
        return id_array, x

    def add(self, ids: Iterable[int], vectors: np.ndarray) -> None:
        """Add new ids; raises ``ValueError`` if any is already present (use :meth:`update`)."""
        id_array, x = self._check(ids, vectors)
        present = sorted(self._ids.intersection(id_array.tolist()))
        if present:
            raise ValueError(f"ids already in the index: {present[:10]}; use update() to replace their vectors")
        if len(id_array):
            with _one_thread():
                self._index.add_with_ids(x, id_array)
            self._ids.update(id_array.tolist())

    def remove(self, ids: Iterable[int]) -> int:
        """Remove ids (absent ones are ignored); returns how many were removed. Other ids are unchanged."""
        present = np.array(sorted(self._ids.intersection(int(i) for i in ids)), dtype=np.int64)
        if len(present) == 0:
            return 0
        with _one_thread():
            removed = int(self._index.remove_ids(present))
        self._ids.difference_update(present.tolist())
        return removed

    def update(self, ids: Iterable[int], vectors: np.ndarray) -> None:
        """Replace the vectors of existing ids, keeping the ids."""
        id_array, x = self._check(ids, vectors)
        missing = sorted(set(id_array.tolist()) - self._ids)
        if missing:
            raise KeyError(f"ids not in the index: {missing[:10]}")
        self.remove(id_array)
        with _one_thread():
            self._index.add_with_ids(x, id_array)
        self._ids.update(id_array.tolist())

    def vector(self, id_: int) -> np.ndarray:
        """The stored (normalised) vector of one id."""
        if id_ not in self._ids:
            raise KeyError(f"id {id_} not in the index")
        return self._index.reconstruct(int(id_))

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` ids and cosine scores per query, best first: two arrays ``[n_queries, min(k, len)]``.

        Queries are normalised here, so raw model outputs are fine.
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        q = normalize_rows(queries)
        if q.shape[1] != self.dim:
            raise ValueError(f"queries have dim {q.shape[1]}, the index has dim {self.dim}")
        k = min(k, len(self))
        if k == 0:
            return np.empty((len(q), 0), dtype=np.int64), np.empty((len(q), 0), dtype=np.float32)
        with _one_thread():
            scores, ids = self._index.search(q, k)
        return ids, scores
