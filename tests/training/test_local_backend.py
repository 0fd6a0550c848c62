"""The local GRPO backend, end to end on a tiny random model: verl's AgentLoopWorker with our loop and
tools, verl's reward loop, verl's GRPO advantage and losses, AdamW, checkpoints."""

import json
import time

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

from memupdate.training.local import LocalGRPOTrainer, train_local
from memupdate.utils.io import sha256_file

#: A reward whose float32 group mean over 8 rollouts misses it by an ulp (see the zero-advantage test).
CONSTANT_REWARD = 0.7


@register("test_constant")
class ConstantReward(RewardManagerBase):
    """Every rollout gets the same reward: no group has anything to learn."""

    def __init__(self, config, tokenizer, compute_score=None, **kwargs):
        super().__init__(config, tokenizer, compute_score)

    async def run_single(self, data):
        return {"reward_score": CONSTANT_REWARD, "reward_extra_info": {}}


def scalars(log_dir, tag) -> dict[int, float]:
    """``{step: value}`` of a tensorboard scalar, read back as tensorboard reads the run's event files."""
    events = EventAccumulator(str(log_dir))
    events.Reload()
    steps = [e.step for e in events.Scalars(tag)]
    assert len(steps) == len(set(steps)), f"{tag} logged twice at some step: {steps}"
    return {e.step: e.value for e in events.Scalars(tag)}


def next_second():
    """Event files are read in name order, and a name holds the second it was opened and a per-process
    counter (9 sorts after 10): writers opened within one second of each other in one process may be read
    out of order. Runs are separate processes, seconds apart; the tests wait for the next second."""
    time.sleep(1.01 - time.time() % 1)


