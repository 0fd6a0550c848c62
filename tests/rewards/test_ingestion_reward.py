"""The ingestion reward (a session's episode, question-agnostic) on conv-26's 19 sessions: what an episode
that edits nothing earns under each baseline, and that no edit made without the questions pays."""

import asyncio

import numpy as np
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf
from verl import DataProto

from memupdate.agents.fields import DELTA_KEY, ROLE_KEY
from memupdate.data.ingestion import build_ingestion_rows, reward_questions
from memupdate.memory.environment import MemoryEnvironment
from memupdate.memory.store import TrialStore
from memupdate.rewards.efficiency import EfficiencyConfig
from memupdate.rewards.manager import MemoryRewardManager
from memupdate.rewards.memory import MemoryRewardConfig, baseline_sessions, memory_reward
from memupdate.rewards.scorers import AnswerRecallScorer, EvidenceRecallScorer, QAItem

CONFIG = MemoryRewardConfig(efficiency=EfficiencyConfig(max_total_memories=None))
SCORERS = [AnswerRecallScorer(), EvidenceRecallScorer()]
# As training rows choose them: those with evidence in the new session first.
QUESTIONS = None


@pytest.fixture(scope="module")
def sessions(base, embedder, locomo_conversations):
    """Per session of conv-26: its reward questions (all seen so far), their vectors, its new memories."""
    questions = [
        {
            "qa_index": q.qa_index,
            "question": q.question,
            "answer": q.answer,
            "category": q.category,
            "evidence": list(q.evidence),
        }
        for q in locomo_conversations["conv-26"].qa
    ]
    out = {}
    for session in sorted({r.session for r in base.records}):
        chosen = reward_questions(questions, session, QUESTIONS, f"s{session}")
        if not chosen:
            continue
        items = [QAItem(q["question"], q["answer"], q["category"], tuple(q["evidence"])) for q in chosen]
        new = [r for r in base.records if r.session == session]
        out[session] = (items, embedder.encode([i.question for i in items]), new)
    return out


def score(base, session, final, items, vectors, scorer, baseline):
    initial = TrialStore(base, sessions=baseline_sessions(session, baseline))
    return asyncio.run(memory_reward(initial, final, items, vectors, scorer, CONFIG))


@pytest.mark.parametrize("scorer", SCORERS, ids=lambda s: s.name)
def test_editing_nothing_earns_exactly_zero_against_append_and_the_sessions_worth_against_before(
    base, sessions, scorer
):
    gains = []
    for session, (items, vectors, _) in sessions.items():
        noop = TrialStore(base, sessions=session)
        assert score(base, session, noop, items, vectors, scorer, "append")["score"] == 0.0
        gains.append(score(base, session, noop, items, vectors, scorer, "before")["score"])
    # Against the store before the session, its memories (the facts its new questions need) are the gain,
    # though not always: they can also crowd older questions' evidence out of the retrieval budget.
    assert len(gains) == 19 and sum(gains) > 0 and sum(g > 0 for g in gains) > len(gains) // 2


def duplicate_new(trial, new, vec):
    for record in new:
        trial.create(record.content, vector=vec(record.content))


def delete_older(trial, new, vec):
    for record in trial.records():
        if record.session != new[0].session:
            trial.delete(record.id)


def delete_new(trial, new, vec):
    for record in new:
        trial.delete(record.id)


def filler(trial, new, vec):
    for i in range(5):
        text = f"Nothing new was said in this part of the conversation ({i})."
        trial.create(text, vector=vec(text))


EXPLOITS = {
    "every new memory written again": duplicate_new,
    "every older memory deleted": delete_older,
    "filler memories": filler,
    "the new memories deleted": delete_new,
}
#: The most a blind edit may earn on one session. Deleting a session's new memories pays on one session of
#: conv-26's 19 (+0.011 under answer_recall, +0.003 under evidence_recall) where they crowded older
#: questions' evidence out of the fixed budget: there, removing them does help the questions seen so far.
#: Over the sessions it loses, and a policy that never sees the questions cannot
#: tell those sessions apart by them.
TOLERANCE = {"the new memories deleted": 0.015}


