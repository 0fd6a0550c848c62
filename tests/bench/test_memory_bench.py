import json

import pytest

from memupdate.bench.memory import format_memory_bench, run_memory_bench


@pytest.mark.slow
@pytest.mark.serial
def test_memory_bench_runs_small_and_reports_every_measure(memories_parquet, cache_dir, locomo_path, tmp_path):
    out = tmp_path / "memory.json"
    result = run_memory_bench(
        str(memories_parquet),
        str(cache_dir),
        str(locomo_path),
        n_ops=20,
        reward_trials=8,
        memory_trials=50,
        episodes=4,
        calls_per_episode=2,
        output=str(out),
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result["tool_latency_excluding_embedding"]) == {"search", "create", "update", "delete"}
    assert all(v["n"] == 20 for v in result["tool_latency_excluding_embedding"].values())
    assert result["reward_throughput"]["trials"] == 8 and result["reward_throughput"]["ratio"] > 0
    # Measured as training runs: new texts within the tools' cap, S on the reward's text budget.
    throughput = result["reward_throughput"]
    assert result["max_content_chars"] == 300 and throughput["max_new_text_chars"] <= 300
    assert 0 < throughput["mean_context_chars"] <= throughput["context_chars_budget"] == 650
    assert result["memory"]["trials"] == 50 and result["event_loop_lag"]["tool_calls"] == 16
    table = format_memory_bench(result)
    assert "reward throughput" in table and "event-loop lag" in table and "cap 300, budget 650" in table
