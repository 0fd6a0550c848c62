import asyncio
import uuid

import pytest

from memupdate.memory import manager as manager_module
from memupdate.memory.manager import MemoryStoreManager, NamespaceInUse, UnknownNamespace, trial_namespace
from memupdate.memory.store import TrialStore

BASE_NS = "conv-26-qa0-ff702917"


def test_trial_namespace():
    assert trial_namespace(BASE_NS, "1010e8efa1b2c3d4") == "conv-26-qa0-ff702917-1010e8ef"
    with pytest.raises(ValueError):
        trial_namespace(BASE_NS, "abc")


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
    assert isinstance(trial, TrialStore) and trial.namespace == f"{BASE_NS}-a1b2c3d4"
    assert trial.base is other.base and loads == ["conv-26", "toy-1"], (
        "a base store is loaded once and shared"
    )
    assert len(toy) == 3 and toy.base.sample_id == "toy-1" and len(trial) == 184
    assert manager.get(f"{BASE_NS}-a1b2c3d4") is trial and manager.namespaces() == sorted(
        [trial.namespace, other.namespace, toy.namespace]
    )

    with pytest.raises(NamespaceInUse):
        manager.open(BASE_NS, "a1b2c3d4-another-run", "conv-26")
    assert manager.open(BASE_NS, "a1b2c3d4", "conv-26", exist_ok=True) is trial
    with pytest.raises(NamespaceInUse, match="conv-26"):
        manager.open(BASE_NS, "a1b2c3d4", "toy-1", exist_ok=True)

    trial.delete(0)
    trial.delete(1)
    assert len(other) == 184, "trials are isolated"
    stats = manager.release(trial.namespace)
    assert stats == {
        "namespace": f"{BASE_NS}-a1b2c3d4",
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
    assert all(
        r["delta"]["created"][0]["content"] == f"Rollout {i} wrote this." for i, r in enumerate(results)
    )


@pytest.mark.asyncio
async def test_parallel_tool_calls_of_one_trajectory_share_one_store(memories_parquet, cache_dir, embedder):
    manager = MemoryStoreManager(memories_parquet, cache_dir, embedder)
    # The first calls race on loading the base in a thread; all must end up with the same store.
    stores = await asyncio.gather(
        *(manager.aopen(BASE_NS, "0123456789abcdef", "conv-26", exist_ok=True) for _ in range(4))
    )
    assert all(s is stores[0] for s in stores) and manager.namespaces() == [f"{BASE_NS}-01234567"]
