"""``memupdate bench memagent`` at small sizes: each length in its own process, exactly k chunks read,
work (tokens generated) linear in k, and the same peak memory at every length."""

import json
import statistics

import pytest

from memupdate.bench.memagent import format_memagent_bench, linear_fit, run_memagent_bench


def test_linear_fit_reports_r2():
    assert linear_fit([1, 2, 3], [2, 4, 6.5])["r2"] == pytest.approx(0.9959, abs=1e-4)
    assert linear_fit([1, 2], [5, 5])["r2"] == 1.0


@pytest.mark.slow
@pytest.mark.serial
def test_memagent_bench_runs_every_length_in_its_own_process(hotpotqa_path, tmp_path):
    report = run_memagent_bench(
        hotpotqa_path,
        chunks=(1, 2, 4),
        chunk_size=64,
        questions=2,
        memory_tokens=8,
        final_tokens=4,
        repeats=2,
        work_dir=tmp_path / "work",
        output=str(tmp_path / "bench.json"),
    )
    assert json.loads((tmp_path / "bench.json").read_text()) == report
    assert [r["chunks"] for r in report["lengths"]] == [1, 2, 4]
    # The tiny greedy model always writes up to its caps, so the work per chunk is fixed: its token count
    # is exactly linear in the chunks read (timings on a shared CI machine are not, so they are reported),
    # and the same in every timed repeat, whose median is the length's time.
    assert [r["generated_tokens"] for r in report["lengths"]] == [2 * (k * 8 + 4) for k in (1, 2, 4)]
    assert all(r["generated_tokens_per_repeat"] == [r["generated_tokens"]] * 2 for r in report["lengths"])
    assert all(
        r["seconds"] == pytest.approx(statistics.median(r["seconds_per_repeat"]), abs=1e-3) for r in report["lengths"]
    )
    assert report["peak_memory_spread"] <= 0.10
    # The model's forwards are part of each length's wall time, and the loop's cost per chunk is what remains.
    assert all(0 < r["generation_seconds"] < r["seconds"] for r in report["lengths"])
    assert report["loop_overhead_per_chunk"] == pytest.approx(
        report["time_fit"]["slope"] - report["generation_fit"]["slope"], abs=1e-5
    )
    assert "R^2" in format_memagent_bench(report)
