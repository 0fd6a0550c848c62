"""The local GRPO backend, end to end on a tiny random model: verl's AgentLoopWorker with our loop and
tools, verl's reward loop, verl's GRPO advantage and losses, AdamW, checkpoints."""

import json

import pytest
import torch
from safetensors.torch import load_file

from memupdate.training.local import LocalGRPOTrainer, train_local


@pytest.mark.slow
def test_memory_reward_run_writes_a_checkpoint_that_loads(tmp_path, tiny_model, grpo_config, memory_env):
    from transformers import AutoModelForCausalLM

    cfg = grpo_config(tiny_model, steps=2)
    metrics = train_local(cfg)
    run = tmp_path / "run"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2] and metrics["step"] == 2
    assert sum(metrics["termination"].values()) == 8
    assert set(metrics["seconds"]) == {
        "rollout", "generation", "fixed_model", "reward", "tools_and_other", "update", "weight_sync"
    }
    manifest = json.loads((run / "ckpt" / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["config_digest"] == cfg.digest()
    assert AutoModelForCausalLM.from_pretrained(run / "ckpt") is not None
    assert (
        json.loads((run / "resolved_config.json").read_text())["verl"]["reward"]["reward_manager"]["name"]
        == "memupdate_memory"
    )


@pytest.mark.slow
def test_grpo_learns_a_toy_reward_changes_weights_and_resumes(tmp_path, tiny_model, grpo_config, memory_env):
    cfg = grpo_config(
        tiny_model,
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

    # Resume: a longer run picks up at the last saved step instead of starting over. A run killed after
    # logging a step it never saved, mid-line, keeps only the saved steps' metrics.
    with (tmp_path / "run" / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps({"step": 21, "reward_mean": 0.0}) + '\n{"step": 2')
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
def test_same_seed_gives_the_same_weights(tmp_path, tiny_model, grpo_config, memory_env):
    runs = []
    for name in ("a", "b"):
        cfg = grpo_config(
            tiny_model, run_dir=tmp_path / name / "run", steps=2, reward_manager="test_token_share"
        )
        train_local(cfg)
        runs.append(load_file(tmp_path / name / "run" / "ckpt" / "model.safetensors"))
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_log_probs_are_those_of_the_policy_that_sampled_at_the_rollout_temperature(tiny_model):
    """Tokens drawn at temperature T come from softmax(logits / T); the loss and the KL must use that policy."""
    from transformers import AutoModelForCausalLM
    from verl import DataProto

    from memupdate.training.local import response_log_probs

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompt, response = torch.tensor([[5, 9, 14, 3]]), torch.tensor([[7, 2, 11]])
    ids = torch.cat([prompt, response], dim=1)
    batch = DataProto.from_single_dict({
        "input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(ids.size(1))[None],
        "responses": response,
    })  # fmt: skip
    logits = model(input_ids=ids).logits[0, prompt.size(1) - 1 : -1].float()
    for temperature in (1.0, 0.7, 2.0):
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, response[0, :, None]).squeeze(-1)
        got = response_log_probs(model, batch, False, temperature)[0]
        assert torch.allclose(got, expected, atol=1e-5), temperature
    assert not torch.allclose(response_log_probs(model, batch, False, 2.0), response_log_probs(model, batch, False, 1.0))
    with pytest.raises(ValueError, match="positive sampling temperature"):
        response_log_probs(model, batch, False, 0.0)
