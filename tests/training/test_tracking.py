"""Run records (commit, config digest, data hashes) and a verl run's metrics.jsonl."""

import hashlib
import json
import subprocess

import pytest

from memupdate.training.tracking import (
    data_sha256,
    git_state,
    run_info,
    run_record,
    write_run_info,
)


def test_git_state_of_a_checkout_clean_dirty_and_absent(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    assert git_state(repo) == {"commit": head, "dirty": False}
    (repo / "a.py").write_text("x = 2\n")
    assert git_state(repo) == {"commit": head, "dirty": True}

    plain = tmp_path / "plain"
    plain.mkdir()
    state = git_state(plain)
    assert state["commit"] is None and state["dirty"] is None and "not a git checkout" in state["reason"]


def test_run_info_hashes_files_and_folders(tmp_path):
    rows = tmp_path / "train.parquet"
    rows.write_bytes(b"rows")
    cache = tmp_path / "embeddings"
    (cache / "sub").mkdir(parents=True)
    (cache / "vectors.npy").write_bytes(b"v1")
    (cache / "sub" / "keys.txt").write_text("k\n")
    record = run_record({"train_files": [str(rows)], "embeddings": str(cache), "memories": None})
    info = run_info("abc", record, backend="x")
    assert info["config_digest"] == "abc" and info["backend"] == "x" and "commit" in info["git"]
    assert info["data_sha256"] == {
        "train_files": [{"path": str(rows), "sha256": hashlib.sha256(b"rows").hexdigest()}],
        "embeddings": [{"path": str(cache), "sha256": data_sha256(cache)}],
    }
    before = data_sha256(cache)
    (cache / "vectors.npy").write_bytes(b"v2")
    assert data_sha256(cache) != before
    missing = run_record({"train_files": [str(tmp_path / "absent.parquet")]})["data_sha256"]
    assert missing == {"train_files": [{"path": str(tmp_path / "absent.parquet"), "sha256": None}]}

    path = write_run_info(tmp_path / "run", info)
    assert json.loads(path.read_text()) == info


def test_a_verl_runs_metrics_jsonl_is_made_from_verls_file_log(tmp_path):
    from memupdate.training.tracking import metrics_from_verl

    with pytest.raises(FileNotFoundError, match="trainer.logger must include file"):
        metrics_from_verl(tmp_path)
    log = tmp_path / "tracking.jsonl"
    log.write_text(
        # verl's validation before training (step 0), then a step that validated and one that did not.
        json.dumps({"step": 0, "data": {"val-core/locomo/reward/mean@1": 0.05, "val-aux/num_turns/mean": 3.0}})
        + "\n"
        + json.dumps({"step": 1, "data": {"critic/score/mean": 0.1, "num_turns/mean": 3.0, "actor/lr": 1e-6}})
        + "\n"
        + json.dumps({"step": 2, "data": {"critic/score/mean": 0.3, "val-core/locomo/reward/mean@1": 0.2}})
        + "\n"
    )
    # verl's dump of step 2's validation: two trajectories of two turns each and one of one turn (a MemAgent
    # validation's rows); step 0 left none.
    (tmp_path / "validation").mkdir()
    keys = ["u1_0_0", "u1_0_1", "u2_0_0", "u2_0_1", "u3_0_0"]
    (tmp_path / "validation" / "2.jsonl").write_text("".join(json.dumps({"uid": k, "score": 0}) + "\n" for k in keys))
    rows = [json.loads(line) for line in metrics_from_verl(tmp_path).read_text().splitlines()]
    assert [(r["step"], r.get("reward_mean")) for r in rows] == [(0, None), (1, 0.1), (2, 0.3)]
    assert [r.get("heldout_reward_mean") for r in rows] == [0.05, None, 0.2]
    # How many questions the held-out mean is over, where verl's dump says.
    assert [r.get("heldout_questions") for r in rows] == [None, None, 3]
    assert rows[1]["num_turns_mean"] == 3.0 and rows[1]["verl"]["actor/lr"] == 1e-6
    log.write_text("{not json\n")
    with pytest.raises(ValueError, match="tracking.jsonl, line 1: not a verl file-logger record"):
        metrics_from_verl(tmp_path)
