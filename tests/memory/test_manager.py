import asyncio
import uuid

import pytest

from memupdate.memory import manager as manager_module
from memupdate.memory.manager import MemoryStoreManager, NamespaceInUse, UnknownNamespace, trial_namespace
from memupdate.memory.store import TrialStore

BASE_NS = "conv-26-qa0-ff702917"


def test_trial_namespace():
    assert trial_namespace(BASE_NS, "1010e8efa1b2c3d4") == "conv-26-qa0-ff702917-1010e8efa1b2c3d4"
    with pytest.raises(ValueError):
        trial_namespace(BASE_NS, "")


def test_open_get_release_and_stats(memories_parquet, cache_dir, embedder, monkeypatch):
    loads = []
    from_table = manager_module.BaseStore.from_table

    def counting_from_table(table, sample_id, cache):
        loads.append(sample_id)
        return from_table(table, sample_id, cache)

    # Accessed on the class, a plain function is not bound, so it stands in for the classmethod.
    monkeypatch.setattr(manager_module.BaseStore, "from_table", counting_from_table)
    manager = MemoryStoreManager(memories_parquet, cache_dir, embedder)
    assert loads == [] and len(manager) == 0, "nothing is loaded before the first open"

    trial = manager.open(BASE_NS, "a1b2c3d4e5f6", "conv-26")
    other = manager.open(BASE_NS, "ffff0000aaaa", "conv-26")
    toy = manager.open("toy-1-qa0-00000000", "a1b2c3d4e5f6", "toy-1")
    assert isinstance(trial, TrialStore) and trial.namespace == f"{BASE_NS}-a1b2c3d4e5f6"
    assert trial.base is other.base and loads == ["conv-26", "toy-1"], "a base store is loaded once and shared"
    assert len(toy) == 3 and toy.base.sample_id == "toy-1" and len(trial) == 184
    assert manager.get(f"{BASE_NS}-a1b2c3d4e5f6") is trial and manager.namespaces() == sorted(
        [trial.namespace, other.namespace, toy.namespace]
    )

    with pytest.raises(NamespaceInUse, match="release it first"):
        manager.open(BASE_NS, "a1b2c3d4e5f6", "conv-26")
    assert manager.open(BASE_NS, "a1b2c3d4e5f6", "conv-26", exist_ok=True) is trial
    with pytest.raises(NamespaceInUse, match="conv-26"):
        manager.open(BASE_NS, "a1b2c3d4e5f6", "toy-1", exist_ok=True)

    trial.delete(0)
    trial.delete(1)
    assert len(other) == 184, "trials are isolated"
    stats = manager.release(trial.namespace)
    assert stats == {
        "namespace": f"{BASE_NS}-a1b2c3d4e5f6",
        "sample_id": "conv-26",
        "initial_count": 184,
        "final_count": 182,
        "created": 0,
        "updated": 0,
        "deleted": 2,
        "merged": 0,
        "split": 0,
    }
    assert trial.namespace not in manager
    with pytest.raises(UnknownNamespace, match="a1b2c3d4"):
        manager.get(trial.namespace)
    with pytest.raises(UnknownNamespace):
        manager.release(trial.namespace)
    with pytest.raises(LookupError, match="conv-99"):
        manager.open(BASE_NS, "12345678", "conv-99")


def test_request_ids_sharing_a_prefix_get_separate_stores(memories_table, cache, embedder):
    """Issue 15: keyed by request_id[:8], two of verl's uuid4 ids with the same first 8 hex digits
    shared one store (exist_ok handed the second trajectory the first one's edits)."""
    manager = MemoryStoreManager(memories_table, cache, embedder)
    first = manager.open(BASE_NS, "1010e8ef" + "a" * 24, "conv-26", exist_ok=True)
    second = manager.open(BASE_NS, "1010e8ef" + "b" * 24, "conv-26", exist_ok=True)
    assert first is not second and len(manager) == 2
    first.delete(3)
    assert 3 not in first and 3 in second, "one trajectory's edit is not seen by the other"
    assert manager.release(second.namespace)["deleted"] == 0


