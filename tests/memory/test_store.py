import asyncio
import gc
import hashlib
import json
import math
import re
import time
import tracemalloc

import numpy as np
import pytest

from memupdate.memory.index import normalize_rows
from memupdate.memory.store import (
    BaseStore,
    EvidenceNotWritable,
    InvalidMemoryOperation,
    MemoryRecord,
    TrialStore,
    UnknownMemoryId,
)

# ---------------------------------------------------------------------------------------------- helpers


def toy_base() -> BaseStore:
    """Six memories with ids 0..4 and 9 (a gap), two speakers, two sessions, 4-d vectors."""
    specs = [
        (0, "Ana keeps bees", "Ana", 1, ["D1:1"]),
        (1, "Ben plays cello", "Ben", 1, ["D1:2"]),
        (2, "Ana sells honey", "Ana", 2, ["D2:1"]),
        (3, "Ben moved to Lisbon", "Ben", 2, ["D2:4", "D2:5"]),
        (4, "Ana visits Lisbon", "Ana", 2, ["D2:7"]),
        (9, "Ben hates bees", "Ben", 1, ["D1:9"]),
    ]
    records = [
        MemoryRecord(
            i,
            text,
            speaker=speaker,
            session=session,
            date=f"day {session}",
            evidence=ev,
            source="observation",
        )
        for i, text, speaker, session, ev in specs
    ]
    rng = np.random.default_rng(7)
    return BaseStore("toy", records, rng.standard_normal((len(records), 4)).astype(np.float32))


def oracle(trial: TrialStore, query: np.ndarray, k: int, filters=None) -> list[int]:
    """Exact top-k by scoring every current record, the reference for TrialStore.search."""
    records = trial.records(filters)
    q = normalize_rows(query)[0]
    scored = sorted(((float(trial.vector(r.id) @ q), r.id) for r in records), key=lambda s: (-s[0], s[1]))
    return [id_ for _, id_ in scored[:k]]


