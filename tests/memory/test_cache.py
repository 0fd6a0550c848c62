import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memupdate.memory import cache as cache_module
from memupdate.memory.cache import (
    EmbeddingCache,
    EmbeddingCacheError,
    EmbeddingModelMismatch,
    MissingEmbeddings,
    build_embedding_cache,
)
from memupdate.utils.io import sha256_text

TEXTS = ["Ana keeps bees.", "Ben plays the cello.", "Ana sells honey.", "Ben moved to Lisbon."]


def test_built_cache_layout_and_memory_map(cache_dir, memories_table, embedder):
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    contents = memories_table.column("content").to_pylist()
    assert manifest["model_name"] == embedder.model_name and manifest["dim"] == 384
    assert manifest["count"] == len(set(contents)) and manifest["created_at"] and manifest["updated_at"]
    keys = (cache_dir / "keys.txt").read_text().split()
    assert keys == list(dict.fromkeys(sha256_text(c) for c in contents))
    assert all(len(k) == 64 for k in keys)

    cache = EmbeddingCache.open(cache_dir, embedder)
    assert isinstance(cache.vectors, np.memmap) and not cache.vectors.flags.writeable
    # Stored vectors are what the model gives for the text (row order = keys order).
    np.testing.assert_allclose(cache.get(contents[:3]), embedder.encode(contents[:3]), atol=1e-5)


def test_rebuild_with_unchanged_inputs_embeds_nothing(cache_dir, memories_parquet, counting_embedder):
    before = (cache_dir / "manifest.json").read_text()
    summary = build_embedding_cache(
        memories_parquet, cache_dir, counting_embedder.model_name, embedder=counting_embedder
    )
    assert counting_embedder.calls == 0
    assert summary["new"] == 0 and summary["reused"] == summary["distinct"] == summary["cache_size"]
    assert summary["total"] == pq.read_metadata(memories_parquet).num_rows and summary["seconds"] >= 0
    assert (cache_dir / "manifest.json").read_text() == before, "an unchanged cache is not rewritten"


def test_incremental_build_embeds_only_new_texts(tmp_path, counting_embedder):
    table = pa.table({"content": TEXTS[:3] + TEXTS[:1]})  # one duplicate row
    pq.write_table(table, tmp_path / "m1.parquet")
    first = build_embedding_cache(
        tmp_path / "m1.parquet",
        tmp_path / "cache",
        counting_embedder.model_name,
        batch_size=2,
        embedder=counting_embedder,
        summary_path=tmp_path / "summary.json",
    )
    assert (first["total"], first["distinct"], first["new"], first["reused"]) == (4, 3, 3, 0)
    assert counting_embedder.calls == 2 and counting_embedder.texts == 3  # batches of 2
    assert json.loads((tmp_path / "summary.json").read_text())["new"] == 3

    pq.write_table(pa.table({"content": TEXTS}), tmp_path / "m2.parquet")
    second = build_embedding_cache(
        tmp_path / "m2.parquet", tmp_path / "cache", counting_embedder.model_name, embedder=counting_embedder
    )
    assert (second["new"], second["reused"], second["cache_size"]) == (1, 3, 4)
    assert counting_embedder.texts == 4, "only the one new text was embedded"
    cache = EmbeddingCache.open(tmp_path / "cache", counting_embedder)
    np.testing.assert_allclose(cache.get(TEXTS[3:]), counting_embedder.encode(TEXTS[3:]), atol=1e-5)


def test_pool_survives_snakemake_deleting_the_output(tmp_path, counting_embedder):
    """Snakemake removes a directory() output before rerunning its rule; the pool keeps the vectors."""
    import shutil

    pq.write_table(pa.table({"content": TEXTS[:3]}), tmp_path / "m1.parquet")
    build = dict(model_name=counting_embedder.model_name, embedder=counting_embedder, pool_dir=tmp_path / "pool")
    build_embedding_cache(tmp_path / "m1.parquet", tmp_path / "out", **build)
    assert counting_embedder.texts == 3
    shutil.rmtree(tmp_path / "out")
    pq.write_table(pa.table({"content": TEXTS}), tmp_path / "m2.parquet")
    summary = build_embedding_cache(tmp_path / "m2.parquet", tmp_path / "out", **build)
    assert (summary["new"], summary["reused"], summary["cache_size"]) == (1, 3, 4)
    assert counting_embedder.texts == 4
    assert len(EmbeddingCache.open(tmp_path / "pool", counting_embedder)) == 4


def test_an_interrupted_build_is_continued_without_embedding_again_what_was_saved(
    tmp_path, embedder, make_counting_embedder, caplog
):
    """Issue 15: the pool was saved only at the end, so an interrupted embed_memories lost all its work."""
    import logging
    import shutil

    texts = [f"Fact {i}: Ana's bees made {i} jars of honey." for i in range(10)]
    pq.write_table(pa.table({"content": texts + texts[:2]}), tmp_path / "m.parquet")
    build = dict(model_name=embedder.model_name, batch_size=2, checkpoint_every=4, pool_dir=tmp_path / "pool")

    stopped = make_counting_embedder(fail_at=4)  # batches 1-3 done, saved after 2
    with (
        caplog.at_level(logging.INFO, logger=cache_module.__name__),
        pytest.raises(RuntimeError, match="interrupted"),
    ):
        build_embedding_cache(tmp_path / "m.parquet", tmp_path / "out", embedder=stopped, **build)
    assert stopped.texts == 6 and "embedded 4 of 10 new texts" in caplog.text
    assert len(EmbeddingCache.open(tmp_path / "pool", embedder)) == 4, "the pool holds what was saved"
    shutil.rmtree(tmp_path / "out", ignore_errors=True)  # Snakemake deletes the output of a failed job

    rerun = make_counting_embedder()
    summary = build_embedding_cache(tmp_path / "m.parquet", tmp_path / "out", embedder=rerun, **build)
    assert rerun.texts == 6 and (summary["new"], summary["reused"], summary["cache_size"]) == (6, 4, 10)

    whole = make_counting_embedder()
    build_embedding_cache(tmp_path / "m.parquet", tmp_path / "whole", embedder.model_name, batch_size=2, embedder=whole)
    assert whole.texts == 10
    resumed, uninterrupted = (EmbeddingCache.open(tmp_path / d, embedder) for d in ("out", "whole"))
    assert resumed.keys() == uninterrupted.keys() == [sha256_text(t) for t in texts]
    np.testing.assert_allclose(resumed.vectors, uninterrupted.vectors, atol=1e-6)
    assert EmbeddingCache.open(tmp_path / "pool", embedder).keys() == resumed.keys()


