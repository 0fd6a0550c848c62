"""``memupdate bench update`` at a tiny size: every pair of checkpointing and budget in its own process, the
micro-batches verl's partition makes within each budget, and a refused budget below the episode width."""

import json

import pytest

from memupdate.bench.update import format_update_bench, micro_batches, run_update_bench


def test_micro_batches_stay_within_the_budget_and_cover_every_episode():
    lengths = [300, 120, 250, 90, 200, 310]
    for budget in (320, 640, 2000):
        parts = micro_batches(lengths, width=320, budget=budget)
        assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in part) <= budget for part in parts), (budget, parts)
    assert len(micro_batches(lengths, width=320, budget=2000)) == 1


def test_a_budget_below_the_episode_width_is_refused():
    with pytest.raises(ValueError, match=r"budgets \[256\] are below the padded episode width 320"):
        run_update_bench("unused", min_tokens=100, max_tokens=300, width=320, budgets=(256, 640))


@pytest.mark.slow
@pytest.mark.serial
def test_update_bench_runs_each_setting_in_its_own_process(tiny_model_dir, tmp_path):
    output = tmp_path / "update.json"
    report = run_update_bench(
        tiny_model_dir, episodes=3, min_tokens=40, max_tokens=120, budgets=(120, 400), output=str(output)
    )
    assert json.loads(output.read_text()) == report
    settings = report["settings"]
    assert [(s["checkpointing"], s["budget"]) for s in settings] == [
        (True, 120),
        (True, 400),
        (False, 120),
        (False, 400),
    ]
    tokens = report["episode_tokens"]
    assert len(tokens) == 3 and all(40 <= t <= 120 for t in tokens)
    for setting in settings:
        assert sum(setting["micro_batches"]) == 3 and setting["seconds"] > 0 and setting["peak_rss_mb"] > 0
        # Each micro-batch padded to its longest episode: at least the episodes' own tokens.
        assert setting["padded_tokens"] >= sum(tokens)
    # At 120 tokens (the width) every episode is its own micro-batch, unpadded.
    assert settings[0]["micro_batches"] == [1, 1, 1] and settings[0]["padded_tokens"] == sum(tokens)
    assert "checkpointing" in format_update_bench(report)
