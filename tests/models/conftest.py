"""Prepared checkpoints shared by the model tests, each built once per session."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from memupdate.models.prepare import prepare_model

logger = logging.getLogger(__name__)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny"
    prepare_model({"kind": "tiny_random", "seed": 0}, out)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted from the packaged GGUF (about 30-40 s on 2 CPU cores)."""
    out = tmp_path_factory.mktemp("models") / "smollm2"
    started = time.perf_counter()
    prepare_model({"kind": "smollm2_gguf", "dtype": "bfloat16"}, out)
    logger.info("SmolLM2 conversion took %.1f s", time.perf_counter() - started)
    return out
