"""The cpu_demo experiment shortened for CI (docs/cpu-demo.md): SmolLM2's cold start on a
few train demonstrations (verl's SFT trainer on CPU) makes held-out episodes call the tools the untrained model
never calls, and verl's GRPO trains from the cold start."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from memupdate.eval.policy import EPISODES, evaluate_policy
from memupdate.names import MANAGE_TOOL, MERGE_TOOL, SEARCH_TOOL
from memupdate.training.sft import cold_start
from memupdate.training.stages import train_stage

pytestmark = [pytest.mark.slow, pytest.mark.verl_cpu, pytest.mark.vllm]

TOOLS = {"names": [SEARCH_TOOL, MANAGE_TOOL, MERGE_TOOL], "compact": True}
# cpu_demo's episode (config/config.yaml) with shorter turns: a search call is about 40 tokens.
EPISODE = {
    "max_new_tokens": 96,
    "max_assistant_turns": 2,
    "prompt_length": 1024,
    "response_length": 512,
    "max_tool_response_length": 512,
}
ON_CPU = {"trainer.device": "cpu"}
REWARD = {"scorer": "answer_recall", "efficiency": {"max_total_memories": None}}
# Measured: two epochs of about 7 demonstrations, two per step, bring the held-out well-formed call rate from
# 0 to 0.75 (one epoch at batch 4 and lr 2e-4: calls in 60% of episodes, none well-formed), in about 2 minutes.
SFT = {"epochs": 2, "batch_size": 2, "micro_batch_size": 2, "lr": 1e-4, "max_rows": 8, "search_top_k": 5}


def tool_call_rate(episodes) -> float:
    records = [json.loads(line) for line in episodes.read_text().splitlines()]
    return sum(r["tool_calls"] > 0 for r in records) / len(records)


def test_a_short_cold_start_makes_smollm2_call_tools_on_held_out_questions_and_grpo_trains_from_it(
    smollm2_dir, locomo_rows, held_out_cache, vllm_python, repo_root, tmp_path
):
    data = {
        "memories": str(locomo_rows["memories"]),
        "embeddings": str(held_out_cache),
        "reward": REWARD,
        "tools": TOOLS,
    }
    sft = cold_start(
        settings=SFT,
        episode=EPISODE,
        model=str(smollm2_dir),
        train_files=[str(locomo_rows["train"])],
        run_dir=str(tmp_path / "sft"),
        layout=ON_CPU,
        **data,
    )
    base = load_file(smollm2_dir / "model.safetensors")
    cold = load_file(sft / "model.safetensors")
    assert any(not torch.equal(base[k], cold[k].to(base[k].dtype)) for k in base)

    # Held out: conv-30's questions; the demonstrations came from conv-26's.
    summaries, rates = {}, {}
    for name, model in (("base", smollm2_dir), ("sft", sft)):
        out = tmp_path / "policy_eval" / name
        summaries[name] = evaluate_policy(
            model=str(model),
            rows=str(locomo_rows["test"]),
            out_dir=str(out),
            episode=EPISODE,
            n=1,
            questions=4,
            server="hf",
            **data,
        )
        assert summaries[name]["episodes"] == 4
        rates[name] = tool_call_rate(out / EPISODES)
    assert rates["sft"] > rates["base"], rates
    assert summaries["sft"]["well_formed_rate"] > summaries["base"]["well_formed_rate"], summaries

    # GRPO from the cold start, by verl's trainer on CPU: one step of one question x two rollouts.
    serving = yaml.safe_load((repo_root / "config" / "config.yaml").read_text())["serving"]
    run_dir = tmp_path / "stage1"
    ckpt = train_stage(
        trained_role="memory",
        settings={
            **ON_CPU,
            "trainer.total_training_steps": 1,
            "trainer.save_freq": 1,
            "trainer.test_freq": -1,
            "trainer.val_before_train": False,
            "data.train_batch_size": 1,
            "actor_rollout_ref.rollout.n": 2,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 1,
            "actor_rollout_ref.actor.optim.lr": 1e-5,
        },
        episode=EPISODE,
        model=str(sft),
        train_files=[str(locomo_rows["train"])],
        run_dir=str(run_dir),
        verl={"val_files": [str(locomo_rows["test"])], "serving": {**serving, "python": str(vllm_python)}},
        **data,
    )
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1] and steps[0]["verl"]["timing_s/update_actor"] > 0
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == 1 and manifest["base_model"] == str(sft)
    trained = load_file(ckpt / "model.safetensors")
    assert any(not torch.equal(base[k], trained[k].to(base[k].dtype)) for k in base)
