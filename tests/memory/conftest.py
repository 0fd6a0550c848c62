"""Fixtures of the memory-layer tests (the shared data and model fixtures are in tests/conftest.py)."""

from __future__ import annotations

import pytest

from memupdate.memory.embedder import Embedder


class CountingEmbedder(Embedder):
    """The real embedder, counting encode calls and texts (to prove what was not re-embedded).

    With ``fail_at``, the run stops at that encode call, as one cut short by a Slurm time limit,
    a Ctrl-C or a lost node would.
    """

    def __init__(self, *args, fail_at: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0
        self.texts = 0
        self.fail_at = fail_at

    def encode(self, texts, batch_size=None):
        if self.calls + 1 == self.fail_at:
            raise RuntimeError(f"run interrupted at encode call {self.fail_at}")
        self.calls += 1
        self.texts += len(texts)
        return super().encode(texts, batch_size)


@pytest.fixture
def counting_embedder(embedder) -> CountingEmbedder:
    # The model is cached per process, so this costs nothing after the session fixture loaded it.
    return CountingEmbedder(embedder.model_name)


@pytest.fixture
def make_counting_embedder(embedder):
    """``make_counting_embedder(fail_at=4)``: a fresh :class:`CountingEmbedder` of the session's model."""
    return lambda **kwargs: CountingEmbedder(embedder.model_name, **kwargs)
