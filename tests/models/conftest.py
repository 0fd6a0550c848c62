"""Prepared checkpoints shared by the model tests, each built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from memupdate.models.prepare import prepare_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny"
    prepare_model({"kind": "tiny_random", "seed": 0}, out)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
