"""Fixtures of the memory-layer tests (the shared data and model fixtures are in tests/conftest.py)."""

from __future__ import annotations

import pytest

from memupdate.memory import Embedder


class CountingEmbedder(Embedder):
    """The real embedder, counting encode calls and texts (to prove what was not re-embedded)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0
        self.texts = 0

    def encode(self, texts, batch_size=None):
        self.calls += 1
        self.texts += len(texts)
        return super().encode(texts, batch_size)


@pytest.fixture
def counting_embedder(embedder) -> CountingEmbedder:
    # The model is cached per process, so this costs nothing after the session fixture loaded it.
    return CountingEmbedder(embedder.model_name)
