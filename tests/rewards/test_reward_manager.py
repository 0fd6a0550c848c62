"""The memupdate_memory reward manager with served scorers (reader, judge): configured through the same
settings as everything else, failing before any rollout when misconfigured, scoring stage 1 with the QA
phase's own answer against a cached initial answer, and closing its clients. The scoring tests ask a real
vLLM server of the tiny model."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from omegaconf import OmegaConf
from verl import DataProto

from memupdate.agents.fields import ANSWER_KEY, DELTA_KEY, ROLE_KEY
from memupdate.memory.environment import MemoryEnvironment
from memupdate.memory.store import TrialStore
from memupdate.rewards.manager import MemoryRewardManager
from memupdate.serving.readiness import ServerGone, write_marker
from memupdate.tools.config import TOOL_CONFIG
from memupdate.training import stages

QUESTION = "When did Caroline go to the LGBTQ support group?"
GOLD = "7 May 2023"
# The date the QA model needs, worded like the question, so it ranks first for it.
ANSWERING_MEMORY = "Caroline went to the LGBTQ support group on 7 May 2023."


def manager(settings, **paths):
    config = OmegaConf.create({"reward": {"custom_reward_function": {"reward_kwargs": {**paths, **settings}}}})
    return MemoryRewardManager(config, tokenizer=None)


def trajectory(info, delta, answer, stage="memory"):
    """One finished trajectory as verl's agent-loop worker hands it to a reward worker."""
    fields = {DELTA_KEY: delta, ANSWER_KEY: answer, ROLE_KEY: stage}
    return DataProto(
        batch=None,
        non_tensor_batch={
            "extra_info": np.array([info], dtype=object),
            "tool_extra_fields": np.array([fields], dtype=object),
        },
    )


@pytest.fixture(scope="module")
def target(locomo_rows):
    """conv-26's training row for QUESTION, as preprocess_locomo writes it."""
    rows = pq.read_table(locomo_rows["train"], columns=["extra_info"]).column("extra_info").to_pylist()
    (info,) = [r for r in rows if r["question"] == QUESTION]
    assert info["answer"] == GOLD
    return info


@pytest.fixture(scope="module")
def store_paths(memories_parquet, cache_dir, tmp_path_factory):
    """The reward's memory setting as a run gives it: the run's memory-environment file."""
    environment = MemoryEnvironment(memories=memories_parquet, embeddings=cache_dir)
    return {"memory_environment": str(environment.write(tmp_path_factory.mktemp("run")))}


@pytest.fixture(scope="module")
def unchanged_delta(base):
    """The delta of a trajectory that made no edit."""
    return TrialStore(base).export_delta()


@pytest.fixture(scope="module")
def answering_delta(base, embedder):
    trial = TrialStore(base, embedder)
    trial.create(ANSWERING_MEMORY, {"speaker": "Caroline"}, vector=embedder.encode([ANSWERING_MEMORY])[0])
    return trial.export_delta()


# ------------------------------------------------------------------ misconfiguration fails at start


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        (
            {"scorer": "bleu"},
            ValueError,
            "unknown reward scorer 'bleu'; known: answer_recall, evidence_recall, reader, judge",
        ),
        (
            {"scorer": "reader"},
            ValueError,
            "needs the setting reader_marker: the readiness marker of the served reader",
        ),
        (
            {"scorer": "reader", "reader_marker": "/nowhere/qa-base.ready.json"},
            FileNotFoundError,
            "no readiness marker at /nowhere/qa-base.ready.json: run the serve rule",
        ),
        ({"scorer": "reader", "trained_role": "both"}, ValueError, "trained_role must be one of"),
    ],
    ids=["unknown-scorer", "reader-without-marker", "missing-marker", "unknown-stage"],
)
def test_a_misconfigured_scorer_fails_when_the_manager_starts(settings, error, message):
    with pytest.raises(error, match=re.escape(message)):
        manager(settings)


def test_a_manager_without_the_runs_memory_environment_fails_when_it_starts(tmp_path):
    with pytest.raises(ValueError, match="needs reward_kwargs.memory_environment"):
        manager({"scorer": "answer_recall"})
    with pytest.raises(ValueError, match="no memory environment here"):
        manager({"scorer": "answer_recall"}, memory_environment=str(tmp_path / "memory_environment.json"))


def test_a_dead_reader_fails_when_the_manager_starts(tmp_path):
    marker = tmp_path / "qa-base.ready.json"
    # Port 9 (discard) on loopback: nothing serves it.
    write_marker(marker, endpoint="http://127.0.0.1:9/v1", served_model_name="exp-qa-base", pid=123)
    with pytest.raises(ServerGone, match="rerun the serve rule"):
        manager({"scorer": "reader", "reader_marker": str(marker)})
    # The judge needs its own marker besides the reader's.
    with pytest.raises(ValueError, match="scorer 'judge' needs the setting reader_marker"):
        manager({"scorer": "judge", "judge_marker": str(marker)})