@pytest.mark.slow
def test_memory_reward_run_writes_a_checkpoint_that_loads(tmp_path, tiny_model, grpo_config):
    from transformers import AutoModelForCausalLM

    cfg = grpo_config(tiny_model, steps=2)
    metrics = train_local(cfg)
    run = tmp_path / "run"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2] and metrics["step"] == 2
    # Each step also went through verl's Tracking, into the run's own tensorboard folder.
    rewards = scalars(run / "tensorboard", "reward_mean")
    assert rewards == pytest.approx({m["step"]: m["reward_mean"] for m in lines})
    assert set(scalars(run / "tensorboard", "seconds/rollout")) == {1, 2}
    # What the curve came from: the code's commit, the settings' digest, the data's hashes.
    info = json.loads((run / "run_info.json").read_text())
    assert info["config_digest"] == cfg.digest() and len(info["git"]["commit"]) == 40
    assert isinstance(info["git"]["dirty"], bool)
    assert set(info["data_sha256"]) == {"train_files", "memories", "embeddings"}
    assert info["data_sha256"]["train_files"] == [
        {"path": cfg.train_files[0], "sha256": sha256_file(cfg.train_files[0])}
    ]
    assert sum(metrics["termination"].values()) == 8
    assert set(metrics["seconds"]) == {
        "rollout",
        "generation",
        "fixed_model",
        "reward",
        "tools_and_other",
        "update",
        "weight_sync",
    }
    manifest = json.loads((run / "ckpt" / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["config_digest"] == cfg.digest()
    assert manifest["git"] == info["git"] and manifest["data_sha256"] == info["data_sha256"]
    assert AutoModelForCausalLM.from_pretrained(run / "ckpt") is not None
    assert (
        json.loads((run / "resolved_config.json").read_text())["verl"]["reward"]["reward_manager"]["name"]
        == "memupdate_memory"
    )


@pytest.mark.slow
def test_grpo_learns_a_toy_reward_changes_weights_and_resumes(tmp_path, tiny_model, grpo_config):
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
        json.loads(line)["reward_mean"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.15, rewards
    after = load_file(tmp_path / "run" / "ckpt" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)

    # Resume: a longer run picks up at the last saved step instead of starting over. A run killed after
    # logging a step it never saved, mid-line, keeps only the saved steps' metrics.
    with (tmp_path / "run" / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps({"step": 21, "reward_mean": 0.0}) + '\n{"step": 2')
    # The killed run had logged that step to tensorboard too.
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(tmp_path / "run" / "tensorboard") as writer:
        writer.add_scalar("reward_mean", -1.0, 21)
    next_second()
    resumed = LocalGRPOTrainer(cfg.__class__(**{**cfg.__dict__, "steps": 22}))
    assert resumed.step == 20
    assert resumed.train()["step"] == 22
    # The tracker logs from the resumed step on, and the killed run's unsaved step is hidden.
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert scalars(tmp_path / "run" / "tensorboard", "reward_mean") == pytest.approx(
        {m["step"]: m["reward_mean"] for m in logged}
    )
    assert list(scalars(tmp_path / "run" / "tensorboard", "reward_mean")) == list(range(1, 23))

    # Another configuration (or a finished run asked for again) starts afresh; the old run is kept aside.
    changed = cfg.__class__(**{**cfg.__dict__, "lr": 1e-3})
    fresh = LocalGRPOTrainer(changed)
    assert fresh.step == 0
    kept = tmp_path / "run" / "superseded" / f"{cfg.digest()}-step22"
    assert sorted(p.name for p in (kept / "checkpoints").iterdir())[-1] == "step_000022"
    assert len((kept / "metrics.jsonl").read_text().splitlines()) == 22
    assert (kept / "tensorboard").is_dir() and not (tmp_path / "run" / "tensorboard").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_step_without_advantages_skips_the_update(tmp_path, tiny_model, grpo_config):
    """Every rollout scores the same: the step has nothing to learn, so no backward, no optimizer step, and
    metrics.jsonl says so; a step with spread in its rewards still updates."""
    # verl's float32 group mean of 8 equal scores misses them by an ulp, which the std division blows up
    # to advantages of ~0.06: without zeroing them, this run would train on noise.
    scores = torch.full((8,), CONSTANT_REWARD)
    assert scores.mean() != scores[0]
    base = load_file(tiny_model / "model.safetensors")
    settings = dict(steps=1, prompts_per_step=1, rollout_n=8, lr=3e-2, kl_coef=0.0, max_assistant_turns=1)

    constant = {**settings, "kl_coef": 0.001}
    cfg = grpo_config(tiny_model, run_dir=tmp_path / "constant", reward_manager="test_constant", **constant)
    metrics = train_local(cfg)
    assert metrics["reward_std"] == 0.0
    assert metrics["update_skipped"] == "all advantages are zero"
    assert metrics["pg_loss"] == 0.0 and metrics["grad_norm"] == 0.0
    # No reference forward ran: the KL is unknown, not 0 (the training plot leaves the step out).
    assert "kl" in metrics and metrics["kl"] is None
    after = load_file(tmp_path / "constant" / "ckpt" / "model.safetensors")
    assert all(torch.equal(base[k], after[k]) for k in base)
    assert scalars(tmp_path / "constant" / "tensorboard", "update_skipped") == {1: 1.0}

    cfg = grpo_config(tiny_model, run_dir=tmp_path / "spread", reward_manager="test_token_share", **settings)
    metrics = train_local(cfg)
    assert metrics["reward_std"] > 0 and metrics["update_skipped"] is None and metrics["grad_norm"] > 0
    after = load_file(tmp_path / "spread" / "ckpt" / "model.safetensors")
    assert any(not torch.equal(base[k], after[k]) for k in base)


@pytest.mark.slow
def test_filtered_groups_leave_the_update_but_not_the_metrics(tmp_path, tiny_model, grpo_config):
    """filter_groups: a group whose rollouts all got one reward has no policy gradient; it is left out of the
    forward and backward passes (DAPO's dynamic sampling, verl's algorithm.filter_groups) but still counted."""
    settings = dict(
        steps=1, prompts_per_step=4, rollout_n=2, max_assistant_turns=1, reward_manager="test_half_constant"
    )
    metrics = train_local(grpo_config(tiny_model, run_dir=tmp_path / "filtered", filter_groups=True, **settings))
    assert 0 < metrics["rows_filtered"] < metrics["rows"] == metrics["trajectories"] == 8, metrics
    assert metrics["update_skipped"] is None and metrics["grad_norm"] > 0
    kept = train_local(grpo_config(tiny_model, run_dir=tmp_path / "kept", **settings))
    assert "rows_filtered" not in kept and kept["reward_mean"] == metrics["reward_mean"]


@pytest.mark.slow
def test_same_seed_gives_the_same_weights(tmp_path, tiny_model, grpo_config):
    runs = []
    for name in ("a", "b"):
        cfg = grpo_config(tiny_model, run_dir=tmp_path / name / "run", steps=2, reward_manager="test_token_share")
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
    batch = DataProto.from_single_dict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(ids.size(1))[None],
            "responses": response,
        }
    )
    logits = model(input_ids=ids).logits[0, prompt.size(1) - 1 : -1].float()
    for temperature in (1.0, 0.7, 2.0):
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, response[0, :, None]).squeeze(-1)
        got = response_log_probs(model, batch, False, temperature)[0]
        assert torch.allclose(got, expected, atol=1e-5), temperature
    assert not torch.allclose(
        response_log_probs(model, batch, False, 2.0), response_log_probs(model, batch, False, 1.0)
    )
    with pytest.raises(ValueError, match="positive sampling temperature"):
        response_log_probs(model, batch, False, 0.0)


def test_log_probs_skip_the_padding_no_row_uses(tiny_model):
    """Prompts are left-padded and responses right-padded to their budgets; the forward pass skips columns no
    row uses (most of a short episode's budget) and gives the same log-probs, 0 on padding."""
    from transformers import AutoModelForCausalLM
    from verl import DataProto

    from memupdate.training.local import response_log_probs

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    # Two rows: prompts of 3 and 2 tokens (left-padded to 5), responses of 3 and 2 (right-padded to 6).
    prompts = torch.tensor([[0, 0, 5, 9, 14], [0, 0, 0, 8, 3]])
    responses = torch.tensor([[7, 2, 11, 0, 0, 0], [4, 6, 0, 0, 0, 0]])
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]])
    response_mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    attention = torch.cat([prompt_mask, response_mask], dim=1)
    batch = DataProto.from_single_dict(
        {
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
            "responses": responses,
        }
    )
    got = response_log_probs(model, batch, False)
    assert got.shape == responses.shape
    for row, (n_prompt, n_response) in enumerate([(3, 3), (2, 2)]):
        ids = torch.cat([prompts[row, -n_prompt:], responses[row, :n_response]])[None]
        logits = model(input_ids=ids).logits[0, n_prompt - 1 : -1].float()
        expected = torch.log_softmax(logits, dim=-1).gather(-1, responses[row, :n_response, None]).squeeze(-1)
        assert torch.allclose(got[row, :n_response], expected, atol=1e-5), row
    assert torch.equal(got[:, 3:], torch.zeros(2, 3))