def vec(*values) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def fingerprint(base: BaseStore) -> str:
    digest = hashlib.sha256(base.vectors.tobytes())
    digest.update(repr(base.records).encode())
    digest.update(base.index.ids().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------- records


def test_record_normalises_and_validates():
    record = MemoryRecord("3", "  prefers tea ", session=2.0, evidence="D1:3")
    assert (record.id, record.content, record.session, record.evidence, record.source) == (
        3,
        "prefers tea",
        2,
        ("D1:3",),
        "agent",
    )
    assert MemoryRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    for bad in [
        {"content": "  "},
        {"content": "x", "source": "llm"},
        {"content": "x", "session": "two"},
        {"content": "x", "session": 1.5},
        {"content": "x", "evidence": [1, 2]},
    ]:
        with pytest.raises(InvalidMemoryOperation):
            MemoryRecord(0, **bad)
    with pytest.raises(InvalidMemoryOperation, match="unknown metadata keys"):
        record.with_changes(metadata={"importance": 5})


# ---------------------------------------------------------------------------------------------- trial basics


def test_create_gives_deterministic_ids_after_the_base_max():
    base = toy_base()

    def play(trial):
        a = trial.create("Ana got a dog", {"speaker": "Ana"}, vector=vec(1, 0, 0, 0))
        trial.delete(a)
        b = trial.create("Ben got a cat", vector=vec(0, 1, 0, 0))
        c = trial.merge([0, 2], "Ana keeps bees and sells honey", vector=vec(0, 0, 1, 0))
        d = trial.split(3, ["Ben moved", "to Lisbon"], vectors=np.eye(4)[:2])
        return [a, b, c, *d]

    first, second = play(TrialStore(base)), play(TrialStore(base))
    assert first == second == [10, 11, 12, 13, 14], "max base id 9 + 1, + 2, ...; deleted ids are not reused"


def test_unknown_and_deleted_ids_raise_with_the_id():
    trial = TrialStore(toy_base())
    with pytest.raises(UnknownMemoryId) as err:
        trial.get(5)  # in the gap of base ids
    assert err.value.memory_id == 5 and not err.value.deleted and str(err.value) == "no memory with id 5"
    trial.delete(1)
    for op in (
        lambda: trial.get(1),
        lambda: trial.delete(1),
        lambda: trial.update(1, "x", vector=vec(1, 0, 0, 0)),
    ):
        with pytest.raises(UnknownMemoryId, match="deleted") as err:
            op()
        assert err.value.memory_id == 1 and err.value.deleted
    with pytest.raises(UnknownMemoryId):
        trial.merge([0, 77], "x", vector=vec(1, 0, 0, 0))
    assert 0 in trial, "a failed merge changes nothing"


def test_update_keeps_the_id_and_only_re_embeds_new_content():
    base = toy_base()
    trial = TrialStore(base)
    with pytest.raises(ValueError, match="precomputed vectors"):
        trial.update(0, "Ana keeps three hives")
    with pytest.raises(InvalidMemoryOperation, match="needs new content or metadata"):
        trial.update(0)

    updated = trial.update(0, "Ana keeps three hives", vector=vec(0, 0, 0, 1))
    assert updated.id == 0 and trial.get(0).content == "Ana keeps three hives"
    assert trial.get(0).speaker == "Ana", "metadata not given is kept"
    assert trial.search(vec(0, 0, 0, 1), top_k=1)[0].id == 0

    trial.update(2, metadata={"type": "fact"})
    np.testing.assert_array_equal(trial.vector(2), base.vector(2))
    assert base.get(2).type is None, "the base is never modified"

    # Updating a memory back to its base version removes it from the overlay.
    trial.update(2, metadata={"type": None})
    assert [r["id"] for r in trial.export_delta()["updated"]] == [0]
    assert trial.stats()["updated"] == 3


def test_search_merges_base_and_overlay_and_hides_deleted_and_stale_versions():
    base = toy_base()
    trial = TrialStore(base)
    q = base.vector(3).copy()
    assert trial.search(q, top_k=1)[0].id == 3
    new_id = trial.create("Ben lives in Lisbon", {"speaker": "Ben"}, vector=q)
    trial.update(3, "Ben moved to Porto", vector=-q)
    trial.delete(4)

    hits = trial.search(q, top_k=10)
    assert hits[0].id == new_id and hits[0].score == pytest.approx(1.0, abs=1e-5)
    assert [h.id for h in hits] == oracle(trial, q, 10)
    assert 4 not in {h.id for h in hits}
    assert [h.content for h in hits if h.id == 3] == ["Ben moved to Porto"], "only the current version"
    assert hits[-1].id == 3 and hits[-1].score == pytest.approx(-1.0, abs=1e-5)
    assert len(trial) == len(base) and len(trial.search(q, top_k=0)) == 0


def test_filters():
    base = toy_base()
    trial = TrialStore(base)
    created = trial.create("Ana moved to Porto", {"speaker": "Ana", "session": 3}, vector=vec(1, 1, 0, 0))
    trial.delete(0)
    q = vec(1, 1, 0, 0)

    ana = trial.search(q, top_k=10, filters={"speaker": "ana"})  # case-insensitive
    assert {h.id for h in ana} == {2, 4, created}
    assert [h.id for h in ana] == oracle(trial, q, 10, {"speaker": "Ana"})
    assert {h.id for h in trial.search(q, top_k=10, filters={"speaker": "Ben", "session": "1"})} == {1, 9}
    assert {h.id for h in trial.search(q, top_k=10, filters={"session": [2, 3]})} == {2, 3, 4, created}
    assert [h.id for h in trial.search(q, top_k=10, filters={"source": "agent"})] == [created]
    assert [r.id for r in trial.records({"source": "observation", "speaker": "Ana"})] == [2, 4]
    assert trial.search(q, top_k=10, filters={"speaker": "Zoe"}) == []
    with pytest.raises(InvalidMemoryOperation, match="unknown filter keys"):
        trial.search(q, filters={"topic": "bees"})


def test_merge_and_split_are_real_store_operations():
    trial = TrialStore(toy_base())
    merged = trial.merge([0, 2], "Ana keeps bees and sells their honey", vector=vec(1, 0, 0, 0))
    record = trial.get(merged)
    assert record.evidence == ("D1:1", "D2:1") and record.speaker == "Ana"
    assert record.session is None and record.date is None, "values the originals disagree on are dropped"
    assert record.source == "agent" and 0 not in trial and 2 not in trial

    parts = trial.split(3, ["Ben moved", "Ben lives in Lisbon"], {"type": "fact"}, vectors=np.eye(4)[1:3])
    assert [trial.get(i).content for i in parts] == ["Ben moved", "Ben lives in Lisbon"]
    assert all(trial.get(i).evidence == ("D2:4", "D2:5") and trial.get(i).type == "fact" for i in parts)
    assert 3 not in trial

    with pytest.raises(InvalidMemoryOperation, match="at least two distinct"):
        trial.merge([1, 1], "x", vector=vec(1, 0, 0, 0))
    with pytest.raises(InvalidMemoryOperation, match="at least two parts"):
        trial.split(1, ["only one"], vectors=vec(1, 0, 0, 0))
    with pytest.raises(ValueError, match="2 vector"):
        trial.split(1, ["a", "b"], vectors=vec(1, 0, 0, 0))
    assert trial.stats() == {
        "initial_count": 6,
        "final_count": 6,
        "created": 0,
        "updated": 0,
        "deleted": 0,
        "merged": 1,
        "split": 1,
    }


def test_evidence_is_provenance_no_write_can_claim_it():
    trial = TrialStore(toy_base())
    claim = {"evidence": ["D7:7"]}
    writes = [
        lambda: trial.create("Ana keeps goats", claim, vector=vec(1, 0, 0, 0)),
        lambda: trial.update(0, "Ana keeps three hives", claim, vector=vec(1, 0, 0, 0)),
        lambda: trial.update(0, metadata=claim),
        lambda: trial.merge([0, 2], "Ana keeps bees and sells honey", claim, vector=vec(1, 0, 0, 0)),
        lambda: trial.split(3, ["Ben moved", "Ben lives in Lisbon"], claim, vectors=np.eye(4)[:2]),
    ]
    for write in writes:
        with pytest.raises(EvidenceNotWritable, match="evidence cannot be set"):
            write()
    assert trial.export_delta()["created"] == [] and trial.export_delta()["updated"] == []

    assert trial.get(trial.create("Ana keeps goats", vector=vec(1, 0, 0, 0))).evidence == ()
    assert trial.update(0, "Ana keeps three hives", {"type": "fact"}, vector=vec(1, 0, 0, 0)).evidence == ("D1:1",)
    assert trial.get(trial.merge([0, 2], "Ana keeps bees, sells honey", vector=vec(1, 0, 0, 0))).evidence == (
        "D1:1",
        "D2:1",
    )
    parts = trial.split(3, ["Ben moved", "Ben lives in Lisbon"], vectors=np.eye(4)[:2])
    assert [trial.get(i).evidence for i in parts] == [("D2:4", "D2:5")] * 2


@pytest.mark.asyncio
async def test_async_writes_refuse_claimed_evidence_before_embedding(base, counting_embedder):
    trial = TrialStore(base, counting_embedder)
    claim = {"evidence": ["D1:3"]}
    for write in (
        trial.acreate("x", claim),
        trial.aupdate(0, "x", claim),
        trial.amerge([0, 1], "x", claim),
        trial.asplit(0, ["x", "y"], claim),
    ):
        with pytest.raises(EvidenceNotWritable):
            await write
    assert counting_embedder.calls == 0


def test_created_lists_the_trials_new_memories_still_held():
    trial = TrialStore(toy_base())
    a = trial.create("Ana keeps goats", vector=vec(1, 0, 0, 0))
    b = trial.create("Ben keeps cats", vector=vec(0, 1, 0, 0))
    trial.update(0, "Ana keeps three hives", vector=vec(1, 0, 0, 0))
    merged = trial.merge([b, 1], "Ben keeps cats and plays cello", vector=vec(0, 1, 0, 0))
    assert [r.id for r in trial.created()] == [a, merged]
    assert trial.export_delta()["created"] == [r.to_dict() for r in trial.created()]


# ---------------------------------------------------------------------------------------------- overlay on a real conversation


def test_trial_creation_is_o1_and_copies_nothing(base):
    # Timed without tracemalloc, which slows every allocation (CI once measured 0.75 s under it), and without the
    # garbage collector, the fastest of three rounds: the 1000 trials take ~10 ms alone, but a full run of the suite
    # once measured 0.54 s for one round (a collection of a long session's heap, or another process on two cores).
    elapsed = math.inf
    gc.disable()
    try:
        for _ in range(3):
            start = time.perf_counter()
            trials = [TrialStore(base) for _ in range(1000)]
            elapsed = min(elapsed, time.perf_counter() - start)
            del trials
    finally:
        gc.enable()
    tracemalloc.start()
    snapshot = tracemalloc.take_snapshot()
    trials = [TrialStore(base) for _ in range(1000)]
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(snapshot, "filename"))
    tracemalloc.stop()

    # A copy of 184 records and their vectors per trial would take well over a second.
    assert elapsed < 0.5
    # A copy of the base would cost >= 184 * 384 * 4 bytes (283 kB) per trial; an overlay is ~1-2 kB.
    assert grown / len(trials) < 5_000
    assert all(t.base is base and len(t) == len(base) for t in trials[:3])
    delta = trials[0].export_delta()
    assert delta["created"] == delta["updated"] == delta["deleted"] == []


