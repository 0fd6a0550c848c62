"""One training stage of the two-stage experiment, by verl's trainer; what the ``train_stage<N>`` rules call.

- Stage 1 (``trained_role="memory"``) trains the memory model; the QA role, when the experiment has a
  QA phase, is the served base QA model.
- Stage 2 (``trained_role="qa"``) trains the QA model; the memory role is the served stage-1 model.

The served model comes as a readiness marker, re-probed here (:func:`memupdate.serving.readiness.read_marker`)
so a dead server fails before the first rollout; so does a misconfigured reward (:func:`stage_reward`).
Token ids cross between the policy and the served model unchanged, so both must share one tokenizer;
:func:`check_same_tokenizer` refuses a mismatch.

A run composes and validates ``main_ppo``'s overrides, starts Ray across the Slurm allocation (or on this
machine; :mod:`memupdate.training.ray_cluster`, one task per node), runs the trainer on its GPUs or CPUs
(``trainer.device``), and merges the last FSDP checkpoint into ``<run>/ckpt`` (HF weights + ``manifest.json``).
verl resumes from whatever ``<run>/checkpoints`` holds; :mod:`memupdate.training.checkpoints` keeps only a
checkpoint of this very run there, and its export refuses any other.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memupdate.memory.environment import MemoryEnvironment
from memupdate.serving.readiness import load_marker, read_marker
from memupdate.settings import DEFAULT_EMBEDDING_MODEL, DEFAULT_MAX_CONTENT_CHARS, SERVED_ROLES, ToolSettings
from memupdate.tools.config import TOOL_CONFIG
from memupdate.training.checkpoints import export_verl_checkpoint, guard_verl_checkpoints, prune_earlier_attempts
from memupdate.utils.io import sha256_file
from memupdate.utils.system import run_to_end, tail

logger = logging.getLogger(__name__)

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
    """``{base_url, model, marker}`` of the served model in ``marker`` (re-probed), or None without a marker;
    the marker's path lets the rollout's client find a requeued server's new address."""
    if marker is None:
        return None
    endpoint = read_marker(marker)
    check_same_tokenizer(policy_dir, load_marker(marker).get("model_path"))
    return {"base_url": endpoint.base_url, "model": endpoint.model, "marker": endpoint.marker}


def stage_reward(
    reward: Mapping[str, Any], trained_role: str, fixed: Mapping[str, Any] | None, settings: Mapping[str, Any]
) -> dict[str, Any]:
    """The reward manager's settings for one stage (``reward.custom_reward_function.reward_kwargs``): the
    workflow's reward settings with the trained role and the QA answer cap. In a memory stage a served scorer's
    reader is the fixed QA model whose QA-phase answers it scores: its marker is the fixed model's (``fixed``,
    :func:`fixed_model_endpoint`), the one place the QA endpoint comes from. Checked now, before the model
    loads: an unknown setting or scorer, a served scorer without its model, or a dead server fails here."""
    from memupdate.rewards.manager import DEFAULT_QA_MAX_TOKENS, check_setting_names, served_endpoints

    check_setting_names(reward)
    if "qa_max_tokens" in settings:
        raise ValueError(
            "qa_max_tokens is the reward's (reward.qa_max_tokens in config/config.yaml): the QA phase and the "
            "reader give the same answers, so they share one cap; remove it from the stage settings"
        )
    out = {**reward, "trained_role": trained_role}
    out.setdefault("qa_max_tokens", DEFAULT_QA_MAX_TOKENS)
    if trained_role == "memory" and out.get("scorer") in SERVED_ROLES:
        if "reader_marker" in out:
            raise ValueError(
                "a memory stage's reader is its fixed QA model (the stage's fixed_marker), not a reader_marker of "
                "its own: remove reader_marker from the reward settings"
            )
        if fixed is None:
            raise ValueError(
                f"reward scorer {out['scorer']!r} reads the QA phase's answers, so the memory stage needs a served "
                "fixed QA model (fixed_marker); none was given"
            )
        out["reader_marker"] = str(fixed["marker"])
    served_endpoints(out)
    return out


