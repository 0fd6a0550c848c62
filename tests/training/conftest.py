"""Shared pieces of the training tests: a toy reward a tiny random model can learn."""

from pathlib import Path

import pytest

#: The toy reward's file: verl's reward workers load it by path.
TOKEN_SHARE = Path(__file__).with_name("token_share.py")


@pytest.fixture(scope="session")
def token_share_reward() -> dict[str, str]:
    """verl's settings that make the toy reward its reward manager, loaded by path in every reward worker."""
    return {
        "reward.reward_manager.source": "importlib",
        "reward.reward_manager.module.path": str(TOKEN_SHARE),
        "reward.reward_manager.name": "TokenShareReward",
    }