def test_search_over_fetches_past_deleted_base_hits(base, embedder):
    trial = TrialStore(base, embedder)
    q = embedder.encode(["Where did Caroline go hiking and camping?"])[0]
    top = [h.id for h in trial.search(q, top_k=15)]
    for id_ in top[:10]:
        trial.delete(id_)
    hits = trial.search(q, top_k=5)
    assert [h.id for h in hits] == top[10:15] == oracle(trial, q, 5)
    filtered = trial.search(q, top_k=5, filters={"speaker": "Melanie", "session": [1, 2, 3]})
    assert [h.id for h in filtered] == oracle(trial, q, 5, {"speaker": "Melanie", "session": [1, 2, 3]})
    assert all(h.record.speaker == "Melanie" and h.record.session <= 3 for h in filtered)


@pytest.mark.asyncio
async def test_async_operations_embed_text(base, embedder):
    trial = TrialStore(base, embedder)
    new_id = await trial.acreate("Caroline adopted a grey cat named Oscar.", {"speaker": "Caroline"})
    hits = await trial.asearch("What is the name of Caroline's cat?", top_k=3)
    assert hits[0].id == new_id == base.max_id + 1

    await trial.aupdate(0, "Caroline stopped going to the support group in 2024.")
    hits = await trial.asearch("Does Caroline still attend the support group?", top_k=3)
    assert hits[0].id == 0 and "stopped" in hits[0].content

    merged = await trial.amerge([1, 2], "Caroline feels accepted and is inspired by transgender stories.")
    parts = await trial.asplit(merged, ["Caroline feels accepted.", "Caroline is inspired by transgender stories."])
    assert [trial.get(i).content for i in parts] == [
        "Caroline feels accepted.",
        "Caroline is inspired by transgender stories.",
    ]
    with pytest.raises(InvalidMemoryOperation, match="empty"):
        await trial.asearch("   ")
    with pytest.raises(UnknownMemoryId):
        await trial.aupdate(10_000, "no such memory")
    with pytest.raises(RuntimeError, match="no embedder"):
        await TrialStore(base).acreate("x")


