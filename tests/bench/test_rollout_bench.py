import json

import pytest
import yaml

from memupdate.bench.rollout import format_rollout_bench, run_rollout_bench

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_rollout_bench_measures_loop_and_raw_throughput(locomo_rows, cache_dir, repo_root, monkeypatch, tmp_path):
    monkeypatch.chdir(repo_root)
    out = tmp_path / "rollout.json"
    result = run_rollout_bench(
        str(locomo_rows["train"]),
        str(locomo_rows["memories"]),
        str(cache_dir),
        work_dir=str(tmp_path / "work"),
        prompts=1,
        n=2,
        max_tokens=16,
        repeats=2,
        output=str(out),
        tools={"names": ["search_memory", "manage_memory"], "compact": True},
    )
    assert json.loads(out.read_text()) == result
    # The policy is given the tools asked for (a cold start's are its experiment's).
    assert result["tools"] == ["search_memory", "manage_memory"] and result["compact_schemas"] is True
    assert [t["name"] for t in yaml.safe_load((tmp_path / "work" / "tools.yaml").read_text())["tools"]] == result[
        "tools"
    ]
    assert result["episodes"] == 2 and result["requests"] >= 2 and result["generated_tokens"] > 0
    assert result["agent_loop_seconds"] > 0 and result["raw_seconds"] > 0 and result["ratio"] > 0
    # Each round pairs one loop step with the replay of exactly its requests, episode by episode.
    assert len(result["rounds"]) == 2 == len(result["ratio_per_round"])
    assert all(r["requests"] >= 2 and r["loop_seconds"] > 0 and r["raw_seconds"] > 0 for r in result["rounds"])
    assert all(r["episodes"] == 2 for r in result["rounds"])
    assert "ratio (target >= 0.9)" in format_rollout_bench(result)
