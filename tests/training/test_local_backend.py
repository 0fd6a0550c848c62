"""The local GRPO backend, end to end on a tiny random model: verl's AgentLoopWorker with our loop and
tools, verl's reward loop, verl's GRPO advantage and losses, AdamW, checkpoints."""

import json

import pytest
import torch
from safetensors.torch import load_file
from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

from memupdate.training.local import LocalGRPOConfig, LocalGRPOTrainer, train_local


@register("test_token_share")
class TokenShareReward(RewardManagerBase):
    """A toy reward a random tiny model can learn: the share of response tokens among the lowest eighth
    of the vocabulary (about 1/8 at random, so every GRPO group has spread to learn from)."""

    def __init__(self, config, tokenizer, compute_score=None, **kwargs):
        super().__init__(config, tokenizer, compute_score)

    async def run_single(self, data):
        row = data[-1]
        length = int(row.batch["attention_mask"][-row.batch["responses"].size(-1) :].sum())
        tokens = row.batch["responses"][:length]
        share = float((tokens < len(self.tokenizer) // 8).float().mean()) if length else 0.0
        return {"reward_score": share, "reward_extra_info": {"share": share}}


@pytest.fixture(scope="module")
def tiny_model(tiny_models):
    return tiny_models / "policy"


def config(tmp_path, tiny_model, rows, cache_dir, **overrides):
    base = dict(
        model_path=str(tiny_model),
        train_files=[str(rows["train"])],
        run_dir=str(tmp_path / "run"),
        tool_config="config/tools/memory_tools.yaml",
        memories=str(rows["memories"]),
        embeddings=str(cache_dir),
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


@pytest.fixture()
def memory_env(monkeypatch, repo_root, locomo_rows, cache_dir):
    monkeypatch.chdir(repo_root)
    monkeypatch.setenv("MEMUPDATE_MEMORIES", str(locomo_rows["memories"]))
    monkeypatch.setenv("MEMUPDATE_EMBEDDINGS", str(cache_dir))


@pytest.mark.slow
def test_memory_reward_run_writes_a_checkpoint_that_loads(
    tmp_path, tiny_model, locomo_rows, cache_dir, memory_env
):
    from transformers import AutoModelForCausalLM

    cfg = config(tmp_path, tiny_model, locomo_rows, cache_dir, steps=2)
    metrics = train_local(cfg)
    run = tmp_path / "run"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2] and metrics["step"] == 2
    assert sum(metrics["termination"].values()) == 8
    assert set(metrics["seconds"]) == {"rollout", "generation", "reward", "tools_and_other", "update"}
    manifest = json.loads((run / "ckpt" / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["config_digest"] == cfg.digest()
    assert AutoModelForCausalLM.from_pretrained(run / "ckpt") is not None
    assert (
        json.loads((run / "resolved_config.json").read_text())["verl"]["reward"]["reward_manager"]["name"]
        == "memupdate_memory"
    )


@pytest.mark.slow
def test_grpo_learns_a_toy_reward_changes_weights_and_resumes(
    tmp_path, tiny_model, locomo_rows, cache_dir, memory_env
):
    cfg = config(
        tmp_path,
        tiny_model,
        locomo_rows,
        cache_dir,
        steps=20,
        lr=3e-2,
        kl_coef=0.0,
        max_assistant_turns=1,
        reward_manager="test_token_share",
        save_every=10,
    )
    before = load_file(tiny_model / "model.safetensors")
    train_local(cfg)
    rewards = [
        json.loads(line)["reward_mean"]
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.15, rewards
    after = load_file(tmp_path / "run" / "ckpt" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)

    # Resume: a longer run picks up at the last saved step instead of starting over.
    resumed = LocalGRPOTrainer(cfg.__class__(**{**cfg.__dict__, "steps": 22}))
    assert resumed.step == 20
    assert resumed.train()["step"] == 22

    # Another configuration (or a finished run asked for again) starts afresh; the old run is kept aside.
    changed = cfg.__class__(**{**cfg.__dict__, "lr": 1e-3})
    fresh = LocalGRPOTrainer(changed)
    assert fresh.step == 0
    kept = tmp_path / "run" / "superseded" / f"{cfg.digest()}-step22"
    assert sorted(p.name for p in (kept / "checkpoints").iterdir())[-1] == "step_000022"
    assert len((kept / "metrics.jsonl").read_text().splitlines()) == 22
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_same_seed_gives_the_same_weights(tmp_path, tiny_model, locomo_rows, cache_dir, memory_env):
    runs = []
    for name in ("a", "b"):
        cfg = config(
            tmp_path / name, tiny_model, locomo_rows, cache_dir, steps=2, reward_manager="test_token_share"
        )
        train_local(cfg)
        runs.append(load_file(tmp_path / name / "run" / "ckpt" / "model.safetensors"))
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