def train_stage(
    *,
    trained_role: str,
    settings: Mapping[str, Any],
    model: str,
    train_files: list[str],
    memories: str,
    embeddings: str,
    run_dir: str,
    reward: Mapping[str, Any],
    episode: Mapping[str, Any] | None = None,
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
    :class:`~memupdate.settings.ToolSettings` values; None: all six, full schemas). ``episode`` is the experiment's
    (:class:`~memupdate.settings.EpisodeSettings`). ``verl`` holds the run's options: ``val_files``,
    and for a rollout through a vLLM server of its own (on CPU) ``serving`` (the workflow's serving
    settings)."""
    memory = MemoryEnvironment(
        memories=memories,
        embeddings=embeddings,
        embedding_model=embedding_model,
        max_content_chars=max_content_chars,
        **ToolSettings.environment(tools),
    )
    fixed = fixed_model_endpoint(fixed_marker, model)
    reward = stage_reward(reward, trained_role, fixed, settings)
    command, run_env = verl_commands(
        trained_role=trained_role,
        settings=settings,
        model=model,
        train_files=train_files,
        memory=memory,
        tool_config=str(tool_config),
        run_dir=run_dir,
        reward=reward,
        fixed=fixed,
        episode=episode,
        verl=verl or {},
    )
    return run_verl(command, run_env, run_dir, model)


def train_memagent(
    *,
    settings: Mapping[str, Any],
    loop: Mapping[str, Any],
    model: str,
    train_files: list[str],
    run_dir: str,
    verl: Mapping[str, Any] | None = None,
) -> Path:
    """Train a MemAgent policy (the ``memagent`` loop, ``memupdate_memagent`` reward) and return ``<run_dir>/ckpt``.

    ``loop`` holds the loop's budgets (chunk_size, max_chunks, max_memory_tokens, max_final_tokens);
    ``settings`` are verl config keys.
    """
    from memupdate.training.verl_launcher import MemAgentRun, prepare_memagent_ppo, run_device

    verl = verl or {}
    nnodes, gpus = verl_layout(settings)
    run = MemAgentRun(
        model_path=model,
        train_files=train_files,
        val_files=validation_files(verl),
        loop=loop,
        n_gpus_per_node=gpus,
        nnodes=nnodes,
        experiment_dir=run_dir,
        extra=dict(settings),
        rollout_server=rollout_server(settings, verl),
    )
    argv, run_env = prepare_memagent_ppo(run)
    command = allocation_command(argv, run_dir, nnodes, gpus, device=run_device(settings))
    return run_verl(command, run_env, run_dir, model)


def validation_files(verl: Mapping[str, Any]) -> str | list[str]:
    """verl's ``data.val_files``: required, because verl validates on the training files when none are given
    (training accuracy, at the cost of a pass over the whole training file)."""
    if not verl.get("val_files"):
        raise ValueError("a verl run needs val_files (held-out rows to validate on); verl would use the training files")
    return verl["val_files"]


def rollout_server(settings: Mapping[str, Any], verl: Mapping[str, Any]) -> dict[str, Any] | None:
    """The serving settings of a verl run's own rollout server (``memupdate_vllm``), with the vLLM
    interpreter resolved (:func:`memupdate.serving.launch.vllm_python`); None for verl's in-process rollout."""
    from memupdate.serving.launch import vllm_python
    from memupdate.settings import ServeSettings, build
    from memupdate.training.verl_launcher import uses_external_rollout

    if not uses_external_rollout(settings):
        return None
    serving = build(ServeSettings, verl.get("serving"), "serving")
    return {**dataclasses.asdict(serving), "python": vllm_python(serving)}


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
    trained_role: str,
    settings: Mapping[str, Any],
    model: str,
    train_files: list[str],
    memory: MemoryEnvironment,
    tool_config: str,
    run_dir: str,
    reward: Mapping[str, Any],
    fixed: Mapping[str, Any] | None,
    verl: Mapping[str, Any],
    episode: Mapping[str, Any] | None = None,
    env: Mapping[str, str] = os.environ,
) -> tuple[list[str], dict[str, str]]:
    """The command that starts Ray on every node of the allocation and runs ``main_ppo`` on the head,
    and its environment. ``settings`` are verl config keys (``trainer.total_training_steps: 100``), ``episode`` the
    experiment's (:class:`~memupdate.settings.EpisodeSettings`); ``verl`` holds ``val_files`` and launcher options."""
    from memupdate.training.verl_launcher import MainPPORun, prepare_main_ppo, run_device

    nnodes, gpus = verl_layout(settings, env)
    run = MainPPORun(
        model_path=model,
        train_files=train_files,
        val_files=validation_files(verl),
        tool_config=tool_config,
        memory=memory,
        n_gpus_per_node=gpus,
        nnodes=nnodes,
        experiment_dir=run_dir,
        fixed_model_endpoint=fixed,
        reward=reward,
        episode=episode,
        extra=dict(settings),
        rollout_server=rollout_server(settings, verl),
    )
    argv, run_env = prepare_main_ppo(trained_role, run)
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
            "verl's trainer was given trainer.device cuda but this job has no GPUs: run the training rule through "
            "profiles/slurm (its row in profiles/slurm/resources.yaml asks for gres=gpu:G on every node), or remove "
            "the model's GPU row there to train it on CPU"
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
    CPUs than it has (:data:`memupdate.verl_ext.cpu_platform.RAY_NUM_CPUS`); on GPUs Ray counts the CPUs Slurm
    gave the task (:func:`memupdate.training.ray_cluster.slurm_num_cpus`). ``$MEMUPDATE_NODE_IP_INTERFACE``
    (e.g. ``ib0``) makes every node give Ray that interface's address instead of Ray's default-route guess."""
    from memupdate.training.ray_cluster import NODE_IP_INTERFACE_ENV, cluster_command

    if device == "cpu":
        from memupdate.verl_ext.cpu_platform import RAY_NUM_CPUS, RAY_RESOURCE

        node = {"resources": {RAY_RESOURCE: gpus}, "num_cpus": RAY_NUM_CPUS}
    else:
        node = {"num_gpus": gpus}
    interface = env.get(NODE_IP_INTERFACE_ENV) or None
    command = cluster_command(argv, shared_dir=Path(run_dir) / "ray", node_ip_interface=interface, **node)
    if env.get("SLURM_JOB_ID") and nnodes > 1:
        # One task per node (the rule asks for tasks=nnodes and mpi, so it runs in the batch step); each starts
        # its Ray node, rank 0 the trainer. A one-node job already runs in a step holding the node's GPUs,
        # where a nested srun would wait for them forever.
        step = ["srun", f"--nodes={nnodes}", f"--ntasks={nnodes}", "--ntasks-per-node=1"]
        command = [*step, *step_resources(env, gpus, device), *command]
    return command


def step_resources(env: Mapping[str, str], gpus: int, device: str) -> list[str]:
    """The inner ``srun``'s ``--cpus-per-task`` and ``--gres``: the allocation's, stated. Since Slurm 22.05 a
    step does not inherit the job's ``--cpus-per-task`` (each task would get one CPU, and every Ray worker
    of the node would share it), and snakemake-executor-plugin-slurm-jobstep strips ``SLURM_*``/``SRUN_*`` from
    an ``mpi`` rule's environment, so the value comes from Slurm (``scontrol``) when the variable is gone.

    >>> step_resources({"SLURM_CPUS_PER_TASK": "64"}, 8, "cuda")
    ['--cpus-per-task=64', '--gres=gpu:8']
    >>> step_resources({"SLURM_CPUS_PER_TASK": "2"}, 1, "cpu")
    ['--cpus-per-task=2']
    """
    cpus = env.get("SLURM_CPUS_PER_TASK") or (
        allocation_cpus_per_task(env["SLURM_JOB_ID"]) if "SLURM_JOB_ID" in env else None
    )
    options = [f"--cpus-per-task={int(cpus)}"] if cpus else []
    if device != "cpu" and gpus > 0:
        options.append(f"--gres=gpu:{gpus}")
    return options


def allocation_cpus_per_task(job_id: str) -> int | None:
    """``CPUs/Task`` of Slurm job ``job_id`` (``scontrol show job``), or None (logged) when Slurm does not say."""
    where = f"`scontrol show job -o {job_id}`"
    try:
        # A controller answers its own job's query at once; an unreachable one makes scontrol retry for a minute
        # (a machine with Slurm's tools and no running controller), which a command line need not wait for.
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as err:
        logger.warning("%s failed (%s): the Ray nodes' srun states no --cpus-per-task", where, err)
        return None
    cpus = cpus_per_task(out.stdout)
    if cpus is None:
        logger.warning(
            "no CPUs/Task in the output of %s (exit %d: %s): the Ray nodes' srun states no --cpus-per-task",
            where,
            out.returncode,
            out.stderr.strip(),
        )
    return cpus


def cpus_per_task(record: str) -> int | None:
    """``CPUs/Task`` of a job record of ``scontrol show job -o`` (None if absent).

    >>> cpus_per_task("JobId=72 NumNodes=2 NumCPUs=128 NumTasks=2 CPUs/Task=64 ReqB:S:C:T=0:0:*:*")
    64
    """
    match = re.search(r"\bCPUs/Task=(\d+)", record)
    return int(match.group(1)) if match else None


def run_verl(
    command: list[str],
    run_env: Mapping[str, str],
    run_dir: str,
    model: str,
    *,
    log_name: str = TRAINER_LOG,
    shards: str | None = "actor",
    kind: str | None = None,
) -> Path:
    """Run a verl training command to its end, its output in ``<run_dir>/<log_name>`` (main_ppo: Ray's workers and
    the trainer; follow it with ``tail -f``), its rollout servers started beside it when they can be
    (:func:`~memupdate.serving.rollout_server.prelaunched_servers`), and export its last checkpoint to
    ``<run_dir>/ckpt`` (:func:`export_verl_checkpoint` with ``shards`` and ``kind``). verl resumes from
    ``<run_dir>/checkpoints`` only if they are this very run's (:func:`guard_verl_checkpoints`)."""
    from memupdate.serving.rollout_server import prelaunched_servers
    from memupdate.training.verl_launcher import refuse_unreachable_steps

    resolved = _resolved_config(Path(run_dir))
    if resolved:  # main_ppo's runs; verl's SFT trainer writes none
        refuse_unreachable_steps(resolved)
    guard_verl_checkpoints(Path(run_dir))
    if resolved:
        prune_earlier_attempts(Path(run_dir) / "checkpoints", resolved["trainer"].get("max_actor_ckpt_to_keep"))
    log = Path(run_dir) / log_name
    logger.info("running %s\nits output: %s", " ".join(command), log)
    with log.open("w", encoding="utf-8") as out, prelaunched_servers(resolved, run_env):
        code = run_to_end(command, {**os.environ, **run_env}, out)
    if code:
        raise RuntimeError(f"verl's trainer exited with code {code}; the end of {log}:\n{tail(log, 60)}")
    return export_verl_checkpoint(Path(run_dir), model, shards=shards, kind=kind)


def _resolved_config(run_dir: Path) -> dict[str, Any]:
    """The run's ``resolved_config.yaml`` (empty without one)."""
    import yaml

    from memupdate.training.verl_launcher import RESOLVED_CONFIG

    path = run_dir / RESOLVED_CONFIG
    return (yaml.safe_load(path.read_text(encoding="utf-8")) or {}) if path.is_file() else {}