@pytest.mark.asyncio
async def test_64_concurrent_trials_of_one_conversation_are_isolated(base, embedder):
    before = fingerprint(base)
    trials = [TrialStore(base, embedder, namespace=f"conv-26-qa0-ff702917-{i:08x}") for i in range(64)]

    async def act(i: int, trial: TrialStore):
        # Different trials do different operations on overlapping ids.
        created = await trial.acreate(f"Trial {i} learned that Caroline's favourite number is {i}.")
        if i % 4 == 0:
            await trial.aupdate(i, f"Updated by trial {i}.")
        elif i % 4 == 1:
            trial.delete(i)
        elif i % 4 == 2:
            await trial.amerge([i, i + 1], f"Merged by trial {i}.")
        else:
            await trial.asplit(i, [f"Part one of trial {i}.", f"Part two of trial {i}."])
        hits = await trial.asearch(f"What is Caroline's favourite number according to trial {i}?", top_k=100)
        return created, hits

    results = await asyncio.gather(*(act(i, t) for i, t in enumerate(trials)))

    assert fingerprint(base) == before, "the shared base is unchanged"
    for i, (trial, (created, hits)) in enumerate(zip(trials, results, strict=True)):
        assert created == base.max_id + 1, "each trial numbers its own new memories"
        touched = {i, i + 1} if i % 4 == 2 else {i}
        current = {r.id: r for r in trial.records()}
        # Every base memory this trial did not touch is the shared base record itself.
        assert all(current[r.id] is r for r in base.records if r.id not in touched)
        # Everything else was written by this trial and no other.
        own = re.compile(rf"\btrial {i}\b", re.IGNORECASE)
        changed = [r for r in current.values() if r.id not in base or r.id in touched]
        assert changed and all(own.search(r.content) for r in changed)
        assert len(trial) == len(base) + {0: 1, 1: 0, 2: 0, 3: 2}[i % 4]
        assert {h.id for h in hits} <= set(current) and hits[0].id == created


