import subprocess
import sys

import numpy as np
import pytest

from memupdate.memory.index import VectorIndex, normalize_rows


def unit(rng, n, dim=32):
    return normalize_rows(rng.standard_normal((n, dim)).astype(np.float32))


def brute_force_top_k(corpus, ids, queries, k):
    scores = normalize_rows(queries) @ corpus.T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return ids[order], np.take_along_axis(scores, order, axis=1)


def test_top_k_equals_brute_force_on_200_vectors():
    rng = np.random.default_rng(0)
    corpus = unit(rng, 200)
    # Sparse, shuffled ids: the index must return caller ids, not row numbers.
    ids = rng.permutation(np.arange(1000, 3000, 10))
    index = VectorIndex.from_vectors(ids, corpus)
    queries = rng.standard_normal((25, 32)).astype(np.float32)  # not normalised: the index does it

    got_ids, got_scores = index.search(queries, k=10)
    want_ids, want_scores = brute_force_top_k(corpus, ids, queries, 10)

    assert got_ids.dtype == np.int64 and got_ids.shape == (25, 10)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_scores, want_scores, atol=1e-5)
    assert np.all(np.diff(got_scores, axis=1) <= 1e-6), "scores are best first (higher = more similar)"


def test_ids_stay_stable_after_remove_and_update():
    rng = np.random.default_rng(1)
    corpus = unit(rng, 50)
    index = VectorIndex.from_vectors(range(50), corpus)

    assert index.remove([0, 7, 7, 999]) == 2  # duplicates and absent ids are ignored
    assert len(index) == 48 and 7 not in index
    # Every remaining vector still answers to its own id (a plain IndexFlat would have shifted them).
    ids, scores = index.search(corpus[8:20], k=1)
    assert ids[:, 0].tolist() == list(range(8, 20))
    np.testing.assert_allclose(scores[:, 0], 1.0, atol=1e-5)

    new = unit(rng, 1)
    index.update([30], new)
    assert len(index) == 48
    assert index.search(new, k=1)[0].tolist() == [[30]]
    np.testing.assert_allclose(index.vector(30), new[0], atol=1e-6)


def test_k_larger_than_index_and_empty_index():
    index = VectorIndex(4)
    ids, scores = index.search(np.ones(4), k=3)
    assert ids.shape == (1, 0) and scores.shape == (1, 0)
    index.add([5, 6], np.eye(4, dtype=np.float32)[:2])
    ids, _ = index.search(np.eye(4)[0], k=10)
    assert ids.tolist() == [[5, 6]]


def test_misuse_is_refused():
    index = VectorIndex.from_vectors([1, 2], np.eye(3, dtype=np.float32)[:2])
    with pytest.raises(ValueError, match="already in the index"):
        index.add([2], np.ones((1, 3)))
    with pytest.raises(ValueError, match="distinct"):
        index.add([3, 3], np.ones((2, 3)))
    with pytest.raises(KeyError):
        index.update([9], np.ones((1, 3)))
    with pytest.raises(ValueError, match="shape"):
        index.add([3], np.ones((1, 4)))
    with pytest.raises(ValueError, match="dim"):
        index.search(np.ones(4), k=1)


def test_normalize_rows_keeps_zero_rows():
    x = normalize_rows(np.array([[3.0, 4.0], [0.0, 0.0]]))
    assert x.dtype == np.float32 and x.flags.c_contiguous
    np.testing.assert_allclose(x, [[0.6, 0.8], [0.0, 0.0]])


def test_searching_leaves_torch_its_threads():
    """faiss and torch share one OpenMP runtime: a thread count set for faiss once, at import, left every
    training process on one core. In a fresh process, since this one has imported the module already."""
    code = """
import numpy as np, torch
before = torch.get_num_threads()
from memupdate.memory.index import VectorIndex
index = VectorIndex(2)
index.add([1, 2], np.array([[1, 0], [0, 1]], dtype=np.float32))
index.update([2], np.array([[0.5, 0.5]], dtype=np.float32))
index.search(np.array([[1, 0]], dtype=np.float32), k=1)
index.remove([1])
print(before, torch.get_num_threads())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == out[1], out
