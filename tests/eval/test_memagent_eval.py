"""MemAgent evaluation of one model in-process and through a served copy: the same greedy replies, the same
scores, and a report that recomputes from its predictions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from memupdate.eval.memagent import METRICS, memagent_length_curve, model_source
from memupdate.serving.readiness import write_marker
from memupdate.serving.vllm import start_vllm_server

SETTINGS = {"chunk_size": 48, "max_chunks": 3, "max_memory_tokens": 12, "max_final_tokens": 8,
            "prompt_length": 768, "batch_size": 3, "limit": 3}  # fmt: skip


@pytest.mark.slow
@pytest.mark.vllm
def test_served_and_in_process_evaluation_agree(tiny_model_dir, hotpot_rows, vllm_python, tmp_path):
    marker = tmp_path / "serve" / "tiny.ready.json"
    with start_vllm_server(
        tiny_model_dir, served_model_name="tiny-eval", python=vllm_python, dtype="float32", log_path=tmp_path / "vllm.log"
    ) as server:  # fmt: skip
        server.wait_until_ready(timeout_s=300)
        write_marker(marker, endpoint=server.base_url, served_model_name="tiny-eval", pid=server.pid,
                     model_path=tiny_model_dir)  # fmt: skip
        assert model_source(marker)[0] == tiny_model_dir.resolve()
        report = memagent_length_curve(
            {"local": tiny_model_dir, "served": marker}, {"3": hotpot_rows}, tmp_path / "eval", SETTINGS
        )
    assert report["models"] == {
        "local": {"path": str(tiny_model_dir), "served_as": None},
        "served": {"path": str(tiny_model_dir.resolve()), "served_as": "tiny-eval"},
    }
    predictions = {
        name: [json.loads(line) for line in (tmp_path / "eval" / "predictions" / f"{name}-3.jsonl").open()]
        for name in ("local", "served")
    }
    # Greedy decoding of one float32 model: the server writes the same memories and answers, chunk by chunk.
    assert [p["reply"] for p in predictions["served"]] == [p["reply"] for p in predictions["local"]]
    assert [p["chunks"] for p in predictions["served"]] == [3, 3, 3]
    for name, records in predictions.items():
        summary = report["results"][name]["3"]
        assert summary["n"] == 3
        for key in METRICS:
            assert summary[key] == pytest.approx(np.mean([r[key] for r in records]), abs=1e-4)
    assert (tmp_path / "eval" / "length_curve.png").is_file()