# ---------------------------------------------------------------------------------------------- deltas


#: Honest edits of conv-26's memories 8, 9 (self-care, me-time) and 10 (the kids' summer): they keep the text.
MERGED_8_9 = (
    "Melanie values self-care for her family and carves out me-time each day for running, reading or the violin."
)
SPLIT_10 = ["Melanie's kids are excited about summer break.", "They are considering going camping next month."]


@pytest.mark.asyncio
async def test_delta_round_trip(base, counting_embedder):
    trial = TrialStore(base, counting_embedder, namespace="conv-26-qa3-0a1b2c3d-deadbeef")
    await trial.acreate("Melanie ran a charity race for mental health.", {"speaker": "Melanie", "session": 2})
    await trial.aupdate(5, "Caroline wants to work in counseling and mental health.")
    trial.update(6, metadata={"type": "career"})
    trial.delete(7)
    gone = await trial.acreate("A note that is deleted again.")
    trial.delete(gone)
    await trial.amerge([8, 9], MERGED_8_9)
    await trial.asplit(10, SPLIT_10)

    delta = json.loads(json.dumps(trial.export_delta()))  # JSON-serialisable, no vectors
    assert len(json.dumps(delta)) < 3_000
    assert delta["deleted"] == [7, 8, 9, 10, gone]
    calls_before = counting_embedder.calls
    rebuilt = TrialStore.from_delta(base, delta, counting_embedder)
    assert counting_embedder.calls == calls_before + 1, "one batched encode for all new texts"

    assert rebuilt.export_delta() == delta
    assert rebuilt.records() == trial.records() and rebuilt.stats() == trial.stats()
    assert rebuilt.next_id == trial.next_id and rebuilt.namespace == trial.namespace
    q = counting_embedder.encode(["What charity event did Melanie take part in?"])[0]
    ours, theirs = trial.search(q, top_k=8), rebuilt.search(q, top_k=8)
    assert [h.id for h in ours] == [h.id for h in theirs]
    np.testing.assert_allclose([h.score for h in ours], [h.score for h in theirs], atol=1e-5)

    again = await TrialStore.afrom_delta(base, delta, counting_embedder)
    assert again.records() == trial.records()

    # A reward worker rebuilds a batch of deltas with one encode of all their new texts.
    other = TrialStore(base)
    other.update(6, metadata={"type": "hobby"})  # metadata only: reuses the base vector
    deltas = [delta, other.export_delta()]
    texts = [TrialStore.delta_texts(base, d) for d in deltas]
    assert len(texts[0]) == 5 and texts[1] == []
    vectors = counting_embedder.encode([t for ts in texts for t in ts])
    batched = TrialStore.from_delta_vectors(base, deltas[0], vectors[:5])
    assert batched.records() == trial.records() and batched.embedder is None
    assert TrialStore.from_delta_vectors(base, deltas[1], []).get(6).type == "hobby"
    with pytest.raises(ValueError, match="5 vector"):
        TrialStore.from_delta_vectors(base, deltas[0], vectors[:4])

    with pytest.raises(ValueError, match="applied to base"):
        TrialStore.from_delta(toy_base(), delta, counting_embedder)
    with pytest.raises(ValueError, match="inconsistent delta"):
        TrialStore.from_delta(base, {**delta, "deleted": [*delta["deleted"], 10_000]}, counting_embedder)

    # The reward reads evidence from the delta: one claiming ids its memory did not derive from is refused.
    merged = next(r for r in delta["created"] if r["evidence"])
    assert set(merged["evidence"]) == set(base.get(8).evidence) | set(base.get(9).evidence)
    forged_created = {
        **delta,
        "created": [{**r, "evidence": [*r["evidence"], "D1:3"]} for r in delta["created"]],
    }
    forged_updated = {**delta, "updated": [{**r, "evidence": ["D1:3"]} for r in delta["updated"]]}
    for forged in (forged_created, forged_updated):
        with pytest.raises(ValueError, match=r"cites evidence \['D1:3'\] that no memory it derives from has"):
            TrialStore.from_delta(base, forged, counting_embedder)


