"""The paper-scale experiments (scale: full), composed exactly as their training jobs compose them and validated
against verl 0.9.1's own config and checks, on the GPU layout profiles/slurm/resources.yaml gives them."""

from __future__ import annotations

import pytest
import yaml
from omegaconf import OmegaConf

from memupdate.cluster import read_table
from memupdate.memory.environment import MemoryEnvironment
from memupdate.settings import check_config, experiment_stages
from memupdate.tools.config import TOOL_CONFIG
from memupdate.training import verl_launcher as vl
from memupdate.training.stages import verl_commands

ENDPOINT = {"base_url": "http://gpu-node:8000/v1", "model": "served"}


@pytest.fixture(scope="module")
def full(repo_root):
    config = yaml.safe_load((repo_root / "config/config.yaml").read_text())
    config["scale"] = "full"
    check_config(config, root=repo_root)
    return config


def slurm_env(table, rule: str, model: str) -> dict[str, str]:
    job = table.job(rule, model)
    return {
        "SLURM_JOB_ID": "1",
        "SLURM_JOB_NUM_NODES": str(job.nodes),
        "SLURM_GPUS_ON_NODE": str(job.gpus_per_node),
    }


def test_the_full_scale_is_verl_on_the_hub_models_with_the_whole_hotpotqa_dev_file(full):
    assert full["serving"]["engine"] == "vllm" and full["serving"]["dtype"] == "bfloat16"
    assert full["data"]["hotpotqa"]["splits"] == {"dev": "hotpotqa_dev"}
    assert full["data"]["files"]["hotpotqa_dev"]["sha256"].startswith("4e9ecb5c")
    for name in full["scales"]["full"]["experiments"]:
        experiment = full["experiments"][name]
        # Their rows in profiles/slurm/resources.yaml ask for GPUs, so verl trains on them.
        assert experiment.get("stage1", experiment.get("train"))["trainer.device"] == "cuda", name
        assert full["models"][experiment["policy"]]["name_or_path"].startswith("Qwen/Qwen2.5-"), name


@pytest.mark.parametrize(
    "name", ["memupdate_3b", "memupdate_7b", "two_stage_3b", "two_stage_7b", "curriculum_7b", "ingest_7b"]
)
def test_every_memoryupdate_stage_composes_against_verl(full, repo_root, tmp_path, name):
    experiment = full["experiments"][name]
    table = read_table(repo_root / "profiles/slurm/resources.yaml", full["models"])
    reward = {k: v for k, v in full["reward"].items() if k != "judge"}
    # scorer auto with a QA model: the served fixed QA model reads (rules/common.smk get_stage_reward).
    reward.update(scorer="reader", reader_marker=str(tmp_path / "qa-base.ready.json"))
    memory_settings = {k: full["memory"][k] for k in ("embedding_model", "max_content_chars")}
    for stage in experiment_stages(experiment):
        model = experiment["policy" if stage.role == "memory" else "qa_model"]
        run_dir = tmp_path / name / stage.name
        command, env = verl_commands(
            trained_role=stage.role,
            settings=stage.settings,
            model=full["models"][model]["name_or_path"],
            train_files=[str(tmp_path / "train.parquet")],
            memory=MemoryEnvironment(
                memories=tmp_path / "memories.parquet", embeddings=tmp_path / "embeddings", **memory_settings
            ),
            tool_config=str(TOOL_CONFIG),
            run_dir=str(run_dir),
            reward={**reward, "trained_role": stage.role},
            episode=experiment.get("episode"),
            fixed=ENDPOINT,
            verl={"val_files": [str(tmp_path / "val.parquet")]},
            env=slurm_env(table, "train_stage", model),
        )
        resolved = OmegaConf.load(run_dir / vl.RESOLVED_CONFIG)
        job = table.job("train_stage", model)
        assert (resolved.trainer.nnodes, resolved.trainer.n_gpus_per_node) == (job.nodes, job.gpus_per_node)
        rollout = resolved.actor_rollout_ref.rollout
        # An ingestion experiment's rows are sessions (156 in our split's train conversations), fewer per step.
        batch = 16 if "ingestion" in experiment else 32
        assert rollout.n == 8 and resolved.data.train_batch_size == batch and rollout.multi_turn.enable
        assert resolved.actor_rollout_ref.model.path == full["models"][model]["name_or_path"]
        assert resolved.reward.custom_reward_function.reward_kwargs.scorer == "reader"
        # Every step reachable whatever the rows (one step an epoch is the fewest a run can have; verl 0.9.1 stops
        # at total_epochs epochs): a 300-step stage of our split's 27 steps an epoch once stopped at step 270.
        assert vl.unreachable_steps(resolved, rows=resolved.data.train_batch_size) is None
        assert "memupdate.verl_ext.main_ppo" in " ".join(command)


def test_memagent_7b_composes_against_verl_with_memagents_budgets(full, repo_root, tmp_path):
    experiment = full["experiments"]["memagent_7b"]
    table = read_table(repo_root / "profiles/slurm/resources.yaml", full["models"])
    job = table.job("train_memagent", experiment["policy"])
    settings = {k: v for k, v in experiment["train"].items() if k != "num_docs"}
    run_dir = tmp_path / "memagent"
    vl.prepare_memagent_ppo(
        vl.MemAgentRun(
            model_path=full["models"][experiment["policy"]]["name_or_path"],
            train_files=tmp_path / "train.parquet",
            val_files=tmp_path / "test.parquet",
            loop=experiment["loop"],
            n_gpus_per_node=job.gpus_per_node,
            nnodes=job.nodes,
            experiment_dir=run_dir,
            extra=settings,
        )
    )
    resolved = OmegaConf.load(run_dir / vl.RESOLVED_CONFIG)
    assert (resolved.trainer.nnodes, resolved.trainer.n_gpus_per_node) == (4, 8)
    assert resolved.actor_rollout_ref.rollout.n == 16 and resolved.data.train_batch_size == 128
    assert vl.unreachable_steps(resolved, rows=resolved.data.train_batch_size) is None
    # A turn holds a 5,000-token chunk and the 1,024-token memory; a reply is at most 1,024 tokens.
    assert resolved.actor_rollout_ref.rollout.prompt_length == 5000 + 1024 + 1024
    assert resolved.actor_rollout_ref.rollout.response_length == 1024
    assert experiment["train"]["num_docs"] == 200 and experiment["eval"]["num_docs"][0] == 50
