"""The cpu_demo experiment shortened for CI (docs/cpu-demo.md), run by the workflow's own rules as ``./run.sh demo``
runs it: SmolLM2's cold start on a few of the expert's demonstrations (rule train_sft, verl's SFT trainer on CPU) makes
held-out episodes (rule eval_policy, the policy served by vLLM) call the tools the untrained model never calls; verl's
GRPO (rule train_stage1), in the experiment's trainer mode, finds reward spread on the mix's questions and updates the
cold start on it; rule policy_report pairs the three policies."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from memupdate.eval.policy import EPISODES

pytestmark = [pytest.mark.slow, pytest.mark.verl_cpu, pytest.mark.vllm]

EXPERIMENT = "results/cpu_demo"
#: Merged over config/config.yaml: the experiment's tools, reward, episode and GRPO settings stay as they are, but
#: for these.
SHORTENED = {
    "experiments": {
        "cpu_demo": {
            # cpu_demo's half-and-half mix at the fifth attempt's top 10: the cold start's 8 rows are then 3 edits and
            # 5 stops, and it stopped in about half of the step's 12 episodes. On questions with headroom alone (8 edit
            # rows) it promoted a memory in about 11 of 12, mostly one that gained nothing: CI's step and one of two
            # here had no spread at all (12 x -0.05). At about half stops, a group of 6 is flat about 3% of the time,
            # both about 0.1%.
            "headroom": {"share": 0.5, "search_top_k": 10},
            "episode": {"max_tool_response_length": 2600},
            # An edit that gains nothing differs from a stop, so that one step of twelve episodes has spread without
            # needing a paying edit among them (cpu_demo's own reward has no such cost: docs/cpu-demo.md).
            "reward": {"idle_edit_cost": 0.05},
            "sft": {
                "epochs": 2,
                "batch_size": 2,
                "micro_batch_size": 2,
                "lr": 1.0e-4,
                "max_rows": 8,
                "search_top_k": 10,
            },
            # One step of two questions x six rollouts, saved, not validated.
            "stage1": {
                "trainer.total_training_steps": 1,
                "trainer.save_freq": 1,
                "trainer.test_freq": -1,
                "trainer.val_before_train": False,
                "data.train_batch_size": 2,
                "actor_rollout_ref.rollout.n": 6,
                "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
            },
            # Held out: 4 of the test conversations' questions, 2 episodes each, every policy served by vLLM.
            "policy_eval": {"n": 2, "questions": 4, "batch_size": 8},
        }
    }
}


def tool_call_rate(episodes) -> float:
    records = [json.loads(line) for line in episodes.read_text().splitlines()]
    return sum(r["tool_calls"] > 0 for r in records) / len(records)


def test_the_cold_start_calls_tools_held_out_and_grpo_updates_it_on_reward_spread(
    shortened_run, smollm2_configured_dir
):
    copy, run = shortened_run(
        SHORTENED, f"{EXPERIMENT}/policy_eval/report.json", models={"smollm2-135m": smollm2_configured_dir}
    )
    assert run.returncode == 0, run.stderr[-5000:]
    repo = copy.repo
    # The rules ran, not their functions: each job left its benchmark (policy_report has none).
    for bench in (
        "train_sft/cpu_demo",
        "train_stage/cpu_demo-stage1",
        *(f"eval_policy/cpu_demo-{p}" for p in ("base", "sft", "stage1")),
    ):
        assert (repo / "benchmarks" / f"{bench}.tsv").is_file(), bench
    demonstrations = json.loads((repo / EXPERIMENT / "sft" / "demonstrations.summary.json").read_text())
    assert demonstrations["kept_edits"] > 0, demonstrations
    sft = repo / EXPERIMENT / "sft" / "ckpt"
    base, cold = load_file(smollm2_configured_dir / "model.safetensors"), load_file(sft / "model.safetensors")
    assert any(not torch.equal(base[k], cold[k].to(base[k].dtype)) for k in base)

    # Held out: the test conversations' questions with headroom; the demonstrations came from the train split's.
    summaries = {
        name: json.loads((repo / EXPERIMENT / "policy_eval" / name / "summary.json").read_text())
        for name in ("base", "sft", "stage1")
    }
    assert all(s["episodes"] == 8 for s in summaries.values()), summaries
    rates = {name: tool_call_rate(repo / EXPERIMENT / "policy_eval" / name / EPISODES) for name in ("base", "sft")}
    assert rates["sft"] > rates["base"], rates
    assert summaries["sft"]["well_formed_rate"] > summaries["base"]["well_formed_rate"], summaries
    report = json.loads((repo / EXPERIMENT / "policy_eval" / "report.json").read_text())
    assert set(report["policies"]) == {"base", "sft", "stage1"} and report["comparisons"], report

    # GRPO from the cold start, where its episodes differ in reward (a stop and an edit that gains nothing at least).
    run_dir = repo / EXPERIMENT / "stage1"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1]
    # A step with spread updates (not skipped), on its groups with spread: a policy loss was computed.
    updated = [s["verl"] for s in steps if s["verl"].get("actor/update_skipped", 1.0) == 0.0]
    assert updated, [s["verl"].get("critic/score/mean") for s in steps]
    assert all("actor/pg_loss" in v and v["actor/trained_rows"] > 0 for v in updated), updated
    manifest = json.loads((run_dir / "ckpt" / "manifest.json").read_text())
    assert manifest["step"] == 1 and manifest["base_model"] == f"{EXPERIMENT}/sft/ckpt"
    trained = load_file(run_dir / "ckpt" / "model.safetensors")
    assert any(not torch.equal(cold[k], trained[k].to(cold[k].dtype)) for k in cold)