def test_stage2_is_rewarded_by_its_answer_without_a_served_scorer(target, store_paths):
    # Stage 2 serves no QA model to read with: no marker needed, the QA role earns its answer's F1.
    qa = manager({"scorer": "reader", "trained_role": "qa"}, **store_paths)
    assert qa.scorer is None
    out = asyncio.run(qa.run_single(trajectory(target, {}, GOLD, stage="qa")))
    assert out == {"reward_score": 1.0, "reward_extra_info": {"answer_score": 1.0, "score": 1.0}}
    with pytest.raises(ValueError, match="trains the memory role"):
        asyncio.run(qa.run_single(trajectory(target, {}, GOLD, stage="memory")))


@pytest.mark.parametrize("scorer", ["answer_recall", "evidence_recall"])
def test_a_batch_is_scored_as_its_trajectories_are_one_by_one(
    scorer, target, store_paths, unchanged_delta, answering_delta
):
    """score_batch (the cold start's second scorer) builds each trajectory's request as run_single does."""
    scored = manager({"scorer": scorer}, **store_paths)
    deltas = [unchanged_delta, answering_delta]
    batch = DataProto(
        batch=None,
        non_tensor_batch={
            DELTA_KEY: np.array(deltas, dtype=object),
            ROLE_KEY: np.array(["memory", "memory"], dtype=object),
        },
    )

    async def both():
        one_by_one = [await scored.run_single(trajectory(target, delta, None)) for delta in deltas]
        return one_by_one, await scored.score_batch([target, target], batch)

    one_by_one, batched = asyncio.run(both())
    for out, result in zip(one_by_one, batched, strict=True):
        assert result == {key: out["reward_extra_info"][key] for key in result}
    assert batched[0]["score"] == 0.0  # no edit
    assert batched[1]["memories_final"] == batched[1]["memories_initial"] + 1  # its delta was applied


# ------------------------------------------------------------------ the settings' way to the manager


def test_stage_settings_carry_the_role_and_the_answer_cap_and_are_checked_before_training():
    reward = {"scorer": "answer_recall", "qa_prompt": "mem0"}
    out = stages.stage_reward(reward, "memory", None, settings={"trainer.total_training_steps": 1})
    assert out == {**reward, "trained_role": "memory", "qa_max_tokens": 32}
    with pytest.raises(ValueError, match=r"qa_max_tokens is the reward's \(reward.qa_max_tokens"):
        stages.stage_reward(reward, "memory", None, settings={"qa_max_tokens": 8})
    # The workflow resolves auto and drops the judge's serve name; a raw section fails here, not in a worker.
    with pytest.raises(ValueError, match=r"unknown reward settings \['judge'\]"):
        stages.stage_reward({"scorer": "judge", "judge": "qa-base"}, "memory", None, settings={})
    with pytest.raises(ValueError, match="unknown reward scorer 'auto'"):
        stages.stage_reward({"scorer": "auto"}, "memory", None, settings={})


def test_reward_settings_reach_the_qa_phase_in_process(tmp_path, tiny_models):
    from memupdate.agents.memory_loop import qa_settings
    from memupdate.rollout.config import RolloutConfig, loop_arguments, run_config

    reward = stages.stage_reward(
        {"scorer": "answer_recall", "qa_prompt": "mem0", "qa_max_tokens": 12, "top_k": 3, "context_chars": 200},
        "memory",
        None,
        settings={},
    )
    cfg = RolloutConfig(
        model_path=str(tiny_models / "policy"),
        train_files=[],
        run_dir=str(tmp_path / "run"),
        tool_config=str(TOOL_CONFIG),
        memory=MemoryEnvironment(memories="m", embeddings="e"),
        reward=reward,
    )
    config = run_config(cfg)
    # The QA phase gets the retrieval and prompt the reward manager reads, and the answer cap the reader uses.
    assert qa_settings(loop_arguments(cfg)["qa"]) == {"top_k": 3, "context_chars": 200, "qa_prompt": "mem0"}
    assert qa_settings(config.reward.custom_reward_function.reward_kwargs) == qa_settings(loop_arguments(cfg)["qa"])
    assert (
        config.reward.custom_reward_function.reward_kwargs.qa_max_tokens == loop_arguments(cfg)["qa_max_tokens"] == 12
    )


