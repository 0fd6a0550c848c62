"""What the workflow asks of an experiment (memupdate.experiment): answered from its config section alone."""

from __future__ import annotations

import pytest
import yaml

from memupdate.experiment import Experiment

REWARD = {"scorer": "auto", "judge": "qa-base", "top_k": 5, "context_chars": 650, "qa_max_tokens": 32}


def experiment(**section):
    return Experiment("exp", {"policy": "p", "stage1": {}, **section}, REWARD, max_content_chars=300)


def test_auto_is_the_reader_with_a_qa_model_and_answer_recall_without():
    assert experiment(qa_model="q").scorer == "reader" and experiment(qa_model="q").plays_qa_phase
    assert experiment().scorer == "answer_recall" and not experiment().plays_qa_phase
    # An experiment's own reward keys go over the workflow's.
    offline = experiment(qa_model="q", reward={"scorer": "evidence_recall", "top_k": 7})
    assert (offline.scorer, offline.plays_qa_phase, offline.reward["top_k"]) == ("evidence_recall", False, 7)
    # The served judge is a marker among a stage's inputs, not a reward setting.
    assert offline.training_reward == {
        "scorer": "evidence_recall",
        "top_k": 7,
        "context_chars": 650,
        "qa_max_tokens": 32,
    }


def test_a_served_scorer_needs_a_qa_model_and_stays_out_of_the_policy_evaluation():
    with pytest.raises(ValueError, match="needs the served QA model as its reader"):
        _ = experiment(reward={"scorer": "judge"}).scorer
    judged = experiment(qa_model="q", reward={"scorer": "judge"})
    assert judged.served_judge == "qa-base" and experiment(qa_model="q").served_judge is None
    with pytest.raises(ValueError, match="scores with the training reward offline"):
        _ = judged.policy_eval_reward


def test_stages_the_cold_start_and_the_evaluations_defaults():
    e = experiment(sft={}, stage1={"trainer.device": "cpu", "trainer.n_gpus_per_node": 1, "lr": 1}, stage2={})
    assert [(s.name, s.role) for s in e.stages.values()] == [("stage1", "memory"), ("stage2", "qa")]
    assert e.stage(2).fixed == "stage1" and e.evaluated_policies == ["base", "sft", "stage1"]
    with pytest.raises(ValueError, match="has no stage3 in config/config.yaml \\(its stages: stage1, stage2\\)"):
        e.stage(3)
    assert e.sft_layout == {"trainer.device": "cpu", "trainer.n_gpus_per_node": 1}
    # The LoCoMo evaluation retrieves as training is rewarded, unless the experiment's eval says otherwise.
    assert e.eval_settings == {"context_chars": 650, "top_k": 5, "max_content_chars": 300}
    assert experiment(eval={"top_k": 10}).eval_settings["top_k"] == 10


def test_memagent_sections_are_a_memagent_experiments_only(repo_root):
    config = yaml.safe_load((repo_root / "config" / "config.yaml").read_text())
    e = Experiment("memagent_demo", config["experiments"]["memagent_demo"], config["reward"])
    assert e.is_memagent and e.stages == {} and "num_docs" not in e.memagent_train
    # Evaluation reads every chunk of a haystack: the loop's budgets but max_chunks.
    assert "max_chunks" not in e.memagent_eval and e.memagent_eval["chunk_size"] == e.section["loop"]["chunk_size"]
    with pytest.raises(ValueError, match="is not a MemAgent experiment"):
        _ = experiment().memagent
    # RULER-HotpotQA unless the experiment names LoCoMo's conversations.
    assert e.haystack == "hotpotqa"
    assert Experiment("l", config["experiments"]["memagent_locomo"], config["reward"]).haystack == "locomo"
