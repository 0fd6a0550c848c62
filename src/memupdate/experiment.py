"""What the workflow asks of one experiment of the checked config, answered in one place.

An :class:`Experiment` wraps an experiment's section of ``config/config.yaml`` (``experiments.<name>``, checked
when the Snakefile loads: :func:`memupdate.settings.check_config`) with the workflow's reward section over which
its own ``reward`` keys apply. Its methods are the experiment's semantics: its kind, its training stages, the reward
of a stage with ``scorer: auto`` resolved, the cold start's layout, the evaluations' settings with their defaults.
``rules/common.smk`` builds one per experiment (``EXPERIMENTS``) and its input functions turn a job's wildcards into
paths around these answers; the paths stay the workflow's.

>>> e = Experiment("demo", {"policy": "p", "stage1": {"trainer.device": "cpu"}}, {"scorer": "auto", "top_k": 5})
>>> e.scorer, e.is_memagent, [s.name for s in e.stages.values()], e.sft_layout
('answer_recall', False, ['stage1'], {'trainer.device': 'cpu'})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from memupdate.settings import (
    DEFAULT_MAX_CONTENT_CHARS,
    HAYSTACKS,
    SERVED_ROLES,
    HeadroomSettings,
    IngestionSettings,
    MemAgentLoopSettings,
    PolicyEvalSettings,
    Stage,
    build,
    experiment_stages,
)


@dataclass(frozen=True, eq=False)
class Experiment:
    """One experiment: ``name``, its config ``section`` and the workflow's ``reward`` section (its own ``reward``
    keys go over it); ``max_content_chars`` is the memory section's cap, which the LoCoMo evaluation keeps."""

    name: str
    section: Mapping[str, Any]
    workflow_reward: Mapping[str, Any]
    max_content_chars: int = DEFAULT_MAX_CONTENT_CHARS

    def _where(self, key: str) -> str:
        return f"experiments.{self.name}.{key}"

    # ------------------------------------------------------------------------------------------------ kind

    @property
    def is_memagent(self) -> bool:
        return self.section.get("kind", "memupdate") == "memagent"

    @property
    def policy(self) -> str:
        return self.section["policy"]

    @property
    def qa_model(self) -> str:
        """The QA model (a key of config ``models``); an experiment without one has no QA role to serve."""
        if "qa_model" not in self.section:
            raise ValueError(
                f"experiment {self.name!r} has no qa_model in config/config.yaml; two-stage "
                "training and serving the QA role need one"
            )
        return self.section["qa_model"]

    @property
    def has_qa_model(self) -> bool:
        return "qa_model" in self.section

    @property
    def has_cold_start(self) -> bool:
        """Whether training starts from a cold start (the ``sft`` section): its checkpoint, evaluated too."""
        return "sft" in self.section

    @property
    def is_ingestion(self) -> bool:
        """Whether the memory episodes are sessions (question-agnostic ingestion), not questions."""
        return "ingestion" in self.section

    @property
    def has_headroom_mix(self) -> bool:
        """Whether the question rows are a headroom mix (the ``headroom`` section, rule headroom_rows)."""
        return "headroom" in self.section

    # ---------------------------------------------------------------------------------------------- reward

    @property
    def reward(self) -> dict[str, Any]:
        """The reward section: the workflow's, with the experiment's own ``reward`` keys over it."""
        return {**self.workflow_reward, **self.section.get("reward", {})}

    @property
    def scorer(self) -> str:
        """reward.scorer: ``auto`` is ``reader`` with a QA model (two-stage), else the offline ``answer_recall``. A
        served scorer without a QA model fails here, before any job runs."""
        scorer = self.reward["scorer"]
        if scorer == "auto":
            return "reader" if self.has_qa_model else "answer_recall"
        if scorer in SERVED_ROLES and not self.has_qa_model:
            raise ValueError(
                f"reward.scorer {scorer!r} needs the served QA model as its reader, but experiment "
                f"{self.name!r} has no qa_model in config/config.yaml: add one, or set reward.scorer "
                "to auto, answer_recall or evidence_recall"
            )
        return scorer

    @property
    def served_judge(self) -> str | None:
        """The served name of reward.judge when the scorer asks it, else None (a memory stage's reader is its
        fixed QA role: memupdate.training.stages.stage_reward)."""
        return self.reward["judge"] if self.scorer == "judge" else None

    @property
    def plays_qa_phase(self) -> bool:
        """Whether a memory stage is trained against a served QA model answering after its memory turns: with a
        QA model and a served scorer, which reads those answers. Otherwise a memory stage is single-role
        MemoryUpdate, nothing served."""
        return self.has_qa_model and self.scorer in SERVED_ROLES

    @property
    def offline_reward(self) -> dict[str, Any]:
        """The reward settings without the served judge: what the cold start's demonstrations are scored with
        (memupdate.training.sft)."""
        return {k: v for k, v in self.reward.items() if k != "judge"}

    @property
    def training_reward(self) -> dict[str, Any]:
        """The reward manager's settings for a training stage, the scorer resolved (a memory stage's served judge
        is added by the workflow, as a marker among the stage's inputs). A QA stage is rewarded by its answer's F1;
        a served scorer has no reader there, so only an offline one adds the memory reward's components to the
        log."""
        return {**self.offline_reward, "scorer": self.scorer}

    @property
    def policy_eval_reward(self) -> dict[str, Any]:
        """The training reward of stage 1, which must be offline: the policies are compared without a served
        model."""
        if self.scorer in SERVED_ROLES:
            raise ValueError(
                f"policy_eval of {self.name!r} scores with the training reward offline, but its scorer is "
                f"{self.scorer!r}: set reward.scorer to answer_recall or evidence_recall"
            )
        return self.training_reward

    # ---------------------------------------------------------------------------------------------- stages

    @cached_property
    def stages(self) -> dict[str, Stage]:
        """The training stages by name (memupdate.settings.experiment_stages): stage1, stage2, ...; none for
        MemAgent, which trains once (its ``train`` section)."""
        if self.is_memagent:
            return {}
        return {stage.name: stage for stage in experiment_stages(self.section, f"experiments.{self.name}")}

    def stage(self, n: int | str) -> Stage:
        """Stage ``n`` (a training job's wildcard)."""
        name = f"stage{n}"
        if name not in self.stages:
            raise ValueError(
                f"experiment {self.name!r} has no {name} in config/config.yaml (its stages: "
                f"{', '.join(self.stages) or 'none'})"
            )
        return self.stages[name]

    @property
    def episode(self) -> dict[str, Any]:
        """The episode (memupdate.settings.EpisodeSettings): training, the cold start's demonstrations, the policy
        evaluation and the LoCoMo evaluation play it."""
        return self.section.get("episode", {})

    @property
    def tools(self) -> dict[str, Any]:
        """The memory tools the policy is given (memupdate.settings.ToolSettings; {}: all, full schemas)."""
        return self.section.get("tools", {})

    @property
    def sft(self) -> dict[str, Any]:
        return self.section["sft"]

    @property
    def sft_layout(self) -> dict[str, Any]:
        """Where verl's SFT trainer runs: the first training section's trainer.device (cpu: verl's cpu platform) and
        trainer.n_gpus_per_node, so the cold start runs where training will."""
        training = self.section["train" if self.is_memagent else "stage1"]
        keys = ("trainer.device", "trainer.n_gpus_per_node")
        return {k: v for k, v in training.items() if k in keys}

    @property
    def questions_per_session(self) -> int:
        section = self.section["ingestion"]
        return build(IngestionSettings, section, self._where("ingestion")).questions_per_session

    @property
    def headroom(self) -> dict[str, Any]:
        """The headroom section, every key with its default."""
        if not self.has_headroom_mix:
            raise ValueError(f"experiment {self.name!r} has no headroom section in config/config.yaml")
        return dataclasses.asdict(build(HeadroomSettings, self.section["headroom"], self._where("headroom")))

    # ----------------------------------------------------------------------------------------- evaluations

    @property
    def eval_settings(self) -> dict[str, Any]:
        """The LoCoMo evaluation's settings: it retrieves and caps memories as training is rewarded, unless the
        experiment's ``eval`` says otherwise."""
        defaults = {
            "context_chars": self.reward["context_chars"],
            "top_k": self.reward["top_k"],
            "max_content_chars": self.max_content_chars,
        }
        return {**defaults, **self.section.get("eval", {})}

    @property
    def policy_eval(self) -> dict[str, Any]:
        """The held-out policy evaluation's settings, every key with its default."""
        if "policy_eval" not in self.section:
            raise ValueError(f"experiment {self.name!r} has no policy_eval section in config/config.yaml")
        return dataclasses.asdict(build(PolicyEvalSettings, self.section["policy_eval"], self._where("policy_eval")))

    @property
    def evaluated_policies(self) -> list[str]:
        """The policies the held-out evaluation compares, in order: the base, the cold start if any, stage 1."""
        return ["base", "sft", "stage1"] if self.has_cold_start else ["base", "stage1"]

    # -------------------------------------------------------------------------------------------- MemAgent

    @property
    def memagent(self) -> Mapping[str, Any]:
        """The section of a MemAgent experiment (``kind: memagent``)."""
        if not self.is_memagent:
            raise ValueError(f"experiment {self.name!r} is not a MemAgent experiment (kind: memagent)")
        return self.section

    @property
    def haystack(self) -> str:
        """What a MemAgent experiment's haystacks are made of: ``hotpotqa`` (RULER-HotpotQA) or ``locomo`` (LoCoMo
        conversations, :mod:`memupdate.data.locomo_haystack`); their numbers are never compared."""
        return self.memagent.get("haystack", HAYSTACKS[0])

    @property
    def memagent_train(self) -> dict[str, Any]:
        """MemAgent's verl settings: its ``train`` section without ``num_docs`` (the haystack it trains on)."""
        train = dict(self.memagent["train"])
        train.pop("num_docs")
        return train

    @property
    def memagent_eval(self) -> dict[str, Any]:
        """The loop's budgets as trained, except max_chunks: evaluation reads every chunk of a haystack (as
        MemAgent's does) unless its own settings ask for truncate_chunks."""
        section = self.memagent
        settings = {k: v for k, v in section["eval"].items() if k != "num_docs"}
        loop = build(MemAgentLoopSettings, section["loop"], "loop").agent()
        loop.pop("max_chunks")
        prompt_length = section["train"].get("prompt_length")
        return {**loop, **({"prompt_length": prompt_length} if prompt_length else {}), **settings}

    @property
    def splits_memagent_train(self) -> bool:
        """Whether the cold start and GRPO play their shares of the train questions (sft.questions_percent)."""
        return self.memagent.get("sft", {}).get("questions_percent") is not None
