"""The dress rehearsal: the experiments verl trains on GPUs as they are composed, with only what a CPU cluster
cannot run swapped (config ``rehearsal``; ``--config scale=full rehearse=true`` switches it on).

Everything the swaps do not name stays the GPU run's: the validation files and their sampling, the refill cap,
checkpoint retention, the resume guard, the Slurm placement of every job and server, the reward. The CI Slurm
cluster plays a rehearsal of the full scale (tests/slurm); docs/cluster.md lists what a GPU run changes beyond it.
The swaps are applied where the scale's own settings are (:func:`memupdate.settings.check_config`), so the
validation, the plan and every job see the rehearsed config, and the Snakefile prints them on every run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any


def apply_rehearsal(
    config: dict[str, Any],
    verl_sections: Callable[[Mapping[str, Any]], list[str]],
    on_gpus: Callable[[Mapping[str, Any]], bool],
) -> list[str]:
    """Swap what ``config['rehearsal']`` names into ``config`` in place, if ``config['rehearse']``; return one line
    per swapped key, its old values and its new one (empty when not rehearsing).

    The section's shape is :class:`memupdate.settings.RehearsalSettings`', checked before this runs.
    ``verl_sections(experiment)``: the sections of an experiment that hold verl keys (a MemoryUpdate experiment's
    stages, MemAgent's ``train``). Only the experiments trained on GPUs are swapped (``on_gpus(experiment)``: a
    training job of theirs asks for GPUs in profiles/slurm/resources.yaml); the others run on CPUs already.

    >>> config = {
    ...     "rehearse": True,
    ...     "rehearsal": {"model": "tiny", "settings": {"serving": {"engine": "vllm-cpu"}},
    ...                   "verl": {"data.train_batch_size": 2}, "episode": {"response_length": 512}},
    ...     "serving": {"engine": "vllm", "dtype": "bfloat16"},
    ...     "experiments": {"big": {"policy": "qwen", "stage1": {"data.train_batch_size": 32}},
    ...                     "cpu": {"policy": "small", "stage1": {}}},
    ... }
    >>> for line in apply_rehearsal(config, lambda e: ["stage1"], lambda e: e["policy"] == "qwen"): print(line)
    models: qwen -> tiny (policy/qa_model of 1 experiment)
    serving.engine: vllm -> vllm-cpu
    verl data.train_batch_size: 32 -> 2
    episode.response_length: (its config's) -> 512
    >>> config["experiments"]["big"]["stage1"], config["experiments"]["cpu"]["policy"]
    ({'data.train_batch_size': 2}, 'small')
    >>> config["experiments"]["big"]["episode"]
    {'response_length': 512}
    """
    if not config.get("rehearse"):
        return []
    spec = config["rehearsal"]
    swaps: dict[str, tuple[list[Any], Any]] = {}

    def swap(label: str, old: Any, new: Any) -> None:
        if old != new:
            olds, _ = swaps.setdefault(label, ([], new))
            if old not in olds:
                olds.append(old)

    for path, new in _leaves(spec.get("settings") or {}):
        node = config
        for key in path[:-1]:
            node = node.setdefault(key, {})
        swap(".".join(path), node.get(path[-1], _UNSET), new)
        node[path[-1]] = copy.deepcopy(new)
    rehearsed = [
        experiment
        for experiment in config.get("experiments", {}).values()
        if isinstance(experiment, dict) and on_gpus(experiment)
    ]
    model = spec.get("model")
    swapped_models = 0
    for experiment in rehearsed:
        if model:
            roles = [role for role in ("policy", "qa_model") if role in experiment and experiment[role] != model]
            for role in roles:
                swap("models", experiment[role], model)
                experiment[role] = model
            swapped_models += bool(roles)
        for section in verl_sections(experiment):
            if not isinstance(experiment.get(section), dict):
                continue
            for key, new in (spec.get("verl") or {}).items():
                swap(f"verl {key}", experiment[section].get(key, _UNSET), new)
                experiment[section][key] = new
        if experiment.get("kind", "memupdate") == "memupdate":
            for key, new in (spec.get("episode") or {}).items():
                swap(f"episode.{key}", (experiment.get("episode") or {}).get(key, _UNSET), new)
                experiment.setdefault("episode", {})[key] = new
        if experiment.get("kind") == "memagent":
            for section, keys in (("loop", "memagent_loop"), ("train", "memagent_train")):
                for key, new in (spec.get(keys) or {}).items():
                    swap(f"memagent {section}.{key}", (experiment.get(section) or {}).get(key, _UNSET), new)
                    experiment.setdefault(section, {})[key] = new
    lines = []
    for label, (olds, new) in swaps.items():
        shown = ", ".join(sorted({_show(o) for o in olds}))
        if label == "models":
            plural = "s" if swapped_models != 1 else ""
            lines.append(f"models: {shown} -> {new} (policy/qa_model of {swapped_models} experiment{plural})")
        else:
            lines.append(f"{label}: {shown} -> {_show(new)}")
    # The models first: the swap a reader looks for.
    return sorted(lines, key=lambda line: not line.startswith("models:"))


class _Unset:
    def __repr__(self) -> str:
        return "(its config's)"


_UNSET = _Unset()


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, _Unset) else "null" if value is None else str(value)


def _leaves(node: Mapping[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for key, value in node.items():
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key), value
