"""The workflow's Snakemake DAG, built through Snakemake's API (for dvc.yaml and for the plan)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def load_dag(
    root: Path,
    configfiles: Sequence[str] = (),
    targets: Iterable[str] = ("all",),
    config: Sequence[str] = (),
    forceall: bool = True,
) -> Any:
    """The Snakemake workflow of ``root`` with its DAG built for ``targets`` (``config``: ``--config`` values as
    the command line gives them), every job included (``forceall``), or the jobs ``snakemake -n`` would run.

    Returns the ``snakemake.workflow.Workflow``; its ``dag`` holds the jobs. Snakemake's API stops at
    printing a DAG; the two calls below are the ones its ``printdag`` makes (Snakemake is pinned).
    """
    from snakemake.api import SnakemakeApi
    from snakemake.cli import parse_config
    from snakemake.settings.types import (
        ConfigSettings,
        DAGSettings,
        OutputSettings,
        Quietness,
        ResourceSettings,
    )

    root = root.resolve()
    with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
        workflow_api = api.workflow(
            resource_settings=ResourceSettings(),
            config_settings=ConfigSettings(
                config=parse_config(list(config)), configfiles=[root / f for f in configfiles]
            ),
            snakefile=root / "Snakefile",
            workdir=root,
        )
        workflow_api.dag(DAGSettings(targets=set(targets), forceall=forceall))
        workflow = workflow_api._workflow
        workflow._prepare_dag(forceall=forceall, ignore_incomplete=True, lock_warn_only=True, nolock=True)
        workflow._build_dag()
        return workflow
