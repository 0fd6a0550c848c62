import asyncio

import numpy as np
import pytest

from memupdate.data.locomo import initial_memories
from memupdate.memory.store import EvidenceNotWritable, TrialStore
from memupdate.metrics import normalize_squad
from memupdate.rewards.efficiency import EfficiencyConfig, efficiency_factor
from memupdate.rewards.memory import (
    MemoryRewardComputer,
    MemoryRewardConfig,
    RewardRequest,
    memory_reward,
    select_questions,
)
from memupdate.rewards.scorers import AnswerRecallScorer, EvidenceRecallScorer, QAItem, span_f1
from memupdate.settings import DEFAULT_MAX_CONTENT_CHARS

TARGET = QAItem("When did Caroline go to the LGBTQ support group?", "7 May 2023", 2, ("D1:3",))
# Tie the reward to what retrieval returns, not to the efficiency factor.
NEUTRAL = MemoryRewardConfig(top_k=5, efficiency=EfficiencyConfig(max_total_memories=None))


def reward(initial, final, items, embedder, scorer, config=NEUTRAL):
    vectors = embedder.encode([i.question for i in items])
    return asyncio.run(memory_reward(initial, final, items, vectors, scorer, config))


def improved_trial(base, embedder):
    trial = TrialStore(base, embedder)
    text = "Caroline went to the LGBTQ support group on 7 May 2023."
    trial.create(text, {"speaker": "Caroline"}, vector=embedder.encode([text])[0])
    return trial


@pytest.mark.parametrize("scorer", [AnswerRecallScorer(), EvidenceRecallScorer()], ids=lambda s: s.name)
def test_unchanged_store_scores_exactly_zero(base, embedder, scorer):
    out = reward(TrialStore(base), TrialStore(base), [TARGET], embedder, scorer)
    assert out["score"] == 0.0 and out["qa_delta"] == 0.0 and out["efficiency"] == 1.0


@pytest.mark.parametrize("scorer", [AnswerRecallScorer(), EvidenceRecallScorer()], ids=lambda s: s.name)
def test_a_change_the_reader_cannot_see_scores_exactly_zero(base, embedder, scorer):
    """The QA prompt shows each memory as its date and content: the top hit's session, type and speaker
    changed (metadata no line shows) leave S where it was."""
    query = embedder.encode([TARGET.question])[0]
    top = TrialStore(base).search(query, 1)[0]
    final = TrialStore(base)
    final.update(top.id, metadata={"session": 99, "type": "event", "speaker": "Someone else"})
    out = reward(TrialStore(base), final, [TARGET], embedder, scorer)
    assert final.get(top.id).session == 99 and out["qa_delta"] == 0.0 and out["score"] == 0.0


def test_a_memory_that_answers_the_question_earns_a_positive_reward(base, embedder):
    out = reward(TrialStore(base), improved_trial(base, embedder), [TARGET], embedder, AnswerRecallScorer())
    # Before: the observation says "recently", under the next day's date (8 May, 2023: its phrase "may 2023"
    # has F1 0.8 against the gold, and one wrong number of three: 2/3 of that); after: the new memory, ranked
    # first, states the day ("went on 7 May 2023": the phrase "7 may 2023", F1 1).
    assert out["qa_initial"] == pytest.approx(8 / 15) and out["qa_final"] == pytest.approx(1.0)
    assert out["score"] > 0 and out["memories_final"] == out["memories_initial"] + 1
    assert out["ops_created"] == 1.0 and out["ops_deleted"] == 0.0


def test_deleting_the_evidence_earns_a_negative_reward(base, embedder):
    final = TrialStore(base, embedder)
    before = reward(TrialStore(base), final, [TARGET], embedder, EvidenceRecallScorer())
    final.delete(0)  # [0] is the D1:3 observation: the only memory citing the gold evidence
    after = reward(TrialStore(base), final, [TARGET], embedder, EvidenceRecallScorer())
    assert before["score"] == 0.0 and after["qa_initial"] == 1.0 and after["qa_final"] == 0.0
    assert after["score"] < 0


COSTLY = MemoryRewardConfig(top_k=5, efficiency=EfficiencyConfig(max_total_memories=None), idle_edit_cost=0.05)


