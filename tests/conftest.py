"""Shared fixtures: where the repository and the shared data files are."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# CI and dev machines keep the public data files in ../shared/data beside the clone.
SHARED_DATA = Path(os.environ.get("MEMUPDATE_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


def shared_file(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.skip(f"{path} not found: set MEMUPDATE_SHARED_DATA to the folder holding {name}")
    return path


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def locomo_path() -> Path:
    return shared_file("locomo10.json")


@pytest.fixture(scope="session")
def hotpotqa_path() -> Path:
    return shared_file("hotpotqa_dev_distractor_first100.json")


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    return SHARED_DATA
