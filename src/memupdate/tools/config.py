"""A run's copy of the memory tools' verl config (``multi_turn.tool_config_path``).

:data:`TOOL_CONFIG` (``memory_tools.yaml``, shipped with the package) lists the tools once, without data.
A run writes ``<run>/tools.yaml``:
the tools its :class:`~memupdate.memory.environment.MemoryEnvironment` names (``tools``), each told where the
run's environment file is (``environment``), so every worker that builds the tools, on any node, reads the
same typed record.
This module imports nothing of verl: the verl launcher writes the copy before verl starts.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from memupdate.memory.environment import MemoryEnvironment
from memupdate.utils.io import write_text_atomic

#: The memory tools' config template.
TOOL_CONFIG = Path(__file__).with_name("memory_tools.yaml")
#: The tools' config key holding the memory-environment file.
ENVIRONMENT_KEY = "environment"
FILE_NAME = "tools.yaml"


def write_tool_config(
    template: str | os.PathLike, environment: str | os.PathLike, directory: str | os.PathLike
) -> Path:
    """Write ``<directory>/tools.yaml``: those of ``template``'s tools that the memory environment written at
    ``environment`` names, in the template's order, each with ``environment`` (an absolute path) in its
    config; returns its absolute path. A template that is not a verl tool list, or lacks a tool the
    environment names, fails here, naming the file, not in a worker."""
    template = Path(template)
    try:
        conf = yaml.safe_load(template.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"{template}: cannot read the tool config: {err}") from None
    tools = conf.get("tools") if isinstance(conf, dict) else None
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{template}: expected a non-empty list under 'tools' (verl's tool config format)")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not tool.get("class_name") or not tool.get("name"):
            raise ValueError(f"{template}: tools[{i}] needs a name and a class_name")
        tool["config"] = {"type": "native", **(tool.get("config") or {}), ENVIRONMENT_KEY: os.path.abspath(environment)}
    wanted = MemoryEnvironment.read(environment).tools
    missing = sorted(set(wanted) - {tool["name"] for tool in tools})
    if missing:
        raise ValueError(f"{template}: the memory environment {environment} names tools {missing} that it lacks")
    conf["tools"] = [tool for tool in tools if tool["name"] in wanted]
    path = Path(directory).resolve() / FILE_NAME
    write_text_atomic(path, yaml.safe_dump(conf, sort_keys=False))
    return path