@pytest.mark.parametrize("scorer", [AnswerRecallScorer(), EvidenceRecallScorer()], ids=lambda s: s.name)
def test_an_edit_that_gains_nothing_pays_the_idle_edit_cost_and_stopping_pays_nothing(base, embedder, scorer):
    """With reward.idle_edit_cost, stopping is strictly best where nothing is missing: an edit the reader cannot
    tell from the original, or one that loses, pays the cost on top; a trajectory that changed nothing pays none."""
    query = embedder.encode([TARGET.question])[0]
    top = TrialStore(base).search(query, 1)[0]
    unseen = TrialStore(base)
    unseen.update(top.id, metadata={"session": 99})
    lost = TrialStore(base, embedder)
    lost.delete(0)
    stopped = reward(TrialStore(base), TrialStore(base), [TARGET], embedder, scorer, COSTLY)
    idle = reward(TrialStore(base), unseen, [TARGET], embedder, scorer, COSTLY)
    losing = reward(TrialStore(base), lost, [TARGET], embedder, scorer, COSTLY)
    assert stopped["score"] == 0.0 and stopped["idle_edit_cost"] == 0.0
    assert idle["qa_delta"] == 0.0 and idle["score"] == -0.05 and idle["idle_edit_cost"] == 0.05
    free = reward(TrialStore(base), lost, [TARGET], embedder, scorer)
    assert losing["score"] == pytest.approx(free["score"] - 0.05) and losing["idle_edit_cost"] == 0.05


def test_an_edit_that_helps_pays_no_idle_edit_cost(base, embedder):
    free = reward(TrialStore(base), improved_trial(base, embedder), [TARGET], embedder, AnswerRecallScorer())
    costly = reward(TrialStore(base), improved_trial(base, embedder), [TARGET], embedder, AnswerRecallScorer(), COSTLY)
    assert costly["score"] == free["score"] > 0 and costly["idle_edit_cost"] == 0.0


def test_the_idle_edit_cost_is_a_cost():
    with pytest.raises(ValueError, match="idle_edit_cost"):
        MemoryRewardConfig(idle_edit_cost=-0.1)
    assert MemoryRewardConfig.from_dict({"idle_edit_cost": 0.05}).idle_edit_cost == 0.05


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


def test_efficiency_never_amplifies_a_gain():
    """Upstream paid up to 1.5x a gain, 1.2x for memories longer than before; E is at most 1, and settings that
    would lift it above are refused."""
    longer = efficiency_factor(100, 10000, 100, 20000, EfficiencyConfig(max_total_memories=None))
    assert longer["density_factor"] == 1.0 and longer["efficiency"] == 1.0
    fewer_and_longer = efficiency_factor(100, 10000, 90, 27000, EfficiencyConfig(max_total_memories=None))
    assert fewer_and_longer["efficiency"] <= 1.0
    with pytest.raises(ValueError, match="need 0 < min_factor <= max_factor <= 1, got 0.1, 1.5"):
        EfficiencyConfig(max_factor=1.5)
    with pytest.raises(ValueError, match="density_cap must be in \\(0, 1\\], got 1.2"):
        EfficiencyConfig(density_cap=1.2)


def test_other_questions_join_the_target_reproducibly(base, embedder, locomo_conversations):
    pool = [
        QAItem(q.question, q.answer, q.category, q.evidence) for q in locomo_conversations["conv-26"].qa if q.answer
    ]
    items = select_questions(TARGET, pool, 4, "conv-26-qa0-ff702917")
    assert items[0] == TARGET and len(items) == 5 and TARGET not in items[1:]
    assert items == select_questions(TARGET, pool, 4, "conv-26-qa0-ff702917")
    assert items != select_questions(TARGET, pool, 4, "conv-26-qa1-00000000")
    out = reward(TrialStore(base), improved_trial(base, embedder), items, embedder, AnswerRecallScorer())
    assert out["n_questions"] == 5 and out["target_final"] == pytest.approx(1.0)


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
    config = MemoryRewardConfig.from_dict(
        {"top_k": 3, "other_questions": 2, "efficiency": {"max_total_memories": None}}
    )
    assert config.top_k == 3 and config.efficiency.max_total_memories is None
    with pytest.raises(TypeError):
        MemoryRewardConfig.from_dict({"topk": 3})
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        MemoryRewardConfig(top_k=0)


def test_query_vectors_must_match_items(base):
    with pytest.raises(ValueError, match="one query vector per question"):
        asyncio.run(
            memory_reward(TrialStore(base), TrialStore(base), [TARGET], np.zeros((2, 384)), AnswerRecallScorer())
        )


# ------------------------------------------------------------------ issue 14: no reward without better memory

CAP = DEFAULT_MAX_CONTENT_CHARS  # what the writing tools accept (tests/tools show longer text refused)


def pasted(question, hits):
    """Exploit 1 of issue 14: the question followed by the text of its search results."""
    return " ".join([question, *(h.content for h in hits)])


def question_and_hits(cap):
    def build(trial, item, hits, vec):
        text = pasted(item.question, hits[:5])[:cap]
        trial.create(text, vector=vec(text))

    return build


def copies(trial, item, hits, vec):
    text = pasted(item.question, hits[:5])[:CAP]
    for _ in range(10):
        trial.create(text, vector=vec(text))


def hits_text(trial, item, hits, vec):
    text = " ".join(h.content for h in hits[:5])[:CAP]  # long content within the cap
    trial.create(text, vector=vec(text))


