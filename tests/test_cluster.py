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


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("train_stage:\n\tqwen: {gpus: 8}\n", r"r.yaml, line 2, column 1: not valid YAML: found character '\\t'"),
        (
            "train_stage:\n  qwen: {gpus: 8}\n  qwen: {gpus: 4}\n",
            "r.yaml, line 3: key 'qwen' appears twice in one mapping",
        ),
    ],
)
def test_a_table_that_is_not_clean_yaml_is_refused_naming_file_and_line(tmp_path, text, message):
    (tmp_path / "r.yaml").write_text(text)
    with pytest.raises(ConfigError, match=message):
        read_table(tmp_path / "r.yaml", MODELS)


def test_the_repositorys_table_names_only_models_of_the_config():
    models = yaml.safe_load((REPO / "config/config.yaml").read_text())["models"]
    table = read_table(REPO / "profiles/slurm/resources.yaml", models)
    # MemAgent 7B trains across nodes as MemAgent did; every 7B job has GPUs.
    assert table.job("train_memagent", "qwen2.5-7b").snakemake()["nodes"] == 4
    for rule in ("train_stage", "train_memagent", "serve_model"):
        assert table.job(rule, "qwen2.5-7b").gpus_per_node >= 1, rule
    # The smoke models have no rows: their jobs ask for what their rules ask (CPUs).
    assert table.job("train_stage", "smollm2-135m") == Job()


def test_a_row_gives_an_expected_time_per_step_or_per_system_and_the_limit_is_derived():
    table = load_table(
        {
            "plan": {"margin": 2, "max_runtime": 600},
            "train_stage": {"qwen": {"gpus_per_node": 8, "minutes": 30, "per_step": 5, "source": "README"}},
            "eval_locomo": {"qwen": {"minutes": 10, "per_system": 60}},
        },
        "t.yaml",
        MODELS,
    )
    assert table.limits.margin == 2 and table.limits.max_runtime == 600 and table.limits.queue_margin == 30
    row = table.job("train_stage", "qwen")
    assert row.planned and row.gpus == 8 and row.expected(300) == 1530 and row.expected(None) is None
    assert table.job("eval_locomo", "qwen").expected(4) == 250
    # No runtime is written into the request: rules/common.smk sets the derived one.
    assert "runtime" not in row.snakemake()
    assert not Job(runtime=30).planned and Job(runtime=30).expected() is None


def test_a_row_has_an_expected_time_or_an_explicit_limit_and_the_rules_unit():
    data = {
        "train_stage": {"qwen": {"minutes": 30, "runtime": 60}},
        "eval_locomo": {"qwen": {"per_step": 5}},
        "prepare_model": {"qwen": {"per_system": 5}},
        "plan": {"margin": 0.5, "spare": 1},
    }
    with pytest.raises(ConfigError) as err:
        load_table(data, "resources.yaml", MODELS)
    message = str(err.value)
    assert "train_stage.qwen: runtime is derived from the expected time" in message
    assert "eval_locomo.qwen.per_step: eval_locomo counts systems" in message
    assert "prepare_model.qwen.per_system: prepare_model counts no units" in message
    assert "plan.margin" in message and "plan.spare" in message


def test_every_gpu_job_and_evaluation_of_the_full_scale_has_an_expected_time_with_its_source():
    models = yaml.safe_load((REPO / "config/config.yaml").read_text())["models"]
    table = read_table(REPO / "profiles/slurm/resources.yaml", models)
    for rule in ("train_stage", "train_sft", "eval_locomo", "eval_memagent"):
        for model in ("qwen2.5-3b", "qwen2.5-7b"):
            row = table.job(rule, model)
            assert row.planned and row.source and row.runtime is None, (rule, model)
    for rule in ("train_memagent", "train_memagent_sft"):
        assert table.job(rule, "qwen2.5-7b").planned, rule
    # Servers take their consumers' time; the smoke models keep their rules' own limits.
    assert not table.job("serve_model", "qwen2.5-7b").planned
    assert table.job("eval_locomo", "smollm2-135m") == Job()