def test_a_live_store_is_never_reopened_for_another_trajectory(memories_table, cache, embedder):
    """exist_ok lets a trajectory reopen its own store, never one whose namespace merely matches."""
    manager = MemoryStoreManager(memories_table, cache, embedder)
    mine = manager.open(BASE_NS, "a1b2c3d4-e5f6", "conv-26", exist_ok=True)
    mine.delete(3)
    assert manager.open(BASE_NS, "a1b2c3d4-e5f6", "conv-26", exist_ok=True) is mine
    # Another row's base namespace and request id that join to the same string.
    with pytest.raises(NamespaceInUse, match="belongs to another trajectory") as err:
        manager.open(f"{BASE_NS}-a1b2c3d4", "e5f6", "conv-26", exist_ok=True)
    assert "a1b2c3d4-e5f6" in str(err.value) and "'e5f6'" in str(err.value)
    assert manager.namespaces() == [mine.namespace] and 3 not in manager.get(mine.namespace)
    # Released, the namespace is free for whoever opens it next, with a fresh store.
    manager.release(mine.namespace)
    theirs = manager.open(f"{BASE_NS}-a1b2c3d4", "e5f6", "conv-26", exist_ok=True)
    assert theirs is not mine and 3 in theirs


def test_managers_share_no_state(memories_table, cache, embedder):
    first = MemoryStoreManager(memories_table, cache, embedder)
    second = MemoryStoreManager(memories_table, cache, embedder)
    first.open(BASE_NS, "a1b2c3d4", "conv-26").delete(3)
    assert len(second) == 0
    assert 3 in second.open(BASE_NS, "a1b2c3d4", "conv-26")


@pytest.mark.asyncio
async def test_many_coroutines_open_use_and_release(memories_parquet, cache_dir, embedder):
    manager = MemoryStoreManager(memories_parquet, cache_dir, embedder)

    async def rollout(i: int) -> dict:
        trial = await manager.aopen(BASE_NS, uuid.UUID(int=i + 1).hex[-8:] * 2, "conv-26")
        new_id = await trial.acreate(f"Rollout {i} wrote this.")
        await asyncio.sleep(0)  # let other rollouts interleave between tool calls
        assert manager.get(trial.namespace).get(new_id).content == f"Rollout {i} wrote this."
        delta = trial.export_delta()
        return {**manager.release(trial.namespace), "delta": delta}

    results = await asyncio.gather(*(rollout(i) for i in range(16)))
    assert len(manager) == 0 and len({r["namespace"] for r in results}) == 16
    assert all(r["final_count"] == 185 and r["created"] == 1 for r in results)
    assert all(r["delta"]["created"][0]["content"] == f"Rollout {i} wrote this." for i, r in enumerate(results))


@pytest.mark.asyncio
async def test_parallel_tool_calls_of_one_trajectory_share_one_store(memories_parquet, cache_dir, embedder):
    manager = MemoryStoreManager(memories_parquet, cache_dir, embedder)
    # The first calls race on loading the base in a thread; all must end up with the same store.
    stores = await asyncio.gather(
        *(manager.aopen(BASE_NS, "0123456789abcdef", "conv-26", exist_ok=True) for _ in range(4))
    )
    assert all(s is stores[0] for s in stores) and manager.namespaces() == [f"{BASE_NS}-0123456789abcdef"]


def test_trials_start_from_a_registered_store(memories_parquet, cache_dir, embedder):
    manager = MemoryStoreManager(memories_parquet, cache_dir, embedder)
    first = manager.open("conv-26-s1", "r1", "conv-26", sessions=1)
    first.delete(first.records()[0].id)
    seen_first = len(first)
    manager.start_from("conv-26-s2", first)
    second = manager.open("conv-26-s2", "r2", "conv-26", sessions=2)
    grown = len(TrialStore(manager.base("conv-26"), sessions=2))
    assert second.sessions == 2 and len(second) == grown - 1 and seen_first == len(first)
    manager.release(second.namespace)
    assert manager.started("conv-26-s2") is second and manager.started("conv-26-s9") is None
    # Another base namespace starts from the base, and the registration can be dropped.
    assert len(manager.open("conv-26-s9", "r3", "conv-26", sessions=2)) == grown
    manager.start_from("conv-26-s2", None)
    assert len(manager.open("conv-26-s2", "r4", "conv-26", sessions=2)) == grown
    with pytest.raises(NamespaceInUse):
        manager.open("conv-26-s2", "r4", "conv-26", sessions=3)
