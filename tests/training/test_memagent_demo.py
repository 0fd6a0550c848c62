"""The memagent_demo experiment shortened for CI (docs/memagent.md): SmolLM2's cold start on the scripted expert's
trajectories (verl's SFT trainer on CPU) makes the policy box its answers, which the untrained model never does
(0 of 800 final turns: ../shared/notes/memagent-signal.md), so verl's GRPO, in the experiment's trainer mode and
with the project's reward unchanged (exact match of the boxed answer), finds reward spread and updates the cold
start on it."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors.torch import load_file

from memupdate.data.hotpotqa import preprocess_hotpotqa, split_rows
from memupdate.training.sft import DEMONSTRATION_SUMMARY, cold_start_memagent
from memupdate.training.stages import train_memagent

pytestmark = [pytest.mark.slow, pytest.mark.verl_cpu, pytest.mark.vllm]

#: The experiment this test shortens: its loop, cold start and GRPO settings are read, not copied.
CONFIG = yaml.safe_load((Path(__file__).parents[2] / "config" / "config.yaml").read_text())
DEMO = CONFIG["experiments"]["memagent_demo"]
LOOP = DEMO["loop"]
ON_CPU = {"trainer.device": "cpu"}
#: The two gold documents alone (about 270 SmolLM2 tokens): one chunk, so a trajectory is a memory turn and the
#: answer, half the rows of the experiment's 4 documents.
NUM_DOCS = 2


@pytest.fixture(scope="module")
def rows(hotpotqa_path, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("memagent-demo-rows")
    preprocess_hotpotqa(hotpotqa_path, out / "rows.parquet", num_docs=NUM_DOCS, limit=16, test_percent=50)
    parts = {part: out / f"{part}.parquet" for part in ("train", "test")}
    split_rows(out / "rows.parquet", parts, test_percent=50)
    # Four train questions, which the cold start learns and GRPO then plays (its first two, in file order).
    parts["few"] = out / "few.parquet"
    pq.write_table(pq.read_table(parts["train"]).slice(0, 4), parts["few"])
    return parts


def test_the_cold_start_boxes_answers_and_grpo_updates_it_on_reward_spread(smollm2_dir, rows, vllm_python, tmp_path):
    # The cold start on 4 train questions' trajectories (8 rows) at twice the experiment's rate, 2 epochs: 4 steps
    # teach the boxed answer without making every rollout right (measured: GRPO's step-1 reward 0.5, both groups
    # with spread; after 4 epochs 0.94, one group a rollout short of flat).
    sft = cold_start_memagent(
        settings={**DEMO["sft"], "questions_percent": None, "epochs": 2, "batch_size": 4, "lr": 1e-4},
        loop=LOOP,
        model=str(smollm2_dir),
        train_files=[str(rows["few"])],
        run_dir=str(tmp_path / "sft"),
        layout=ON_CPU,
    )
    demonstrations = json.loads((tmp_path / "sft" / DEMONSTRATION_SUMMARY).read_text())
    assert demonstrations["kept"] == 4, demonstrations
    base, cold = load_file(smollm2_dir / "model.safetensors"), load_file(sft / "model.safetensors")
    assert any(not torch.equal(base[k], cold[k].to(base[k].dtype)) for k in base)

    # GRPO from the cold start by verl's trainer on CPU in memagent_demo's mode (memupdate_sync: an update on the
    # groups with spread), on the first two of the questions the cold start saw, validated before training on
    # four held-out ones.
    run_dir = tmp_path / "grpo"
    ckpt = train_memagent(
        settings={
            **{k: v for k, v in DEMO["train"].items() if k != "num_docs"},
            **ON_CPU,
            "trainer.total_training_steps": 1,
            "trainer.save_freq": 1,
            "trainer.test_freq": -1,
            "trainer.val_before_train": True,
            "data.val_max_samples": 4,
            "data.train_batch_size": 2,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        },
        loop=LOOP,
        model=str(sft),
        train_files=[str(rows["few"])],
        run_dir=str(run_dir),
        verl={"val_files": [str(rows["test"])], "serving": {**CONFIG["serving"], "python": str(vllm_python)}},
    )
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
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == 1 and manifest["base_model"] == str(sft)
    trained = load_file(ckpt / "model.safetensors")
    assert any(not torch.equal(cold[k], trained[k].to(cold[k].dtype)) for k in cold)
    # Held out, before training: verl validated the cold start once (the learning curve's first point; measured:
    # 4 questions scored, every answer boxed, 1 right).
    heldout = [r["heldout_reward_mean"] for r in records if r.get("heldout_reward_mean") is not None]
    assert len(heldout) == 1, records