def test_ensure_returns_vectors_in_request_order_and_checkpoints(tmp_path, counting_embedder):
    cache = EmbeddingCache.open(tmp_path / "c", counting_embedder)
    vectors = cache.ensure([TEXTS[1], TEXTS[0], TEXTS[1]], batch_size=1, checkpoint_every=1)
    np.testing.assert_allclose(vectors[0], vectors[2])
    # checkpoint_every saved the partial cache, so an interrupted build would resume from it.
    assert len(EmbeddingCache.open(tmp_path / "c", counting_embedder)) == 2
    assert TEXTS[0] in cache and TEXTS[2] not in cache
    with pytest.raises(MissingEmbeddings) as err:
        cache.get([TEXTS[2]])
    assert err.value.missing == [TEXTS[2]]


def test_cache_of_another_model_is_refused(cache_dir, embedder):
    with pytest.raises(EmbeddingModelMismatch) as err:
        EmbeddingCache.open(cache_dir, model_name="Qwen/Qwen3-Embedding-0.6B")
    message = str(err.value)
    assert "all-MiniLM-L6-v2" in message and "Qwen/Qwen3-Embedding-0.6B" in message and str(cache_dir) in message


def test_cache_with_another_dim_is_refused(tmp_path, embedder):
    EmbeddingCache(tmp_path / "c", model_name=embedder.model_name, dim=8).save()
    with pytest.raises(EmbeddingModelMismatch, match="dim 8"):
        EmbeddingCache.open(tmp_path / "c", embedder)


def test_missing_cache_is_a_clear_error(tmp_path):
    with pytest.raises(EmbeddingCacheError, match="embed_memories"):
        EmbeddingCache.open(tmp_path / "nowhere")


def _zero_first_row(folder):
    vectors = np.load(folder / "vectors.npy")
    vectors[0] = 0
    np.save(folder / "vectors.npy", vectors)


def _nan_in_first_row(folder):
    vectors = np.load(folder / "vectors.npy")
    vectors[0, 0] = np.nan
    np.save(folder / "vectors.npy", vectors)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "vectors.npy").write_bytes((d / "vectors.npy").read_bytes()[:1000]), "is damaged"),
        (lambda d: (d / "manifest.json").write_text('{"model_name": "sentence-tr'), "manifest.json: not a manifest"),
        (_zero_first_row, r"vectors are not unit length \(row 0: squared norm 0\)"),
        # One NaN, and the memory was never retrieved again (issue 58).
        (_nan_in_first_row, r"vectors are not unit length \(row 0: squared norm nan\)"),
    ],
)
def test_a_damaged_cache_is_refused_with_what_to_do(cache_dir, embedder, tmp_path, damage, message):
    """A truncated vectors file or a torn manifest crashed with numpy's or json's error; zeroed vectors passed
    (issue 37), and so did a NaN (issue 58)."""
    copy = tmp_path / "cache"
    shutil.copytree(cache_dir, copy)
    damage(copy)
    with pytest.raises(EmbeddingCacheError, match=message):
        EmbeddingCache.open(copy, embedder)


def test_failed_save_leaves_the_previous_cache_and_no_partial_directory(tmp_path, counting_embedder, monkeypatch):
    target = tmp_path / "cache"
    cache = EmbeddingCache.open(target, counting_embedder)
    cache.ensure(TEXTS[:2])
    cache.save()
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    cache.ensure(TEXTS[2:])

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(cache_module, "write_json_atomic", fail)
    with pytest.raises(OSError, match="disk full"):
        cache.save()
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["cache"], "no temporary directory is left behind"

    with pytest.raises(OSError):
        cache.save(tmp_path / "fresh")
    assert [p.name for p in tmp_path.iterdir()] == ["cache"], "a new cache is not created half-written"

    monkeypatch.undo()
    cache.save()
    assert len(EmbeddingCache.open(target, counting_embedder)) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (pa.table({"text": ["a"]}), r"is not a memories table: no column 'content' \(columns: text: string\)"),
        (pa.table({"content": [1]}), "column 'content' is int64, not string"),
    ],
)
def test_a_parquet_of_another_schema_is_named_not_a_memories_table(tmp_path, embedder, table, message):
    """An AttributeError or a list of Arrow's internal columns before (issue 37)."""
    pq.write_table(table, tmp_path / "m.parquet")
    with pytest.raises(ValueError, match=message):
        build_embedding_cache(tmp_path / "m.parquet", tmp_path / "cache", embedder.model_name, embedder=embedder)
