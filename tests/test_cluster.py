"""profiles/slurm/resources.yaml: what each heavy job asks Slurm for, per rule and model."""

from pathlib import Path

import pytest
import yaml

from memupdate.cluster import Job, load_table, read_table
from memupdate.settings import ConfigError

REPO = Path(__file__).resolve().parents[1]
MODELS = ["qwen", "tiny"]


def test_a_multi_node_row_asks_for_one_task_per_node_and_gpus_by_gres():
    job = Job(nodes=4, gpus_per_node=8, cpus_per_task=64, mem_mb=512000, runtime=5760)
    assert job.snakemake() == {
        "cpus_per_task": 64,
        "mem_mb": 512000,
        "runtime": 5760,
        "gres": "gpu:8",
        "tasks_per_gpu": 0,
        "nodes": 4,
        "tasks": 4,
        "mpi": "srun",
    }


def test_a_one_node_row_runs_in_a_step_without_mpi():
    # The plugin refuses mpi with one task; the rule then runs in an srun step that holds the node's GPUs.
    assert Job(gpus_per_node=4).snakemake() == {"gres": "gpu:4", "tasks_per_gpu": 0}


def test_a_server_row_becomes_the_server_jobs_sbatch_options():
    assert Job(gpus_per_node=1, mem_mb=96000, runtime=5760, cpus_per_task=8).server() == {
        "time": 5760,
        "mem_mb": 96000,
        "cpus_per_task": 8,
        "gres": "gpu:1",
    }
    assert Job().server() == {}


def test_model_rows_fall_back_to_the_rules_default_row_then_to_nothing():
    table = load_table({"serve_model": {"default": {"mem_mb": 8000}, "qwen": {"gpus_per_node": 1}}}, "t.yaml", MODELS)
    assert table.job("serve_model", "qwen") == Job(gpus_per_node=1)
    assert table.job("serve_model", "tiny") == Job(mem_mb=8000)
    assert table.job("train_stage", "qwen") == Job()


def test_every_problem_is_reported_at_once_naming_the_file_and_key():
    data = {
        "train_stage1": {"qwen": {}},
        "train_stage": {"qwne": {"nodes": 2}, "qwen": {"nodes": 0, "gpus": 8}},
    }
    with pytest.raises(ConfigError) as err:
        load_table(data, "profiles/slurm/resources.yaml", MODELS)
    message = str(err.value)
    assert "profiles/slurm/resources.yaml: train_stage1: not a rule the table sizes" in message
    assert "train_stage.qwne: not a model of config/config.yaml" in message
    assert "train_stage.qwen.nodes" in message and "train_stage.qwen.gpus" in message


def test_the_repositorys_table_names_only_models_of_the_config():
    models = yaml.safe_load((REPO / "config/config.yaml").read_text())["models"]
    table = read_table(REPO / "profiles/slurm/resources.yaml", models)
    # MemAgent 7B trains across nodes as MemAgent did; every 7B job has GPUs.
    assert table.job("train_memagent", "qwen2.5-7b").snakemake()["nodes"] == 4
    for rule in ("train_stage", "train_memagent", "serve_model"):
        assert table.job(rule, "qwen2.5-7b").gpus_per_node >= 1, rule
    # The smoke models have no rows: their jobs ask for what their rules ask (CPUs).
    assert table.job("train_stage", "smollm2-135m") == Job()