@pytest.mark.parametrize("scorer", SCORERS, ids=lambda s: s.name)
@pytest.mark.parametrize("exploit", list(EXPLOITS))
def test_no_blind_edit_pays_on_the_questions_seen(base, embedder, sessions, exploit, scorer):
    """Edits made without the questions, against the append baseline on every question seen so far: none
    pays over a conversation, and none pays on a session beyond its tolerance."""
    texts = sorted({r.content for _, _, new in sessions.values() for r in new})
    texts += [f"Nothing new was said in this part of the conversation ({i})." for i in range(5)]
    vectors = dict(zip(texts, embedder.encode(texts), strict=True))
    rewards = {}
    for session, (items, qvectors, new) in sessions.items():
        trial = TrialStore(base, sessions=session)
        EXPLOITS[exploit](trial, new, vectors.__getitem__)
        rewards[session] = score(base, session, trial, items, qvectors, scorer, "append")["score"]
    assert sum(rewards.values()) <= 0, f"{exploit} earns {sum(rewards.values()) / len(rewards):+.3f} per session"
    paid = {s: round(r, 3) for s, r in rewards.items() if r > TOLERANCE.get(exploit, 0.0)}
    assert not paid, f"{exploit} paid on sessions {paid}"


def test_a_memory_that_states_a_seen_answer_pays(base, embedder, sessions):
    """The reward is earnable by doing the task: a memory that states what a seen question needs."""
    session, (items, qvectors, _) = next((s, v) for s, v in sessions.items() if s >= 2)
    item = next(i for i, v in zip(items, qvectors, strict=True) if i.category == 2)
    i = items.index(item)
    trial = TrialStore(base, sessions=session)
    text = f"{item.question.rstrip('?')}: {item.answer}."
    trial.create(text, vector=embedder.encode([text])[0])
    out = score(base, session, trial, [item], qvectors[i : i + 1], AnswerRecallScorer(), "append")
    assert out["score"] > 0 and np.isfinite(out["score"])


# ----------------------------------------------------------------------------------- the reward manager


@pytest.fixture(scope="module")
def ingestion_rows(locomo_rows, tmp_path_factory):
    out = tmp_path_factory.mktemp("ingest") / "train.parquet"
    build_ingestion_rows(str(locomo_rows["train"]), str(locomo_rows["memories"]), str(out), split="train")
    return {r["extra_info"]["session"]: r["extra_info"] for r in pq.read_table(out).to_pylist()}


def reward_manager(memories_parquet, cache_dir, tmp_path, **settings):
    environment = MemoryEnvironment(memories=memories_parquet, embeddings=cache_dir).write(tmp_path)
    kwargs = {"memory_environment": str(environment), "scorer": "answer_recall", **settings}
    config = OmegaConf.create({"reward": {"custom_reward_function": {"reward_kwargs": kwargs}}})
    return MemoryRewardManager(config, tokenizer=None)


def trajectory(info, delta):
    return DataProto(
        batch=None,
        non_tensor_batch={
            "extra_info": np.array([info], dtype=object),
            "tool_extra_fields": np.array([{DELTA_KEY: delta, ROLE_KEY: "memory"}], dtype=object),
        },
    )


def test_the_manager_scores_a_session_on_its_rows_questions_against_the_baseline(
    ingestion_rows, base, embedder, memories_parquet, cache_dir, tmp_path
):
    session = 4
    info = ingestion_rows[session]
    manager = reward_manager(memories_parquet, cache_dir, tmp_path)
    noop = TrialStore(base, sessions=session).export_delta()
    out = asyncio.run(manager.run_single(trajectory(info, noop)))
    assert out["reward_score"] == 0.0 and out["reward_extra_info"]["n_questions"] == len(info["questions"])
    # Against the store before the session, the same episode earns what the session's memories add.
    before = reward_manager(memories_parquet, cache_dir, tmp_path, ingestion_baseline="before")
    gain = asyncio.run(before.run_single(trajectory(info, noop)))["reward_extra_info"]
    items = [QAItem(q["question"], q["answer"], q["category"], tuple(q["evidence"])) for q in info["questions"]]
    vectors = embedder.encode([i.question for i in items])
    expected = score(base, session, TrialStore(base, sessions=session), items, vectors, AnswerRecallScorer(), "before")
    assert gain["qa_delta"] == pytest.approx(expected["qa_delta"])
    # A memory stating a seen question's answer pays (a date: the observations rarely state one).
    item = next(i for i in items if i.category == 2)
    trial = TrialStore(base, embedder, sessions=session)
    text = f"{item.question.rstrip('?')}: {item.answer}."
    trial.create(text, vector=embedder.encode([text])[0])
    assert asyncio.run(manager.run_single(trajectory(info, trial.export_delta())))["reward_score"] > 0
    # A store that saw other sessions than the row's is a plumbing error, not a reward.
    with pytest.raises(ValueError, match="saw sessions up to 5"):
        asyncio.run(manager.run_single(trajectory(info, TrialStore(base, sessions=5).export_delta())))
