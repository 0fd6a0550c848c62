import asyncio

import numpy as np
import pytest

from memupdate.memory.store import TrialStore
from memupdate.rewards.efficiency import EfficiencyConfig, efficiency_factor
from memupdate.rewards.memory import (
    MemoryRewardComputer,
    MemoryRewardConfig,
    RewardRequest,
    memory_reward,
    select_questions,
)
from memupdate.rewards.scorers import AnswerRecallScorer, EvidenceRecallScorer, QAItem

TARGET = QAItem("When did Caroline go to the LGBTQ support group?", "7 May 2023", 2, ("D1:3",))
# Tie the reward to what retrieval returns, not to the efficiency factor.
NEUTRAL = MemoryRewardConfig(top_k=5, efficiency=EfficiencyConfig(max_total_memories=None))


def reward(initial, final, items, embedder, scorer, config=NEUTRAL):
    vectors = embedder.encode([i.question for i in items])
    return asyncio.run(memory_reward(initial, final, items, vectors, scorer, config))


def improved_trial(base, embedder):
    trial = TrialStore(base, embedder)
    text = "Caroline went to the LGBTQ support group on 7 May 2023."
    trial.create(text, {"speaker": "Caroline", "evidence": ["D1:3"]}, vector=embedder.encode([text])[0])
    return trial


@pytest.mark.parametrize("scorer", [AnswerRecallScorer(), EvidenceRecallScorer()], ids=lambda s: s.name)
def test_unchanged_store_scores_exactly_zero(base, embedder, scorer):
    out = reward(TrialStore(base), TrialStore(base), [TARGET], embedder, scorer)
    assert out["score"] == 0.0 and out["qa_delta"] == 0.0 and out["efficiency"] == 1.0


def test_a_memory_that_answers_the_question_earns_a_positive_reward(base, embedder):
    out = reward(TrialStore(base), improved_trial(base, embedder), [TARGET], embedder, AnswerRecallScorer())
    # Before: the observations say "recently", never the date; after: the new memory ranks first.
    assert out["qa_initial"] < 0.5 and out["qa_final"] == 1.0
    assert out["score"] > 0.5 and out["memories_final"] == out["memories_initial"] + 1
    assert out["ops_created"] == 1.0 and out["ops_deleted"] == 0.0


def test_deleting_the_evidence_earns_a_negative_reward(base, embedder):
    final = TrialStore(base, embedder)
    before = reward(TrialStore(base), final, [TARGET], embedder, EvidenceRecallScorer())
    final.delete(0)  # [0] is the D1:3 observation: the only memory citing the gold evidence
    after = reward(TrialStore(base), final, [TARGET], embedder, EvidenceRecallScorer())
    assert before["score"] == 0.0 and after["qa_initial"] == 1.0 and after["qa_final"] == 0.0
    assert after["score"] < 0


def test_initial_and_final_must_be_different_objects(base, embedder):
    store = TrialStore(base)
    with pytest.raises(ValueError, match="different stores"):
        reward(store, store, [TARGET], embedder, AnswerRecallScorer())


def test_efficiency_factor_components():
    assert efficiency_factor(184, 18400, 184, 18400, EfficiencyConfig(max_total_memories=None))["efficiency"] == 1.0
    # Upstream's limit of 100 shrinks every LoCoMo reward before the agent does anything.
    assert efficiency_factor(184, 18400, 184, 18400)["size_factor"] == pytest.approx(0.16)
    shorter = efficiency_factor(100, 10000, 100, 5000, EfficiencyConfig(max_total_memories=None))
    assert shorter["density_factor"] == 0.5 and shorter["efficiency"] == 0.5
    grown = efficiency_factor(10, 1000, 30, 3000, EfficiencyConfig(max_total_memories=None))
    assert grown["change_factor"] == 0.8 and grown["size_factor"] == pytest.approx(0.1)
    assert grown["efficiency"] == 0.1  # clamped at min_factor


def test_other_questions_join_the_target_reproducibly(base, embedder, locomo_conversations):
    pool = [QAItem(q.question, q.answer, q.category, q.evidence) for q in locomo_conversations["conv-26"].qa if q.answer]
    items = select_questions(TARGET, pool, 4, "conv-26-qa0-ff702917")
    assert items[0] == TARGET and len(items) == 5 and TARGET not in items[1:]
    assert items == select_questions(TARGET, pool, 4, "conv-26-qa0-ff702917")
    assert items != select_questions(TARGET, pool, 4, "conv-26-qa1-00000000")
    out = reward(TrialStore(base), improved_trial(base, embedder), items, embedder, AnswerRecallScorer())
    assert out["n_questions"] == 5 and out["target_final"] == 1.0


def test_batch_computer_matches_one_by_one(base, embedder):
    trials = [TrialStore(base, embedder), improved_trial(base, embedder), TrialStore(base, embedder)]
    trials[2].delete(0)
    requests = [RewardRequest("conv-26", t.export_delta(), [TARGET]) for t in trials]
    computer = MemoryRewardComputer(lambda sample_id: base, embedder, AnswerRecallScorer(), NEUTRAL)
    batch = asyncio.run(computer.compute(requests))
    single = [reward(TrialStore(base), t, [TARGET], embedder, AnswerRecallScorer()) for t in trials]
    for got, want in zip(batch, single, strict=True):
        assert got == pytest.approx(want)
    assert batch[0]["score"] == 0.0 and batch[1]["score"] > 0
    # The question's vector is cached: a second batch embeds only the new memory texts.
    calls = []
    original = embedder.aencode

    async def counting(texts, batch_size=None):
        calls.append(list(texts))
        return await original(texts, batch_size)

    computer.embedder = type("Spy", (), {"aencode": staticmethod(counting), "dim": embedder.dim})()
    asyncio.run(computer.compute(requests))
    assert calls == [["Caroline went to the LGBTQ support group on 7 May 2023."]]


def test_config_from_dict():
    config = MemoryRewardConfig.from_dict({"top_k": 3, "other_questions": 2, "efficiency": {"max_total_memories": None}})
    assert config.top_k == 3 and config.efficiency.max_total_memories is None
    with pytest.raises(TypeError):
        MemoryRewardConfig.from_dict({"topk": 3})
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        MemoryRewardConfig(top_k=0)


def test_query_vectors_must_match_items(base):
    with pytest.raises(ValueError, match="one query vector per question"):
        asyncio.run(memory_reward(TrialStore(base), TrialStore(base), [TARGET], np.zeros((2, 384)), AnswerRecallScorer()))
