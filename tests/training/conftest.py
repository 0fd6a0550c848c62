"""Shared pieces of the training tests: a toy reward a tiny random model can learn, and run configs."""

from pathlib import Path

import pytest
from verl.experimental.reward_loop.reward_manager import register
from verl.utils.import_utils import load_extern_object

from memupdate.memory.environment import MemoryEnvironment
from memupdate.tools.config import TOOL_CONFIG
from memupdate.training.local import LocalGRPOConfig

#: The toy reward's file (verl's reward workers load it by path, the local backend by its registered name).
TOKEN_SHARE = Path(__file__).with_name("token_share.py")
TokenShareReward = register("test_token_share")(load_extern_object(str(TOKEN_SHARE), "TokenShareReward"))


@pytest.fixture(scope="session")
def token_share_reward() -> dict[str, str]:
    """verl's settings that make the toy reward its reward manager, loaded by path in every reward worker."""
    return {
        "reward.reward_manager.source": "importlib",
        "reward.reward_manager.module.path": str(TOKEN_SHARE),
        "reward.reward_manager.name": "TokenShareReward",
    }


#: The reward of HalfConstantReward's constant groups.
HALF_CONSTANT_REWARD = 0.5


@register("test_half_constant")
class HalfConstantReward(TokenShareReward):
    """The token share, except a constant for questions of even length: some groups have reward spread, some
    none."""

    async def run_single(self, data):
        if len(data[-1].non_tensor_batch["extra_info"]["question"]) % 2 == 0:
            return {"reward_score": HALF_CONSTANT_REWARD, "reward_extra_info": {"share": 0.0}}
        return await super().run_single(data)


@pytest.fixture(scope="module")
def tiny_model(tiny_models):
    return tiny_models / "policy"


@pytest.fixture()
def grpo_config(tmp_path, locomo_rows, cache_dir):
    """``grpo_config(model, run_dir=..., **settings)``: a small MemoryUpdate run on conv-26's rows."""

    def make(model, run_dir=None, **overrides) -> LocalGRPOConfig:
        base = dict(
            model_path=str(model),
            train_files=[str(locomo_rows["train"])],
            run_dir=str(run_dir or tmp_path / "run"),
            tool_config=str(TOOL_CONFIG),
            memory=MemoryEnvironment(memories=locomo_rows["memories"], embeddings=cache_dir),
            prompts_per_step=2,
            rollout_n=4,
            max_new_tokens=16,
            prompt_length=4096,
            response_length=128,
            max_assistant_turns=2,
            max_rows=8,
            reward={"efficiency": {"max_total_memories": None}},
        )
        return LocalGRPOConfig(**{**base, **overrides})

    return make