# ---------------------------------------------------------------------------------------------- sessions seen


def test_a_store_up_to_a_session_holds_nothing_of_later_sessions():
    base = toy_base()
    trial = TrialStore(base, sessions=1)
    assert [r.id for r in trial.records()] == [0, 1, 9] and len(trial) == 3
    assert 2 not in trial and 9 in trial
    with pytest.raises(UnknownMemoryId):
        trial.get(3)
    rng = np.random.default_rng(0)
    for _ in range(20):
        query = rng.standard_normal(4)
        assert [h.id for h in trial.search(query, 6)] == oracle(trial, query, 6)
        assert {h.id for h in trial.search(query, 6, {"speaker": "Ana"})} <= {0}
    # New memories take ids after the whole conversation's, never one a later session's memory has.
    assert trial.create("Ana bought a hive", vector=vec(1, 0, 0, 0)) == 10
    assert trial.stats()["initial_count"] == 3 and trial.stats()["final_count"] == 4
    assert TrialStore(base, sessions=0).records() == [] and len(TrialStore(base, sessions=2)) == len(base)


def test_the_sessions_seen_travel_with_the_delta():
    base = toy_base()
    trial = TrialStore(base, sessions=1)
    trial.merge([0, 9], "Ana keeps bees; Ben hates them", vector=vec(1, 1, 0, 0))
    delta = trial.export_delta()
    assert delta["sessions"] == 1
    rebuilt = TrialStore.from_delta_vectors(base, delta, [trial.vector(10)])
    assert rebuilt.sessions == 1 and [r.id for r in rebuilt.records()] == [1, 10]
    # A delta cannot change what its store had not seen.
    forged = {**delta, "deleted": [*delta["deleted"], 3]}
    with pytest.raises(ValueError, match="later sessions"):
        TrialStore.from_delta_vectors(base, forged, [trial.vector(10)])


def test_a_fork_continues_the_store_with_the_next_session_added():
    base = toy_base()
    first = TrialStore(base, sessions=1, namespace="s1")
    first.delete(1)
    merged = first.merge([0, 9], "Ana keeps bees; Ben hates them", vector=vec(1, 1, 0, 0))
    second = first.fork(namespace="s2", sessions=2)
    assert [r.id for r in second.records()] == [2, 3, 4, merged]
    assert second.stats() == {
        "initial_count": 4,
        "final_count": 4,
        "created": 0,
        "updated": 0,
        "deleted": 0,
        "merged": 0,
        "split": 0,
    }
    assert second.create("Ben tunes his cello", vector=vec(0, 0, 1, 0)) == merged + 1
    # The fork's changes are its own; the store it came from is as it was.
    assert len(first) == 1 and second.export_delta()["deleted"] == [0, 1, 9]
    with pytest.raises(ValueError, match="at least what its store has seen"):
        second.fork(sessions=1)
    with pytest.raises(ValueError, match="every session"):
        TrialStore(base).fork(sessions=2)


# ---------------------------------------------------------------------------------------------- evidence travels with text


def test_honest_merges_splits_and_rewrites_keep_their_evidence(base):
    trial = TrialStore(base)
    vector = np.ones(base.dim, np.float32)
    merged = trial.get(trial.merge([8, 9], MERGED_8_9, vector=vector))
    assert set(merged.evidence) == {*base.get(8).evidence, *base.get(9).evidence}
    parts = [trial.get(i) for i in trial.split(10, SPLIT_10, vectors=np.stack([vector, vector]))]
    assert all(p.evidence == base.get(10).evidence for p in parts)
    dated = "25 May, 2023: " + base.get(7).content
    assert trial.update(7, dated, vector=vector).evidence == base.get(7).evidence