def test_reward_settings_reach_the_verl_reward_workers(tmp_path, repo_root, monkeypatch):
    from memupdate.training import verl_launcher as vl

    monkeypatch.chdir(tmp_path)
    reward = {
        "scorer": "reader",
        "reader_marker": "serve/qa-base.ready.json",
        "qa_prompt": "locomo",
        "qa_max_tokens": 16,
        "trained_role": "memory",
        "reader_metric": None,
    }
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    run = {
        "model_path": model,
        "train_files": tmp_path / "train.parquet",
        "val_files": tmp_path / "val.parquet",
        "tool_config": TOOL_CONFIG,
        "memory": MemoryEnvironment(memories=tmp_path / "memories.parquet", embeddings=tmp_path / "embeddings"),
        "n_gpus_per_node": 8,
        "nnodes": 2,
        "experiment_dir": tmp_path / "run",
        "reward": reward,
    }
    vl.prepare_main_ppo(
        "memory", vl.MainPPORun(fixed_model_endpoint={"base_url": "http://n1:8000/v1", "model": "qa"}, **run)
    )
    resolved = OmegaConf.load(tmp_path / "run" / "resolved_config.yaml")
    kwargs = OmegaConf.to_container(resolved.reward.custom_reward_function.reward_kwargs)
    # Reward workers on other nodes read the marker: its path is absolute.
    assert {key: kwargs[key] for key in reward} == {
        **reward,
        "reader_marker": str(tmp_path / "serve/qa-base.ready.json"),
    }
    (entry,) = OmegaConf.load(tmp_path / "run" / "agent_loops.yaml")
    assert entry.qa_max_tokens == 16


# ------------------------------------------------------------------ the workflow


WORKFLOW_PARTS = ["Snakefile", "rules", "workflow", "config", "profiles"]


def dry_run(workdir, target, config=None):
    args = [str(Path(sys.executable).parent / "snakemake"), "-n", target, "--cores", "1"]
    if config is not None:
        (workdir / "override.yaml").write_text(yaml.safe_dump(config))
        args += ["--configfile", "override.yaml"]
    return subprocess.run(args, cwd=workdir, capture_output=True, text=True, timeout=300)


def train_inputs(output: str, rule: str) -> list[str]:
    block = output.split(f"rule {rule}:", 1)[1]
    return block.split("input: ", 1)[1].split("\n", 1)[0].split(", ")


@pytest.fixture(scope="module")
def workdir(repo_root, tmp_path_factory):
    repo = tmp_path_factory.mktemp("workflow")
    for part in WORKFLOW_PARTS:
        src = repo_root / part
        (shutil.copytree if src.is_dir() else shutil.copy)(src, repo / part)
    return repo


def test_stage1_takes_the_reader_and_judge_markers_as_inputs(workdir):
    marker = "results/smoke/serve/train/{}.ready.json"
    # Default: reader for the two-stage smoke experiment; its reader is the served qa-base.
    result = dry_run(workdir, "results/smoke/stage1/ckpt")
    assert result.returncode == 0, result.stderr
    assert marker.format("qa-base") in train_inputs(result.stdout, "train_stage1")
    result = dry_run(workdir, "results/smoke/stage1/ckpt", {"reward": {"scorer": "judge", "judge": "base"}})
    assert result.returncode == 0, result.stderr
    assert {marker.format("qa-base"), marker.format("base")} <= set(train_inputs(result.stdout, "train_stage1"))
    # The offline scorer reads no QA phase, so stage 1 plays none and nothing is served for it.
    result = dry_run(workdir, "results/smoke/stage1/ckpt", {"reward": {"scorer": "answer_recall"}})
    assert result.returncode == 0, result.stderr
    assert not [i for i in train_inputs(result.stdout, "train_stage1") if i.endswith(".ready.json")]


def test_a_served_scorer_without_a_qa_model_fails_before_anything_runs(workdir):
    single = {
        "policy": "tiny-random",
        # Within the smoke servers' context (settings.check_lengths), unlike the GPU runs' default episode.
        "episode": {"prompt_length": 2048, "response_length": 512},
        "stage1": {"trainer.total_training_steps": 1},
    }
    result = dry_run(
        workdir, "results/single/stage1/ckpt", {"reward": {"scorer": "reader"}, "experiments": {"single": single}}
    )
    assert result.returncode != 0
    assert (
        "reward.scorer 'reader' needs the served QA model as its reader, but experiment 'single' has no qa_model"
        in (result.stdout + result.stderr)
    )
    # auto picks the offline scorer for a single-stage experiment.
    result = dry_run(workdir, "results/single/stage1/ckpt", {"experiments": {"single": single}})
    assert result.returncode == 0, result.stderr
    assert not [i for i in train_inputs(result.stdout, "train_stage1") if i.endswith(".ready.json")]


# ------------------------------------------------------------------ scoring against a served model


