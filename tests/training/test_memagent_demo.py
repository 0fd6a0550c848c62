"""The memagent_demo experiment shortened for CI (docs/memagent.md), run by the workflow's own rules as
``./run.sh demo-memagent`` runs it: SmolLM2's cold start on the scripted expert's trajectories (rule
train_memagent_sft, verl's SFT trainer on CPU) makes the policy box its answers, which the untrained model never
does (0 of 800 final turns: ../shared/notes/memagent-signal.md), so verl's GRPO (rule train_memagent), in the
experiment's trainer mode and with the project's reward unchanged (exact match of the boxed answer), finds reward
spread and updates the cold start on it."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors.torch import load_file

from memupdate.training.sft import DEMONSTRATION_SUMMARY

pytestmark = [pytest.mark.slow, pytest.mark.verl_cpu, pytest.mark.vllm]

EXPERIMENT = "results/memagent_demo"
#: The experiment's own cold-start settings (config/config.yaml).
DEMO_SFT = yaml.safe_load((Path(__file__).parents[2] / "config" / "config.yaml").read_text())["experiments"][
    "memagent_demo"
]["sft"]
#: Merged over config/config.yaml: the experiment's loop, reward, cold start and GRPO settings stay as they are, but
#: for these. The haystacks are the two gold documents alone (about 270 SmolLM2 tokens): one chunk, so a trajectory
#: is a memory turn and the answer. The first 6 questions: 4 train (the same at any limit: a question's part is a
#: hash of its id), which the cold start learns and GRPO then plays, and 2 held out.
SHORTENED = {
    "scales": {"smoke": {"hotpotqa_num_docs": [2], "hotpotqa_limit": 6}},
    "experiments": {
        "memagent_demo": {
            # The 4 questions' trajectories (8 rows) at twice the experiment's rate, 2 epochs: 4 steps teach the
            # boxed answer without making every rollout right (measured: GRPO's step-1 reward 0.5, both groups with
            # spread; after 4 epochs 0.94, one group a rollout short of flat).
            "sft": {"questions_percent": None, "epochs": 2, "batch_size": 4, "lr": 1.0e-4},
            # One step of two of the questions the cold start saw, validated before training on the held-out two.
            "train": {
                "num_docs": 2,
                "trainer.total_training_steps": 1,
                "trainer.save_freq": 1,
                "trainer.test_freq": -1,
                "data.train_batch_size": 2,
                "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
            },
            "eval": {"num_docs": [2]},
        }
    },
}


def test_the_cold_start_boxes_answers_and_grpo_updates_it_on_reward_spread(shortened_run, smollm2_configured_dir):
    copy, run = shortened_run(SHORTENED, f"{EXPERIMENT}/memagent/ckpt", models={"smollm2-135m": smollm2_configured_dir})
    assert run.returncode == 0, run.stderr[-5000:]
    repo = copy.repo
    # The rules ran, not their functions: each job left its benchmark.
    for rule in ("train_memagent_sft", "train_memagent"):
        assert (repo / "benchmarks" / rule / "memagent_demo.tsv").is_file(), rule
    demonstrations = json.loads((repo / EXPERIMENT / "sft" / DEMONSTRATION_SUMMARY).read_text())
    assert demonstrations["kept"] == 4, demonstrations
    sft = repo / EXPERIMENT / "sft" / "ckpt"
    base, cold = load_file(smollm2_configured_dir / "model.safetensors"), load_file(sft / "model.safetensors")
    assert any(not torch.equal(base[k], cold[k].to(base[k].dtype)) for k in base)

    run_dir = repo / EXPERIMENT / "memagent"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("reward_mean") is not None]
    assert [s["step"] for s in steps] == [1], records
    (step,) = steps
    # The cold start earns the reward the base model never earns, and not on every rollout: spread.
    assert 0 < step["reward_mean"] < 1 and step["reward_max"] == 1.0, step
    # The step updated (not skipped) on its groups with spread: a policy loss over whole groups' rows.
    verl = step["verl"]
    assert verl.get("actor/update_skipped", 0.0) == 0.0 and "actor/pg_loss" in verl, verl
    assert verl["actor/trained_rows"] > 0, verl
    manifest = json.loads((run_dir / "ckpt" / "manifest.json").read_text())
    assert manifest["step"] == 1 and manifest["base_model"] == f"{EXPERIMENT}/sft/ckpt"
    trained = load_file(run_dir / "ckpt" / "model.safetensors")
    assert any(not torch.equal(cold[k], trained[k].to(cold[k].dtype)) for k in cold)
    # Held out, before training: verl validated the cold start once (the learning curve's first point) on the
    # two held-out questions.
    heldout = [r for r in records if r.get("heldout_reward_mean") is not None]
    assert len(heldout) == 1 and heldout[0]["heldout_questions"] == 2, records

    # The demo's own sft.questions_percent (50): the cold start and GRPO take disjoint shares of the train questions
    # (rule split_memagent_train, which the shortened run above leaves out).
    (repo / "half.yaml").write_text(json.dumps({"experiments": {"memagent_demo": {"sft": DEMO_SFT}}}))
    parts = {part: f"{EXPERIMENT}/data/{part}.parquet" for part in ("sft", "grpo")}
    split = copy.snakemake(*parts.values(), "--cores", "1", "--configfile", "ci.yaml", "half.yaml")
    assert split.returncode == 0, split.stderr[-3000:]
    ids = {
        part: set(pq.read_table(repo / path).column("extra_info").combine_chunks().field("id").to_pylist())
        for part, path in parts.items()
    }
    train = pq.read_table(repo / "results/data/hotpotqa/dev-2.train.parquet").column("extra_info").combine_chunks()
    assert ids["sft"] and ids["grpo"] and not ids["sft"] & ids["grpo"]
    assert ids["sft"] | ids["grpo"] == set(train.field("id").to_pylist())
