"""The cpu_demo experiment shortened for CI (README "A run that learns, on a CPU"): SmolLM2's cold start on a
few train demonstrations makes held-out episodes call the tools the untrained model never calls, and GRPO
trains from the cold start."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from memupdate.data.rows import MANAGE_TOOL, MERGE_TOOL, SEARCH_TOOL
from memupdate.eval.policy import EPISODES, evaluate_policy
from memupdate.training.sft import cold_start
from memupdate.training.stages import train_stage

pytestmark = pytest.mark.slow

TOOLS = {"names": [SEARCH_TOOL, MANAGE_TOOL, MERGE_TOOL], "compact": True}
# cpu_demo's episode (config/config.yaml) with shorter turns: a search call is about 40 tokens.
STAGE = {
    "max_new_tokens": 96,
    "max_assistant_turns": 2,
    "prompt_length": 1024,
    "response_length": 512,
    "max_tool_response_length": 512,
    "seed": 0,
}
REWARD = {"scorer": "answer_recall", "efficiency": {"max_total_memories": None}}
# Measured: two epochs of about 7 demonstrations, two per step, bring the held-out well-formed call rate from
# 0 to 0.75 (one epoch at batch 4 and lr 2e-4: calls in 60% of episodes, none well-formed), in about 2 minutes.
SFT = {"epochs": 2, "batch_size": 2, "micro_batch_size": 2, "lr": 1e-4, "max_rows": 8, "search_top_k": 5}


def tool_call_rate(episodes) -> float:
    records = [json.loads(line) for line in episodes.read_text().splitlines()]
    return sum(r["tool_calls"] > 0 for r in records) / len(records)


def test_a_short_cold_start_makes_smollm2_call_tools_on_held_out_questions_and_grpo_trains_from_it(
    smollm2_dir, locomo_rows, held_out_cache, tmp_path
):
    data = {
        "memories": str(locomo_rows["memories"]),
        "embeddings": str(held_out_cache),
        "reward": REWARD,
        "tools": TOOLS,
    }
    sft = cold_start(
        settings=SFT,
        stage=STAGE,
        model=str(smollm2_dir),
        train_files=[str(locomo_rows["train"])],
        run_dir=str(tmp_path / "sft"),
        **data,
    )
    base = load_file(smollm2_dir / "model.safetensors")
    cold = load_file(sft / "model.safetensors")
    assert any(not torch.equal(base[k], cold[k]) for k in base)

    # Held out: conv-30's questions; the demonstrations came from conv-26's.
    summaries, rates = {}, {}
    for name, model in (("base", smollm2_dir), ("sft", sft)):
        out = tmp_path / "policy_eval" / name
        summaries[name] = evaluate_policy(
            model=str(model),
            rows=str(locomo_rows["test"]),
            out_dir=str(out),
            stage=STAGE,
            n=1,
            questions=4,
            server="hf",
            **data,
        )
        assert summaries[name]["episodes"] == 4
        rates[name] = tool_call_rate(out / EPISODES)
    assert rates["sft"] > rates["base"], rates
    assert summaries["sft"]["well_formed_rate"] > summaries["base"]["well_formed_rate"], summaries

    # GRPO from the cold start: each step updates the weights, or says why it could not (a group whose
    # episodes all scored the same has no advantage; the short cold start rarely edits, so rarely differs).
    run_dir = tmp_path / "stage1"
    ckpt = train_stage(
        backend="local",
        training_stage="memory",
        settings={**STAGE, "steps": 2, "prompts_per_step": 1, "rollout_n": 2, "micro_batch_size": 1, "lr": 1e-5},
        model=str(sft),
        train_files=[str(locomo_rows["train"])],
        run_dir=str(run_dir),
        **data,
    )
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    trained = load_file(ckpt / "model.safetensors")
    updated = [s["step"] for s in steps if s["update_skipped"] is None]
    assert all(s["update_skipped"] == "all advantages are zero" for s in steps if s["step"] not in updated)
    assert any(not torch.equal(cold[k], trained[k]) for k in cold) == bool(updated), steps
    assert any(not torch.equal(base[k], trained[k]) for k in base)