def question_alone(trial, item, hits, vec):
    trial.create(item.question, vector=vec(item.question))


def merge_unrelated(trial, item, hits, vec):
    # The five memories least like the question, merged under the question's words to collect their evidence.
    trial.merge([h.id for h in hits[-5:]], item.question, vector=vec(item.question))


def split_top_hit(trial, item, hits, vec):
    parts = [item.question, f"{item.question}?"]  # no word beyond the question
    trial.split(hits[0].id, parts, vectors=np.stack([vec(p) for p in parts]))


EXPLOITS = {
    "question and its search results, capped": question_and_hits(CAP),
    "question and its search results, uncapped": question_and_hits(10_000),
    "ten copies of it": copies,
    "search results' text within the cap": hits_text,
    "the question pasted alone": question_alone,
    "merge of unrelated memories": merge_unrelated,
    "split of the top hit into the question": split_top_hit,
}


@pytest.fixture(scope="module")
def exploit_setting(base, embedder, locomo_conversations):
    """Every answerable question of conv-26, its ranked memories (top 5, and the 5 least similar) and the
    vectors of every text the exploits write, embedded in one batch."""
    items = [
        QAItem(q.question, q.answer, q.category, q.evidence) for q in locomo_conversations["conv-26"].qa if q.answer
    ]
    queries = embedder.encode([i.question for i in items])
    ranked = []
    for query in queries:
        everything = TrialStore(base).search(query, len(base))
        ranked.append([*everything[:5], *everything[-5:]])
    texts = {
        text
        for item, hits in zip(items, ranked, strict=True)
        for text in (
            item.question,
            f"{item.question}?",
            pasted(item.question, hits[:5]),
            pasted(item.question, hits[:5])[:CAP],
            " ".join(h.content for h in hits[:5])[:CAP],
        )
    }
    texts = sorted(texts)
    vectors = dict(zip(texts, embedder.encode(texts), strict=True))
    return items, queries, ranked, vectors


@pytest.mark.parametrize("scorer", [AnswerRecallScorer(), EvidenceRecallScorer()], ids=lambda s: s.name)
@pytest.mark.parametrize("exploit", list(EXPLOITS))
def test_no_exploit_pays_on_conv26(base, exploit_setting, exploit, scorer):
    items, queries, ranked, vectors = exploit_setting
    config = MemoryRewardConfig(efficiency=EfficiencyConfig(max_total_memories=None))
    paid, scores = [], []
    for item, query, hits in zip(items, queries, ranked, strict=True):
        trial = TrialStore(base)
        EXPLOITS[exploit](trial, item, hits, vectors.__getitem__)
        out = asyncio.run(memory_reward(TrialStore(base), trial, [item], query[None], scorer, config))
        assert out["context_chars_final"] <= config.context_chars
        scores.append(out["score"])
        if out["score"] > 0:
            paid.append((round(out["score"], 3), item.question, item.answer))
    # A sentence cut short inside the pasted text can read with fewer words around the answer than the whole
    # memory did (answer_recall is a unit's F1): a few questions gain a little, none on average.
    assert sum(scores) <= 0, f"{exploit} earns {sum(scores) / len(scores):+.4f} per question: {paid[:3]}"
    assert len(paid) <= 0.05 * len(items), f"{exploit} paid on {len(paid)} of {len(items)} questions: {paid[:3]}"


def test_cited_evidence_cannot_be_written_so_it_cannot_be_rewarded(base, embedder):
    """Exploit 2 of issue 14: a memory citing the gold dialogue ids. The store refuses the claim (the tools
    word it for the model); the same memory without it earns nothing from evidence_recall."""
    trial = TrialStore(base, embedder)
    vector = embedder.encode([TARGET.question])[0]
    with pytest.raises(EvidenceNotWritable):
        trial.create(TARGET.question, {"evidence": list(TARGET.evidence)}, vector=vector)
    trial.create(TARGET.question, vector=vector)
    out = reward(TrialStore(base), trial, [TARGET], embedder, EvidenceRecallScorer())
    assert out["qa_initial"] == 1.0 and out["score"] <= 0


def test_s_reads_a_fixed_budget_of_text_however_long_the_memories(base, embedder):
    long_text = " ".join(r.content for r in base.records[:40])  # ~3,800 characters, past any cap
    trial = TrialStore(base, embedder)
    trial.create(f"{TARGET.question} {long_text}", vector=embedder.encode([TARGET.question])[0])
    out = reward(TrialStore(base), trial, [TARGET], embedder, AnswerRecallScorer())
    assert out["context_chars_final"] == NEUTRAL.context_chars == 650, "the one hit is cut to the budget"
    assert 0 < out["context_chars_initial"] <= 650


