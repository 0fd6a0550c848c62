"""The cold-start expert's program on conv-26, played against the real store and scored by the real reward: it
promotes the evidence the reader's context lacks where the question's search reaches it, stops everywhere else,
and the edits it demonstrates pay under evidence_recall (the training reward of cpu_demo)."""

from __future__ import annotations

import asyncio
import logging
import statistics

import pyarrow.parquet as pq
import pytest

from memupdate.data.headroom import question_headroom
from memupdate.memory.store import TrialStore
from memupdate.names import MANAGE_TOOL, SEARCH_TOOL
from memupdate.prompts import format_record
from memupdate.rewards.efficiency import EfficiencyConfig
from memupdate.rewards.memory import MemoryRewardConfig, memory_reward
from memupdate.rewards.scorers import AnswerRecallScorer, EvidenceRecallScorer, QAItem
from memupdate.settings import DEFAULT_MAX_CONTENT_CHARS, RewardSettings
from memupdate.training.demonstrations import DONE, MemoryExpert, expert_rows, keep_episode
from memupdate.training.sft import gain

logger = logging.getLogger(__name__)

SEARCH_TOP_K = 20
TOP_K, BUDGET = RewardSettings.top_k, RewardSettings.context_chars


#: The idle-edit cost of cpu_demo's third and fourth attempts (and of test_cpu_demo's overlay): an edit that gains
#: nothing costs 0.05 (reward.idle_edit_cost).
COSTLY = MemoryRewardConfig(efficiency=EfficiencyConfig(max_total_memories=None), idle_edit_cost=0.05)


@pytest.fixture(scope="module")
def played(locomo_rows, base, embedder):
    """Every conv-26 train row played by the expert against the real store: per row, its headroom, the expert's
    replies, and the reward of its final store under both offline scorers."""
    table = pq.read_table(locomo_rows["train"]).to_pylist()
    expert = MemoryExpert(
        None,
        expert_rows(table),
        str(locomo_rows["memories"]),
        DEFAULT_MAX_CONTENT_CHARS,
        512,
        SEARCH_TOP_K,
        top_k=TOP_K,
        context_chars=BUDGET,
    )
    infos = [row["extra_info"] for row in table]
    vectors = embedder.encode([i["question"] for i in infos])
    # The workflow's reward settings (config/config.yaml): no cap on the store's size.
    config = MemoryRewardConfig(efficiency=EfficiencyConfig(max_total_memories=None))
    out = []
    for n, (row, info, vector) in enumerate(zip(table, infos, vectors, strict=True)):
        transcript = "\n".join(m["content"] for m in row["prompt"])
        search = expert.reply(str(n), transcript)
        hits = TrialStore(base).search(vector, SEARCH_TOP_K)
        shown = f"<tool_call>...</tool_call>Found {len(hits)} memories:\n" + "\n".join(
            format_record(h.record) for h in hits
        )
        second = expert.reply(str(n), transcript + search + shown)
        trial = TrialStore(base)
        if second != DONE:
            call = expert.promotion(info, [h.id for h in hits])
            assert call is not None and call[0] == MANAGE_TOOL
            args = call[1]
            # manage_memory's keywords: the words in front of the memory's text (tests/tools).
            text = f"{args['keywords']}: {trial.get(args['memory_id']).content}"
            trial.update(args["memory_id"], text, vector=embedder.encode([text])[0])
        item = QAItem(info["question"], info["answer"], info["category"], tuple(info["evidence"] or ()))
        rewards, costly = {}, {}
        for scorer in (AnswerRecallScorer(), EvidenceRecallScorer()):
            for into, settings in ((rewards, config), (costly, COSTLY)):
                components = asyncio.run(memory_reward(TrialStore(base), trial, [item], vector[None], scorer, settings))
                into[scorer.name] = components["score"] if into is rewards else components
        headroom = question_headroom(TrialStore(base), vector, item.evidence, SEARCH_TOP_K, TOP_K, BUDGET)
        out.append({"info": info, "search": search, "second": second, "rewards": rewards, "costly": costly, **headroom})
    return out


def test_the_expert_searches_wide_then_promotes_exactly_where_there_is_headroom(played):
    for episode in played:
        assert f'"name": "{SEARCH_TOOL}"' in episode["search"] and f'"top_k": {SEARCH_TOP_K}' in episode["search"]
        assert (episode["second"] != DONE) == episode["headroom"], episode["info"]["question"]
    assert sum(e["headroom"] for e in played) >= 20, "conv-26 has 28 questions with headroom at top 20"


def test_the_experts_promotions_pay_under_the_training_reward_and_stops_score_zero(played):
    edits = [e for e in played if e["headroom"]]
    stops = [e for e in played if not e["headroom"]]
    assert all(e["rewards"] == {"answer_recall": 0.0, "evidence_recall": 0.0} for e in stops)
    evidence = [e["rewards"]["evidence_recall"] for e in edits]
    answer = [e["rewards"]["answer_recall"] for e in edits]
    kept = [e for e in edits if keep_episode(e["rewards"], True, "evidence_recall")]
    logger.info(
        "conv-26: %d promotions, evidence_recall mean %+.3f (> 0 on %d), answer_recall mean %+.3f; %d kept",
        len(edits),
        statistics.fmean(evidence),
        sum(r > 0 for r in evidence),
        statistics.fmean(answer),
        len(kept),
    )
    # The promoted memory keeps its evidence, so evidence_recall never falls; it rises where the key words
    # bring the memory into the reader's context.
    # Measured: 28 promotions, evidence_recall +0.533 (> 0 on 24), answer_recall +0.171; 22 kept.
    assert min(evidence) >= 0 and statistics.fmean(evidence) > 0.4
    assert sum(r > 0 for r in evidence) > 2 * len(edits) / 3
    assert statistics.fmean(answer) > 0 and len(kept) > len(edits) / 2


def test_the_idle_edit_cost_keeps_the_same_demonstrations(played):
    """Under an idle-edit cost a promotion that raised evidence_recall and left answer_recall flat pays the
    cost under answer_recall; the keep rule weighs what it did to S there (memupdate.training.sft.gain), so the same
    demonstrations are kept as without the cost. Weighing the charged reward instead dropped most of them."""
    edits = [e for e in played if e["headroom"]]
    plain = [keep_episode(e["rewards"], True, "evidence_recall") for e in edits]
    weighed = [keep_episode({k: gain(c) for k, c in e["costly"].items()}, True, "evidence_recall") for e in edits]
    charged = [keep_episode({k: c["score"] for k, c in e["costly"].items()}, True, "evidence_recall") for e in edits]
    assert weighed == plain and sum(plain) > sum(charged), (sum(plain), sum(charged))
