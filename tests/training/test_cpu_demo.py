"""The cpu_demo experiment shortened for CI (docs/cpu-demo.md): rows that mix questions with headroom and others,
SmolLM2's cold start on a few of the expert's demonstrations (verl's SFT trainer on CPU) makes held-out episodes
call the tools the untrained model never calls, and verl's GRPO, in the experiment's trainer mode, finds reward
spread on the questions with headroom and updates the cold start on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from memupdate.eval.policy import EPISODES, evaluate_policy
from memupdate.training.sft import cold_start
from memupdate.training.stages import train_stage

pytestmark = [pytest.mark.slow, pytest.mark.verl_cpu, pytest.mark.vllm]

#: The experiment this test shortens: its tools, reward, episode and GRPO settings are read, not copied.
CONFIG = yaml.safe_load((Path(__file__).parents[2] / "config" / "config.yaml").read_text())
DEMO = CONFIG["experiments"]["cpu_demo"]
TOOLS, EPISODE = DEMO["tools"], DEMO["episode"]
REWARD = {**DEMO["reward"], "efficiency": {"max_total_memories": None}}
ON_CPU = {"trainer.device": "cpu"}
SEARCH_TOP_K = DEMO["headroom"]["search_top_k"]
SFT = {"epochs": 2, "batch_size": 2, "micro_batch_size": 2, "lr": 1e-4, "max_rows": 8, "search_top_k": SEARCH_TOP_K}


def tool_call_rate(episodes) -> float:
    records = [json.loads(line) for line in episodes.read_text().splitlines()]
    return sum(r["tool_calls"] > 0 for r in records) / len(records)


def test_the_cold_start_calls_tools_held_out_and_grpo_updates_it_on_reward_spread(
    smollm2_dir, locomo_rows, held_out_cache, headroom_mix, vllm_python, tmp_path
):
    data = {
        "memories": str(locomo_rows["memories"]),
        "embeddings": str(held_out_cache),
        "reward": REWARD,
        "tools": TOOLS,
    }
    # The cold start on questions with headroom alone: its few rows are then all edits, so that a policy trained
    # on them edits often enough for two short GRPO steps to find reward spread (cpu_demo's own cold start, on
    # a half-and-half mix, edits in about one episode of ten).
    with_room = headroom_mix("train", share=1.0)
    sft = cold_start(
        settings=SFT,
        episode=EPISODE,
        model=str(smollm2_dir),
        train_files=[str(with_room)],
        run_dir=str(tmp_path / "sft"),
        layout=ON_CPU,
        **data,
    )
    demonstrations = json.loads((tmp_path / "sft" / "demonstrations.summary.json").read_text())
    assert demonstrations["kept_edits"] > 0, demonstrations
    base = load_file(smollm2_dir / "model.safetensors")
    cold = load_file(sft / "model.safetensors")
    assert any(not torch.equal(base[k], cold[k].to(base[k].dtype)) for k in base)

    # Held out: conv-30's mix; the demonstrations came from conv-26's.
    held_out = headroom_mix("test", share=0.5)
    summaries, rates = {}, {}
    for name, model in (("base", smollm2_dir), ("sft", sft)):
        out = tmp_path / "policy_eval" / name
        summaries[name] = evaluate_policy(
            model=str(model),
            rows=str(held_out),
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

    # GRPO from the cold start, by verl's trainer on CPU in cpu_demo's trainer mode, on questions with headroom
    # (where the cold start's updates differ in reward): one step of two questions x six rollouts (measured: both
    # groups had spread, rewards 0 to +0.5, mean +0.19; 233 s).
    run_dir = tmp_path / "stage1"
    ckpt = train_stage(
        trained_role="memory",
        # cpu_demo's GRPO (its advantage, learning rate and trainer mode), shortened: no validation, one step.
        settings={
            **DEMO["stage1"],
            **ON_CPU,
            "trainer.total_training_steps": 1,
            "trainer.save_freq": 1,
            "trainer.test_freq": -1,
            "trainer.val_before_train": False,
            "data.train_batch_size": 2,
            "actor_rollout_ref.rollout.n": 6,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        },
        episode=EPISODE,
        model=str(sft),
        train_files=[str(with_room)],
        run_dir=str(run_dir),
        verl={"val_files": [str(held_out)], "serving": {**CONFIG["serving"], "python": str(vllm_python)}},
        **data,
    )
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1]
    # A step with spread updates (not skipped), on its groups with spread: a policy loss was computed.
    updated = [s["verl"] for s in steps if s["verl"].get("actor/update_skipped", 1.0) == 0.0]
    assert updated, [s["verl"].get("critic/score/mean") for s in steps]
    assert all("actor/pg_loss" in v and v["actor/trained_rows"] > 0 for v in updated), updated
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == 1 and manifest["base_model"] == str(sft)
    trained = load_file(ckpt / "model.safetensors")
    assert any(not torch.equal(cold[k], trained[k].to(cold[k].dtype)) for k in cold)