def test_components_log_what_the_trajectory_wrote(base, embedder):
    texts = ["Caroline went to the LGBTQ support group on 7 May 2023.", "Melanie ran a charity race.", "x" * 250]
    trial = TrialStore(base, embedder)
    for text, vector in zip(texts, embedder.encode(texts), strict=True):
        trial.create(text, vector=vector)
    out = reward(TrialStore(base), trial, [TARGET], embedder, AnswerRecallScorer())
    lengths = [len(t) for t in texts]
    assert out["created_count"] == 3 and out["created_chars_max"] == 250
    assert out["created_chars_mean"] == pytest.approx(sum(lengths) / 3)
    unchanged = reward(TrialStore(base), TrialStore(base), [TARGET], embedder, AnswerRecallScorer())
    assert (
        unchanged["created_count"] == 0 and unchanged["context_chars_final"] == unchanged["context_chars_initial"] > 0
    )


# ------------------------------------------------------------------ issue 14 item 5: E scales gains only

ALWAYS = MemoryRewardConfig(efficiency=EfficiencyConfig(max_total_memories=None, apply_to="always"))


def test_a_harmful_edit_that_bloats_the_store_is_punished_at_least_as_much(base, embedder):
    harmful, bloated = TrialStore(base), TrialStore(base)
    harmful.delete(0)  # the only memory citing the gold evidence D1:3
    bloated.delete(0)
    junk = [f"Shopping list {i}: milk, eggs, flour and {i} apples." for i in range(40)]
    for text, vector in zip(junk, embedder.encode(junk), strict=True):
        bloated.create(text, vector=vector)
    small = reward(TrialStore(base), harmful, [TARGET], embedder, EvidenceRecallScorer())
    big = reward(TrialStore(base), bloated, [TARGET], embedder, EvidenceRecallScorer())
    assert big["qa_delta"] == small["qa_delta"] == -1.0 and big["efficiency"] < small["efficiency"]
    assert big["score"] <= small["score"] and big["score"] == small["score"] == -1.0
    # Upstream's product, kept behind apply_to: always, punished the bloated store less.
    small_always = reward(TrialStore(base), harmful, [TARGET], embedder, EvidenceRecallScorer(), ALWAYS)
    big_always = reward(TrialStore(base), bloated, [TARGET], embedder, EvidenceRecallScorer(), ALWAYS)
    assert big_always["score"] > small_always["score"]


def test_a_gain_is_still_scaled_by_efficiency(base, embedder):
    config = MemoryRewardConfig(efficiency=EfficiencyConfig(max_total_memories=100))  # size factor < 1
    out = reward(TrialStore(base), improved_trial(base, embedder), [TARGET], embedder, AnswerRecallScorer(), config)
    assert (
        out["qa_delta"] > 0
        and out["efficiency"] < 1
        and out["score"] == pytest.approx(out["qa_delta"] * out["efficiency"])
    )


def test_an_emptied_store_has_density_zero(base, embedder):
    emptied = TrialStore(base)
    for record in base.records:
        emptied.delete(record.id)
    out = reward(TrialStore(base), emptied, [TARGET], embedder, EvidenceRecallScorer())
    assert out["memories_final"] == 0 and out["context_chars_final"] == 0
    assert out["density_factor"] == 0.0 and out["efficiency"] == EfficiencyConfig().min_factor
    assert out["score"] == out["qa_delta"] == -1.0
    assert reward(TrialStore(base), emptied, [TARGET], embedder, EvidenceRecallScorer(), ALWAYS)[
        "score"
    ] == pytest.approx(-0.1)


def test_apply_to_is_validated():
    assert MemoryRewardConfig.from_dict({"efficiency": {"apply_to": "always"}}).efficiency.apply_to == "always"
    with pytest.raises(ValueError, match="apply_to must be one of"):
        EfficiencyConfig(apply_to="sometimes")
    with pytest.raises(ValueError, match="context_chars must be >= 1"):
        MemoryRewardConfig(context_chars=0)


def test_no_cut_of_a_memory_holds_a_phrase_that_scores_above_it(locomo_conversations):
    """span_f1's claim, on conv-26's observations and answers: every contiguous cut of a memory's tokens scores at
    most what the whole memory scores against the same gold (the fragment trick's bound)."""
    conv = locomo_conversations["conv-26"]
    golds = [normalize_squad(str(q.answer)).split() for q in conv.qa if q.answer][:40]
    texts = [normalize_squad(r["content"]).split() for r in initial_memories(conv)][:40]
    checked = 0
    for tokens in texts:
        for gold in golds:
            whole = span_f1(tokens, gold)
            for start in range(0, len(tokens), 3):
                for end in range(start + 1, len(tokens) + 1, 3):
                    assert span_f1(tokens[start:end], gold) <= whole + 1e-12, (tokens, gold, start, end)
                    checked += 1
    assert checked > 20_000
