import asyncio

import numpy as np
import pytest

from memupdate.memory.embedder import DEFAULT_MODEL, Embedder, EmbedderLoadError, resolve_model_path


def test_encode_gives_unit_float32_rows(embedder):
    vectors = embedder.encode(["Caroline prefers tea.", "Melanie paints sunsets.", "Caroline likes green tea."])
    assert embedder.model_name == DEFAULT_MODEL and embedder.dim == 384
    assert vectors.dtype == np.float32 and vectors.shape == (3, 384) and vectors.flags.c_contiguous
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    sims = vectors @ vectors.T
    assert sims[0, 2] > sims[0, 1], "the packaged model is a real sentence encoder"
    assert embedder.encode([]).shape == (0, 384)
    with pytest.raises(TypeError, match="sequence of texts"):
        embedder.encode("one text")


def test_a_text_longer_than_the_model_input_is_reported_once_and_counted(embedder, caplog):
    before = embedder.truncated
    long = "Caroline told Melanie about the adoption agency and the counselling course. " * 40
    with caplog.at_level("WARNING", logger="memupdate.memory.embedder"):
        embedder.encode(["short memory", "x" * 200])
        assert embedder.truncated == before and not caplog.records
        embedder.encode(["short memory", long, long, long + " Again."])
    # Each text is embedded once (the repeat comes from the model's recent vectors).
    assert embedder.truncated == before + 2
    if before == 0:
        (record,) = [r for r in caplog.records if r.name == "memupdate.memory.embedder"]
        assert "at most 256 word pieces" in record.getMessage() and "2 text(s)" in record.getMessage()
    # What the model embeds of a cut text is its beginning: the same vector as the text cut short.
    tokenizer = embedder._loaded.model.tokenizer
    head = tokenizer.decode(tokenizer(long, verbose=False)["input_ids"][1:255])
    np.testing.assert_allclose(embedder.encode([long]), embedder.encode([head]), atol=1e-4)


def test_a_text_is_embedded_once_however_often_it_is_asked_for(embedder, monkeypatch):
    from memupdate.memory import embedder as module

    model = embedder._loaded.model
    embedded: list[str] = []
    encode = model.encode

    def counting(texts, **kwargs):
        embedded.extend(texts)
        return encode(texts, **kwargs)

    monkeypatch.setattr(model, "encode", counting)
    question = "When did Caroline go to the LGBTQ support group? (a question searched by every rollout)"
    first = embedder.encode([question, question, "a memory written once"])
    again = embedder.encode(["a memory written once", question])
    assert embedded == [question, "a memory written once"]
    np.testing.assert_array_equal(first[0], first[1])
    np.testing.assert_array_equal(again, first[[2, 0]])
    # Bounded: the least recently used vectors go first.
    monkeypatch.setattr(module, "RECENT_TEXTS", 2)
    embedder.encode(["third text"])
    assert list(embedder._loaded.recent) == [question, "third text"]
    # Forgotten, a text is embedded again.
    embedder.forget_recent()
    embedder.encode([question])
    assert embedded == [question, "a memory written once", "third text", question]


def test_model_is_loaded_once_per_process_and_aliases_agree(embedder):
    other = Embedder("sentence-transformers/all-MiniLM-L6-v2", batch_size=8)
    assert other.model_name == embedder.model_name
    assert other._loaded is embedder._loaded
    assert resolve_model_path(DEFAULT_MODEL).endswith("model")


def test_missing_model_fails_offline_with_a_clear_error(tmp_path):
    with pytest.raises(EmbedderLoadError, match="offline"):
        Embedder(str(tmp_path / "no-such-model"))


@pytest.mark.asyncio
async def test_aencode_matches_encode_and_leaves_the_event_loop_free(embedder):
    texts = [f"memory number {i} about a hiking trip" for i in range(64)]
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    task = asyncio.create_task(ticker())
    vectors = await embedder.aencode(texts, batch_size=16)
    task.cancel()
    assert ticks > 0, "the loop ran other coroutines while the model encoded"
    np.testing.assert_allclose(vectors, embedder.encode(texts), atol=1e-5)


@pytest.mark.asyncio
async def test_concurrent_aencode_requests_are_coalesced(counting_embedder):
    texts = [f"Caroline went to event number {i}." for i in range(16)]
    results = await asyncio.gather(*(counting_embedder.aencode([t]) for t in texts))
    # All requests queue before the drainer task first runs; at worst the first goes alone.
    assert counting_embedder.calls <= 2 and counting_embedder.texts == 16
    np.testing.assert_allclose(np.concatenate(results), counting_embedder.encode(texts), atol=1e-5)


@pytest.mark.asyncio
async def test_aencode_errors_and_cancellations_reach_only_their_waiters(embedder):
    class Flaky(Embedder):
        fail = True

        def encode(self, texts, batch_size=None):
            if self.fail:
                raise RuntimeError("model crashed")
            return super().encode(texts, batch_size)

    flaky = Flaky(embedder.model_name)
    outcomes = await asyncio.gather(flaky.aencode(["a"]), flaky.aencode(["b"]), return_exceptions=True)
    assert [str(o) for o in outcomes] == ["model crashed", "model crashed"]

    flaky.fail = False
    first = asyncio.ensure_future(flaky.aencode(["kept"]))
    doomed = asyncio.ensure_future(flaky.aencode(["cancelled"]))
    later = asyncio.ensure_future(flaky.aencode(["also kept"]))
    await asyncio.sleep(0)
    doomed.cancel()
    kept, also_kept = await asyncio.gather(first, later)
    assert kept.shape == also_kept.shape == (1, 384) and doomed.cancelled()
    with pytest.raises(TypeError):
        await flaky.aencode("not a list")