@pytest.fixture(scope="module")
def served_marker(vllm_server, tiny_model_dir, tmp_path_factory):
    """The session's tiny vLLM server (tests/conftest.py) and its readiness marker, as the serve rule writes it."""
    marker = tmp_path_factory.mktemp("served") / "qa-base.ready.json"
    write_marker(
        marker,
        endpoint=vllm_server.base_url,
        served_model_name=vllm_server.served_model_name,
        pid=vllm_server.pid,
        model_path=tiny_model_dir,
        api_key=vllm_server.api_key,
    )
    return marker


def served_requests(marker) -> float:
    """Requests the server finished, from its Prometheus metrics."""
    from memupdate.serving.readiness import load_marker

    root = load_marker(marker)["endpoint"].removesuffix("/v1")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    text = opener.open(f"{root}/metrics", timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total")
    )


@pytest.mark.vllm
def test_reader_scores_the_qa_phase_answer_against_a_cached_initial_answer(
    served_marker, target, store_paths, unchanged_delta, answering_delta
):
    reader = manager({"scorer": "reader", "reader_marker": str(served_marker), "trained_role": "memory"}, **store_paths)
    assert reader.scorer.name == "reader" and reader.scorer.metric == "locomo_f1"

    async def rollouts():
        start = served_requests(served_marker)
        # A GRPO group: four rollouts of one prompt scored at once. Two changed nothing (their QA phase
        # answered from the initial store; what it said must not matter), two wrote the answering memory
        # and their QA phase answered from it.
        group = [
            (unchanged_delta, "anything"),
            (unchanged_delta, GOLD),
            (answering_delta, GOLD),
            (answering_delta, "no idea"),
        ]
        results = await asyncio.gather(*(reader.run_single(trajectory(target, d, a)) for d, a in group))
        asked = served_requests(served_marker) - start
        again = await reader.run_single(trajectory(target, answering_delta, GOLD))
        return results, asked, served_requests(served_marker) - start, again

    results, asked, asked_after, again = asyncio.run(rollouts())
    infos = [r["reward_extra_info"] for r in results]
    # One request in all: the initial store's answer, shared by the group and cached for later rollouts.
    # The final store's answer to the target is the QA phase's, never asked again.
    assert asked == 1 and asked_after == 1
    initial = infos[0]["target_initial"]
    assert all(i["target_initial"] == initial for i in infos)
    # Unchanged retrieval: exactly 0, whatever the QA phase said.
    assert results[0]["reward_score"] == results[1]["reward_score"] == 0.0
    assert infos[0]["target_final"] == infos[1]["target_final"] == initial
    # Changed retrieval: the QA phase's answer is scored (locomo_f1 of the locomo protocol).
    assert infos[2]["target_final"] == 1.0 and infos[3]["target_final"] == 0.0
    assert results[2]["reward_score"] == pytest.approx((1.0 - initial) * infos[2]["efficiency"])
    assert again["reward_score"] == results[2]["reward_score"]
    # asyncio.run's end closed the sessions; the next loop reopens them.
    assert all(client._session is None for client in reader._clients.values())


@pytest.mark.vllm
def test_judge_judges_the_qa_phase_answer_and_clients_close(served_marker, target, store_paths, answering_delta):
    marker = str(served_marker)
    judged = manager({"scorer": "judge", "reader_marker": marker, "judge_marker": marker}, **store_paths)

    async def one():
        start = served_requests(served_marker)
        out = await judged.run_single(trajectory(target, answering_delta, GOLD))
        asked = served_requests(served_marker) - start
        await judged.close()
        return out, asked, [client._session for client in judged._clients.values()]

    out, asked, sessions = asyncio.run(one())
    # The reader's initial answer, then the judge on it and on the QA phase's answer: three requests.
    assert asked == 3 and judged.scorer.judged == 2
    assert out["reward_extra_info"]["target_final"] in (0.0, 1.0)
    assert sessions == [None, None]


@pytest.mark.vllm
def test_the_reader_is_the_fixed_qa_model_it_stands_in_for(served_marker, tiny_model_dir):
    """One carrier for the QA endpoint: a memory stage's reader is read from its fixed QA model's marker."""
    fixed = stages.fixed_model_endpoint(served_marker, tiny_model_dir)
    for scorer in ("reader", "judge"):
        reward = {"scorer": scorer, **({"judge_marker": str(served_marker)} if scorer == "judge" else {})}
        assert stages.stage_reward(reward, "memory", fixed, settings={})["reader_marker"] == str(served_marker)
    with pytest.raises(ValueError, match="not a reader_marker of its own"):
        stages.stage_reward({"scorer": "reader", "reader_marker": str(served_marker)}, "memory", fixed, settings={})
    with pytest.raises(ValueError, match="needs a served fixed QA model"):
        stages.stage_reward({"scorer": "reader"}, "memory", None, settings={})
    # A QA stage is rewarded by its own answer: no reader.
    assert "reader_marker" not in stages.stage_reward({"scorer": "reader"}, "qa", fixed, settings={})