def test_edits_that_drop_a_sources_text_lose_its_evidence(base):
    trial = TrialStore(base)
    vector = np.ones(base.dim, np.float32)
    # A merge that keeps only its first source's text carries only the first source's evidence.
    merged = trial.get(trial.merge([8, 9, 11], base.get(8).content, vector=vector))
    assert merged.evidence == base.get(8).evidence
    # A split into text that is not the source's: no part carries its evidence.
    parts = ["When did Melanie go camping?", "Melanie went camping."]
    assert all(not trial.get(i).evidence for i in trial.split(10, parts, vectors=np.stack([vector, vector])))
    # A part that only adds words of its own keeps none, though the other part keeps the source's text.
    keep, add = trial.split(
        5, [base.get(5).content, "Caroline and Melanie both value family."], vectors=np.stack([vector, vector])
    )
    assert trial.get(keep).evidence == base.get(5).evidence and not trial.get(add).evidence
    # A rewrite to other text loses the evidence; writing the seed text back restores it.
    assert trial.update(7, "When did Melanie run a race?", vector=vector).evidence == ()
    assert trial.update(7, base.get(7).content, vector=vector).evidence == base.get(7).evidence


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"content": "\u200b\u200b \ufeff"}, "content must be a non-empty string with visible text"),
        ({"content": "Ana\x00 keeps bees"}, "content must not contain NUL"),
        ({"content": "Ana keeps bees", "session": -2}, "session must be 0 or more, got -2"),
        ({"content": "Ana keeps bees", "id": -1}, "id must be an integer of 0 or more"),
    ],
)
def test_a_memory_that_says_nothing_or_points_before_the_first_session_is_refused(fields, message):
    """Zero-width-only or NUL text and negative sessions were stored (issue 37)."""
    with pytest.raises(InvalidMemoryOperation, match=message):
        MemoryRecord(**{"id": 1, **fields})


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda d: d["deleted"].__setitem__(0, "٧"), "deleted id must be an integer or null, got '٧'"),
        (lambda d: d.update(ops={**d["ops"], "create": -4}), r"ops.create must be an integer of 0 or more, got -4"),
        (lambda d: d.update(next_id="1" * 5000), "next_id must be an integer or null"),
        # Counts that contradict the records passed (issue 58).
        (lambda d: d.update(ops={}), r"changes memories \[7, 8\] but counts no operation"),
        (lambda d: d.update(ops={**d["ops"], "rewrite": 1}), r"unknown operations \['rewrite'\] in ops"),
    ],
)
def test_a_tampered_delta_is_refused(base, counting_embedder, tamper, message):
    """int() read "٧" (Arabic 7) as memory 7, and negative counts passed (issue 37); so did counts that contradict
    the records (issue 58)."""
    trial = TrialStore(base, counting_embedder, namespace="conv-26-qa3-0a1b2c3d-deadbeef")
    trial.delete(7)
    trial.delete(8)
    delta = json.loads(json.dumps(trial.export_delta()))
    tamper(delta)
    with pytest.raises(InvalidMemoryOperation, match=message):
        TrialStore.from_delta(base, delta, counting_embedder)


def test_a_delta_text_longer_than_its_writer_may_write_is_refused(base, counting_embedder):
    """The memory tools write at most memory.max_content_chars characters; a delta with 100,000 was scored (issue 37).
    The reward passes the cap; a text the trial kept from the base is the base's, whatever its length."""
    trial = TrialStore(base, counting_embedder)
    trial.create("Ana keeps bees.", vector=counting_embedder.encode(["Ana keeps bees."])[0])
    trial.update(3, base.get(3).content, {"speaker": "Ana"})
    delta = json.loads(json.dumps(trial.export_delta()))
    assert TrialStore.delta_texts(base, delta, max_chars=len("Ana keeps bees.")) == ["Ana keeps bees."]
    delta["created"][0]["content"] = "b" * 100_000
    with pytest.raises(ValueError, match=r"memory 184 has 100,000 characters, more than the 300 its writer may write"):
        TrialStore.delta_texts(base, delta, max_chars=300)
