"""A run's copy of the memory tools' verl config (``multi_turn.tool_config_path``).

:data:`TOOL_CONFIG` (``memory_tools.yaml``, shipped with the package) lists the tools once, without data.
A run writes ``<run>/tools.yaml``:
the same tools, each told where the run's :class:`~memupdate.memory.environment.MemoryEnvironment` file is
(``environment``), so every worker that builds the tools, on any node, reads the same typed record.
This module imports nothing of verl: the verl launcher writes the copy before verl starts.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from memupdate.utils.io import write_text_atomic

#: The memory tools' config template.
TOOL_CONFIG = Path(__file__).with_name("memory_tools.yaml")
#: The tools' config key holding the memory-environment file.
ENVIRONMENT_KEY = "environment"
FILE_NAME = "tools.yaml"


def write_tool_config(
    template: str | os.PathLike, environment: str | os.PathLike, directory: str | os.PathLike
) -> Path:
    """Write ``<directory>/tools.yaml``: ``template``'s tools, each with ``environment`` (an absolute path)
    in its config; returns its absolute path. A template that is not a verl tool list fails here, naming
    the file, not in a worker."""
    template = Path(template)
    try:
        conf = yaml.safe_load(template.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"{template}: cannot read the tool config: {err}") from None
    tools = conf.get("tools") if isinstance(conf, dict) else None
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{template}: expected a non-empty list under 'tools' (verl's tool config format)")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not tool.get("class_name"):
            raise ValueError(f"{template}: tools[{i}] needs a class_name")
        tool["config"] = {"type": "native", **(tool.get("config") or {}), ENVIRONMENT_KEY: os.path.abspath(environment)}
    path = Path(directory).resolve() / FILE_NAME
    write_text_atomic(path, yaml.safe_dump(conf, sort_keys=False))
    return path
