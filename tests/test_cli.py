import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from memupdate.cli import build_parser

COMMANDS = [
    [],
    ["fetch"],
    ["preprocess"],
    ["preprocess", "locomo"],
    ["preprocess", "hotpotqa"],
    ["preprocess", "locomo-haystack"],
    ["embed"],
    ["bench"],
    ["bench", "memory"],
    ["bench", "rollout"],
    ["bench", "memagent"],
    ["eval"],
    ["eval", "locomo"],
    ["eval", "report"],
    ["score"],
    ["flash-attn-wheel"],
]


def memupdate_exe():
    exe = Path(sys.executable).parent / "memupdate"
    return [str(exe)] if exe.exists() else [shutil.which("memupdate") or "memupdate"]


@pytest.mark.parametrize("words", COMMANDS, ids=lambda w: " ".join(w) or "top")
def test_every_subcommand_has_help(words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*words, "--help"])
    assert exit_info.value.code == 0
    assert "usage: memupdate" in capsys.readouterr().out


def test_console_script_is_installed():
    result = subprocess.run([*memupdate_exe(), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "preprocess" in result.stdout


def test_preprocess_locomo_from_the_command_line(locomo_path, tmp_path):
    cmd = [
        *memupdate_exe(),
        "preprocess",
        "locomo",
        str(locomo_path),
        str(tmp_path),
        "--train",
        "conv-26",
        "--val",
        "conv-30",
        "--test",
        "conv-41",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    splits = json.loads(result.stdout)
    assert splits["train"]["rows"] == pq.read_metadata(tmp_path / "train.parquet").num_rows == 152


def test_preprocess_locomo_haystack_from_the_command_line(locomo_path, tmp_path):
    cmd = [*memupdate_exe(), "preprocess", "locomo-haystack", str(locomo_path), str(tmp_path)]
    cmd += ["--train", "conv-26", "--test", "conv-48", "--num-docs", "3"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["parts"]["test"]["conversations"] == ["conv-48"]
    assert pq.read_metadata(tmp_path / "3.test.parquet").num_rows == summary["parts"]["test"]["rows"] > 0
    assert json.loads((tmp_path / "3.summary.json").read_text()) == summary


def test_score_command(capsys):
    from memupdate.cli import main

    main(["score", "running, painting", "painting and running", "--category", "1"])
    scores = json.loads(capsys.readouterr().out)
    assert scores["mem0_f1"] == pytest.approx(0.8)
    # Category 1 splits on commas: gold "painting and running" is one part, best matched by
    # "running" or "painting" alone (P=1, R=1/2), so 2/3.
    assert scores["locomo_f1"] == pytest.approx(2 / 3)


def test_flash_attn_wheel_prints_the_prebuilt_wheel_or_says_why_there_is_none(capsys):
    from memupdate.cli import main

    main(["flash-attn-wheel", "--python", "3.12", "--torch", "2.11.0", "--cuda", "13.0", "--machine", "x86_64"])
    assert capsys.readouterr().out.strip().endswith("/flash_attn-2.8.3+cu130torch2.11-cp312-cp312-linux_x86_64.whl")
    with pytest.raises(
        SystemExit, match="no prebuilt flash-attn wheel for flash-attn 2.8.3, torch 2.11, CUDA 13.0, aarch64"
    ):
        main(["flash-attn-wheel", "--python", "3.12", "--torch", "2.11.0", "--cuda", "13.0", "--machine", "aarch64"])


def test_eval_report_rebuilds_from_predictions_and_names_a_missing_folder(tmp_path, capsys):
    from memupdate.cli import main

    with pytest.raises(FileNotFoundError, match="no predictions in"):
        main(["eval", "report", str(tmp_path), "--experiment", "exp", "-v"])
    (tmp_path / "predictions").mkdir()
    record = {
        "namespace": "q1",
        "sample_id": "conv-48",
        "category": 4,
        "question": "Where?",
        "answer": "Paris",
        "predictions": {"locomo": "Paris"},
        "evidence": [],
    }
    (tmp_path / "predictions" / "no_update.jsonl").write_text(json.dumps(record) + "\n")
    main(["eval", "report", str(tmp_path), "--experiment", "exp", "--published", ""])
    assert "| no_update |" in capsys.readouterr().out
    assert json.loads((tmp_path / "report.json").read_text())["systems"]["no_update"]["locomo"]["f1"] == 1.0


@pytest.mark.parametrize("verbose", [False, True])
def test_a_failure_prints_one_line_and_the_traceback_only_with_verbose(tmp_path, verbose):
    cmd = [*memupdate_exe(), *(["-v"] if verbose else []), "eval", "report", str(tmp_path), "--experiment", "exp"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert f"no predictions in {tmp_path}" in result.stderr
    if verbose:
        assert "Traceback" in result.stderr
    else:
        assert len(lines) == 1 and "FileNotFoundError" in lines[0] and "-v shows the traceback" in lines[0], lines


def test_a_failure_after_importing_faiss_and_verl_still_prints_one_line(tmp_path):
    """faiss's loader and verl's platform check log at import; around a failure they buried its one line (issue 37)."""
    cmd = [*memupdate_exe(), "eval", "locomo", "--experiment", "exp", "--out-dir", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs the base QA model served" in lines[0], lines


def test_preprocess_hotpotqa_with_a_pool_per_part_from_the_command_line(hotpotqa_path, tmp_path):
    out = tmp_path / "dev-10.parquet"
    cmd = [
        *memupdate_exe(),
        "preprocess",
        "hotpotqa",
        str(hotpotqa_path),
        str(out),
        "--num-docs",
        "10",
        "--limit",
        "10",
        "--test-percent",
        "20",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    parts = {info["part"] for info in pq.read_table(out).column("extra_info").to_pylist()}
    # Both parts: at 20% the hash of the first 10 ids holds 2 out.
    assert parts == {"train", "test"}
