"""The memory tools: search, create/update, delete, merge, split and sample memories.

verl 0.9.1 builds one object per tool per worker and runs ``create -> execute -> release`` around
every single call (``verl-0.9.1.md`` §2c), so no state lives in the tool. Each call finds its
trajectory's :class:`~memupdate.memory.store.TrialStore` through the agent data: the trial namespace is
the row's base namespace (``tools_kwargs.<tool>.create_kwargs.namespace``) plus the whole
``agent_data.request_id``; an ingestion row's ``create_kwargs.sessions`` limits the store to the sessions
seen so far (:mod:`memupdate.data.ingestion`). The first call of a trajectory opens the store if the
agent loop has not; every change refreshes ``agent_data.extra_fields["memory_delta"]``, so the delta travels with the
trajectory to the reward whichever loop ran it.

Bad arguments (unknown id, empty query, wrong types, too many ids, an id written with other than the
digits 0-9, a string holding half of a surrogate pair) come back to the model as an observation that
says what to do; only infrastructure failures raise.

Two limits keep the memory reward honest (issue 14): a memory's text is at most ``max_content_chars``
characters (tool config key, from ``memory.max_content_chars``; the writing tools' schemas state it and
longer text is refused with an instruction), and a memory's evidence ids are never taken from the
model's arguments: they come from the memories it derives from (see :mod:`memupdate.memory.store`).
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
from typing import Any

from verl.experimental.agent_loop.tool_agent_loop import AgentData
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from memupdate.agents.fields import DELTA_KEY
from memupdate.memory.environment import MemoryEnvironment
from memupdate.memory.manager import MemoryStoreManager, manager_for
from memupdate.memory.store import SOURCES, InvalidMemoryOperation, TrialStore, UnknownMemoryId, content_words
from memupdate.names import DELETE_TOOL, MANAGE_TOOL, MEMORY_TOOLS, MERGE_TOOL, SAMPLE_TOOL, SEARCH_TOOL, SPLIT_TOOL
from memupdate.prompts import format_record
from memupdate.tools.config import ENVIRONMENT_KEY
from memupdate.utils.io import CONTROL_CHARACTERS, short_repr

logger = logging.getLogger(__name__)

NAMESPACE_KEY = "memory_namespace"
MAX_TOP_K = 20


class ToolArgumentError(ValueError):
    """An argument the model got wrong; the message is shown to the model as the tool's reply."""


# ----------------------------------------------------------------------------- argument checks


# The model often writes "7" or "[7]" for id 7. ASCII digits only: str.isdigit() and int() also take
# "²" (which int() then refuses) and "٣" (Arabic 3), which must not quietly name memory 3.
# At most 18 digits: int() refuses text of more than 4,300 digits with a ValueError, which is not an instruction.
_INT_TEXT = re.compile(r"\s*\[?\s*([0-9]{1,18})\s*\]?\s*")
# A lone UTF-16 surrogate (JSON "\ud800" without its pair) cannot be encoded as UTF-8: the tokenizer
# refuses it and a stored one breaks the delta's encoding later, far from the call that wrote it.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _int_arg(params: dict, name: str, *, default: int | None = None, low: int = 0, high: int | None = None) -> int:
    value = params.get(name, default)
    if value is None:
        raise ToolArgumentError(f"Missing argument '{name}'.")
    if isinstance(value, str) and (digits := _INT_TEXT.fullmatch(value)):
        value = int(digits.group(1))
    if isinstance(value, bool) or not isinstance(value, int):
        shown = short_repr(value)
        raise ToolArgumentError(f"Argument '{name}' must be an integer, got {shown}.")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ToolArgumentError(f"Argument '{name}' must be {bound}, got {value}.")
    return value


def _shown(text: str) -> str:
    """``text`` with each lone surrogate written as its escape (``\\ud800``), safe to show the model."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _check_encodable(value: Any, name: str = "") -> None:
    """Refuse a lone surrogate in any string of the arguments, names included; ``name`` is where ``value`` sits."""
    if isinstance(value, str):
        bad = _LONE_SURROGATE.search(value)
        if bad:
            raise ToolArgumentError(
                f"Argument '{name}' contains {_shown(bad.group())} at position {bad.start()}, half of a "
                "surrogate pair, which is not text: write plain text and try again."
            )
    elif isinstance(value, dict):
        for key, item in value.items():
            path = f"{name}.{key}" if name else str(key)
            if _LONE_SURROGATE.search(path):
                raise ToolArgumentError(
                    f"The argument name '{_shown(path)}' contains half of a surrogate pair, which is not text: "
                    "use the names in the tool's schema."
                )
            _check_encodable(item, path)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_encodable(item, f"{name}[{i}]")


def _text_arg(params: dict, name: str, what: str) -> str:
    value = params.get(name)
    if not isinstance(value, str) or not value.strip():
        raise ToolArgumentError(f"Argument '{name}' must be a non-empty string: {what}.")
    return value.strip()


def _id_list(params: dict, name: str, low: int, high: int) -> list[int]:
    values = params.get(name)
    if not isinstance(values, list):
        raise ToolArgumentError(f"Argument '{name}' must be a list of memory ids, like [3, 7].")
    ids = [_int_arg({name: v}, name) for v in values]
    if len(set(ids)) != len(ids):
        raise ToolArgumentError(f"Argument '{name}' repeats an id: {ids}.")
    if not low <= len(ids) <= high:
        raise ToolArgumentError(f"Argument '{name}' needs {low} to {high} ids, got {len(ids)}.")
    return ids


def _text_list(params: dict, name: str, low: int, high: int) -> list[str]:
    values = params.get(name)
    if not isinstance(values, list) or not all(isinstance(v, str) and v.strip() for v in values):
        raise ToolArgumentError(f"Argument '{name}' must be a list of non-empty strings.")
    if not low <= len(values) <= high:
        raise ToolArgumentError(f"Argument '{name}' needs {low} to {high} parts, got {len(values)}.")
    return [v.strip() for v in values]


#: The longest text each metadata key takes (what the tool's schema states): a memory's details are rendered beside
#: its content (its date in front of it), and a detail without a cap would be a second, unbounded content.
METADATA_TEXT_CAPS = {"speaker": 64, "date": 64, "type": 32}


def _metadata_arg(params: dict) -> dict[str, Any]:
    metadata = params.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ToolArgumentError('Argument \'metadata\' must be an object such as {"speaker": "Caroline"}.')
    if "evidence" in metadata:
        raise ToolArgumentError(
            "metadata 'evidence' cannot be set: a memory keeps the evidence of the memories it comes from "
            "(update keeps it, merge and split carry it over, a new memory has none). Remove it and try again."
        )
    unknown = sorted(set(metadata) - {*METADATA_TEXT_CAPS, "session"})
    if unknown:
        raise ToolArgumentError(
            f"Unknown metadata keys {unknown}; allowed: {sorted({*METADATA_TEXT_CAPS, 'session'})}."
        )
    for key, cap in METADATA_TEXT_CAPS.items():
        value = metadata.get(key)
        if value is not None and not (isinstance(value, str) and len(value) <= cap):
            raise ToolArgumentError(f"metadata '{key}' must be text of at most {cap} characters.")
        # Rendered beside the content in the reader's prompt: a NUL or other control character is no detail.
        if value is not None and CONTROL_CHARACTERS.search(value):
            raise ToolArgumentError(f"metadata '{key}' must be plain text, without control characters.")
    return metadata


def _check_length(text: str, cap: int, what: str, advice: str) -> str:
    if len(text) > cap:
        raise ToolArgumentError(f"{what} is {len(text):,} characters; the limit is {cap:,}: {advice}.")
    return text


def compact_schema(schema: dict[str, Any], description: str, **arguments: str | None) -> dict[str, Any]:
    """``schema`` cut to ``description`` and the named ``arguments``, each with its type from ``schema`` and the
    short description given (None: none). Most of a small model's prompt is tool schemas; a compact one
    costs about half the tokens (the ``compact_schemas`` switch of a memory environment).

    >>> full = {"name": "f", "description": "Long.", "parameters": {"type": "object", "properties": {
    ...     "q": {"type": "string", "description": "Long."}, "k": {"type": "integer"}}, "required": ["q"]}}
    >>> compact_schema(full, "Short.", q=None)["parameters"]
    {'type': 'object', 'properties': {'q': {'type': 'string'}}, 'required': ['q']}
    """
    properties = schema["parameters"]["properties"]
    kept = {}
    for name, text in arguments.items():
        kept[name] = {k: v for k, v in properties[name].items() if k != "description"}
        if text:
            kept[name]["description"] = text
    required = [name for name in schema["parameters"].get("required", []) if name in kept]
    return {
        "name": schema["name"],
        "description": description,
        "parameters": {"type": "object", "properties": kept, "required": required},
    }


def agent_data_for(request_id: str, sample_id: str, namespace: str) -> AgentData:
    """verl's per-trajectory state as ``ToolAgentLoop`` builds it for a LoCoMo row, for calling the tools
    outside a loop (benchmarks, tests)."""
    create = {"create_kwargs": {"sample_id": sample_id, "namespace": namespace}}
    return AgentData(
        messages=[],
        image_data=None,
        video_data=None,
        audio_data=None,
        mm_processor_kwargs=None,
        metrics={},
        request_id=request_id,
        tools_kwargs={name: create for name in MEMORY_TOOLS},
    )


# ----------------------------------------------------------------------------- base class


class MemoryTool(BaseTool):
    """Common plumbing: schema, store lookup, error handling. Subclasses implement :meth:`run`."""

    #: OpenAI function schema (name, description, parameters) of the tool. ``{max_content_chars}`` in a
    #: description is replaced by the configured cap, so the model reads the limit it is held to.
    SCHEMA: dict[str, Any] = {}
    #: The same tool told in fewer tokens (:func:`compact_schema`), for a memory environment with
    #: ``compact_schemas``; the tool accepts the same arguments either way.
    COMPACT_SCHEMA: dict[str, Any] = {}
    #: Whether the tool changes the store (then the delta is refreshed after it).
    MUTATES = False

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        """``config["environment"]`` gives the store and the cap on memory text: the run's memory-environment
        file, as the run's ``tools.yaml`` names it (:func:`memupdate.tools.config.write_tool_config`), or a
        :class:`MemoryEnvironment` itself when a tool is built in process (benchmarks, tests)."""
        # BaseTool.__init__ prints the schema on every construction; set the same fields quietly.
        self.config = config
        environment = config.get(ENVIRONMENT_KEY)
        if not environment:
            raise ValueError(
                f"memory tool config has no {ENVIRONMENT_KEY!r}: use the run's tools.yaml "
                "(memupdate.tools.config.write_tool_config), not the template memory_tools.yaml itself"
            )
        self.environment = (
            environment if isinstance(environment, MemoryEnvironment) else MemoryEnvironment.read(environment)
        )
        self.max_content_chars = self.environment.max_content_chars
        schema = self.COMPACT_SCHEMA if self.environment.compact_schemas else self.SCHEMA
        self.tool_schema = tool_schema or OpenAIFunctionToolSchema.model_validate(
            {"type": "function", "function": self._filled(schema)}
        )
        self.name = self.tool_schema.function.name
        self._manager: MemoryStoreManager | None = None

    def _filled(self, node: Any) -> Any:
        if isinstance(node, str):
            return node.replace("{max_content_chars}", str(self.max_content_chars))
        if isinstance(node, dict):
            return {key: self._filled(value) for key, value in node.items()}
        if isinstance(node, list):
            return [self._filled(value) for value in node]
        return node

    def _content(self, text: str, what: str = "content", advice: str = "write one short fact") -> str:
        """``text`` if it fits the cap; else an instruction to the model naming both lengths."""
        return _check_length(text, self.max_content_chars, what, advice)

    def use_manager(self, manager: MemoryStoreManager) -> None:
        """Serve trajectories from this manager instead of the per-process one built from ``config``
        (evaluation and benchmarks hold their own)."""
        self._manager = manager

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    @property
    def manager(self) -> MemoryStoreManager:
        return self._manager if self._manager is not None else manager_for(self.environment)

    async def store_for(self, agent_data: Any) -> TrialStore:
        """The trajectory's trial store, opened on its first tool call."""
        if agent_data is None:
            raise RuntimeError(f"tool {self.name} called without agent_data; it needs verl >= 0.9's ToolAgentLoop")
        create = (agent_data.tools_kwargs.get(self.name) or {}).get("create_kwargs") or {}
        if not create.get("namespace") or not create.get("sample_id"):
            raise RuntimeError(
                f"row has no tools_kwargs.{self.name}.create_kwargs.namespace/sample_id "
                "(rows from memupdate.data.locomo carry them)"
            )
        # exist_ok: parallel calls of one turn may all arrive before the first has opened the store.
        store = await self.manager.aopen(
            create["namespace"],
            agent_data.request_id,
            create["sample_id"],
            sessions=create.get("sessions"),
            exist_ok=True,
        )
        agent_data.extra_fields[NAMESPACE_KEY] = store.namespace
        return store

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        agent_data = kwargs.get("agent_data")
        store = await self.store_for(agent_data)
        params = parameters if isinstance(parameters, dict) else {}
        try:
            _check_encodable(params)
            text = await self.run(store, params)
            ok = True
        except ToolArgumentError as exc:
            text, ok = str(exc), False
        except UnknownMemoryId as exc:
            state = "was deleted" if exc.deleted else "does not exist"
            text, ok = f"Memory [{exc.memory_id}] {state}. Call search_memory first to get valid ids.", False
        except InvalidMemoryOperation as exc:
            text, ok = f"{exc}.".replace("..", "."), False
        if ok and self.MUTATES:
            agent_data.extra_fields[DELTA_KEY] = store.export_delta()
        return ToolResponse(text=text), 0.0, {"tool": self.name, "ok": ok}

    async def run(self, store: TrialStore, params: dict[str, Any]) -> str:
        raise NotImplementedError


# ----------------------------------------------------------------------------- the tools


class SearchMemoryTool(MemoryTool):
    SCHEMA = {
        "name": SEARCH_TOOL,
        "description": "Search the memory database by meaning. Returns the most similar memories with their ids.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "What to look for, in a few words."},
                "top_k": {"type": "integer", "description": f"How many memories to return (1-{MAX_TOP_K}, default 5)."},
                "speaker": {"type": "string", "description": "Only memories about this speaker."},
                "session": {"type": "integer", "description": "Only memories from this session number."},
                "source": {
                    "type": "string",
                    "enum": list(SOURCES),
                    "description": "Only memories of this origin ('agent' = written by you).",
                },
            },
            "required": ["query"],
        },
    }

    COMPACT_SCHEMA = compact_schema(
        SCHEMA,
        "Search memories by meaning; returns them with their ids.",
        query=None,
        top_k=f"1-{MAX_TOP_K}, default 5",
    )

    async def run(self, store, params):
        query = _text_arg(params, "query", "pass a few words describing what to look for")
        top_k = _int_arg(params, "top_k", default=5, low=1, high=MAX_TOP_K)
        filters = {k: params[k] for k in ("speaker", "session", "source") if params.get(k) not in (None, "")}
        if "session" in filters:
            filters["session"] = _int_arg(filters, "session", low=1)
        if filters.get("source", SOURCES[0]) not in SOURCES:
            raise ToolArgumentError(f"Argument 'source' must be one of {list(SOURCES)}, got {filters['source']!r}.")
        hits = await store.asearch(query, top_k, filters=filters or None)
        if not hits:
            scope = f" with filters {filters}" if filters else ""
            return f"No memories found{scope}. Try another query or fewer filters."
        lines = [format_record(hit.record) for hit in hits]
        if self.environment.search_matches:
            lines = [
                f"{line} [matches: {query_matches(query, hit.record.content)}]"
                for line, hit in zip(lines, hits, strict=True)
            ]
        return f"Found {len(hits)} memories:\n" + "\n".join(lines)


def query_matches(query: str, content: str) -> str:
    """The query's content words that ``content`` holds, in the query's order (``none`` if it holds none): what
    a search result shows with ``search_matches``.

    >>> query_matches("Where did Andrew and his girlfriend go hiking?", "Andrew went hiking with friends.")
    'andrew, hiking'
    >>> query_matches("Where did Mel paint?", "Caroline sings.")
    'none'
    """
    folded = query.casefold()
    shared = content_words(query) & content_words(content)
    return ", ".join(sorted(shared, key=folded.find)) or "none"


class ManageMemoryTool(MemoryTool):
    MUTATES = True
    SCHEMA = {
        "name": MANAGE_TOOL,
        "description": (
            "Create a new memory, or update the content or details of an existing one by its id. "
            "A memory's text is at most {max_content_chars} characters."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "operation": {"type": "string", "enum": ["create", "update"]},
                "content": {
                    "type": "string",
                    "description": "The memory text: one specific, dated fact, at most {max_content_chars} characters.",
                },
                "memory_id": {"type": "integer", "description": "Id of the memory to update (update only)."},
                "keywords": {
                    "type": "string",
                    "description": (
                        "Update only, instead of content: a few words put in front of the memory's text, so that "
                        "searches for them find it; the text itself is kept."
                    ),
                },
                "metadata": {
                    "type": "object",
                    # The caps in words, not as a schema per key: the schemas are most of a small model's prompt.
                    "description": (
                        "Optional details: speaker (at most {speaker} characters), session (a number), date (at "
                        "most {date}), type (at most {type}). Evidence is kept from the memories a memory comes from "
                        "and cannot be set."
                    ).format(**METADATA_TEXT_CAPS),
                },
            },
            "required": ["operation"],
        },
    }

    COMPACT_SCHEMA = compact_schema(
        SCHEMA,
        "Create a memory, or update one by id. Text: one dated fact, at most {max_content_chars} characters.",
        operation=None,
        content=None,
        memory_id="update only",
        keywords="update only, instead of content: words put in front of its text",
    )

    async def run(self, store, params):
        operation = params.get("operation")
        metadata = _metadata_arg(params)
        if operation == "create":
            if params.get("memory_id") is not None:
                raise ToolArgumentError("Do not pass memory_id when creating a memory; omit it and try again.")
            content = self._content(_text_arg(params, "content", "the text of the new memory"))
            new_id = await store.acreate(content, metadata)
            return f"Created memory {format_record(store.get(new_id))}"
        if operation == "update":
            memory_id = _int_arg(params, "memory_id")
            content, keywords = params.get("content"), params.get("keywords")
            if content is not None and keywords is not None:
                raise ToolArgumentError("Pass either 'content' (the new text) or 'keywords' (put in front), not both.")
            if content is not None:
                content = self._content(_text_arg(params, "content", "the new text of the memory"))
            elif keywords is not None:
                keywords = _text_arg(params, "keywords", "a few words to put in front of the memory's text")
                content = self._content(
                    f"{keywords}: {store.get(memory_id).content}", "text with the keywords", "use fewer keywords"
                )
            if content is None and not metadata:
                raise ToolArgumentError("Nothing to update: pass new 'content', 'keywords' and/or 'metadata'.")
            await store.aupdate(memory_id, content=content, metadata=metadata or None)
            return f"Updated memory {format_record(store.get(memory_id))}"
        raise ToolArgumentError("Argument 'operation' must be 'create' or 'update'.")


class DeleteMemoryTool(MemoryTool):
    MUTATES = True
    SCHEMA = {
        "name": DELETE_TOOL,
        "description": "Delete a wrong, duplicated or useless memory by its id.",
        "parameters": {
            "type": "object",
            "properties": {
                "memory_id": {"type": "integer", "description": "Id of the memory to delete."},
                "reason": {"type": "string", "description": "Why it should go (for the log)."},
            },
            "required": ["memory_id"],
        },
    }

    COMPACT_SCHEMA = compact_schema(SCHEMA, "Delete a memory by id.", memory_id=None)

    async def run(self, store, params):
        memory_id = _int_arg(params, "memory_id")
        record = store.delete(memory_id)
        logger.debug("deleted [%d] (%s): %s", memory_id, params.get("reason", ""), record.content)
        return f"Deleted memory [{memory_id}]. {len(store)} memories remain."


class MergeMemoryTool(MemoryTool):
    MUTATES = True
    SCHEMA = {
        "name": MERGE_TOOL,
        "description": (
            "Replace 2 to 5 related memories by one memory whose text you write, at most {max_content_chars} "
            "characters."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "memory_ids": {"type": "array", "items": {"type": "integer"}, "description": "2 to 5 ids."},
                "content": {
                    "type": "string",
                    "description": "The merged memory, keeping every fact that matters, at most {max_content_chars} characters.",
                },
            },
            "required": ["memory_ids", "content"],
        },
    }

    COMPACT_SCHEMA = compact_schema(
        SCHEMA,
        "Replace 2-5 memories by one whose text you write, at most {max_content_chars} characters.",
        memory_ids="2-5 ids",
        content=None,
    )

    async def run(self, store, params):
        ids = _id_list(params, "memory_ids", 2, 5)
        content = self._content(
            _text_arg(params, "content", "the text of the merged memory"),
            advice="keep only the facts that matter, or merge fewer memories",
        )
        new_id = await store.amerge(ids, content)
        return f"Merged {', '.join(f'[{i}]' for i in ids)} into {format_record(store.get(new_id))}"


class SplitMemoryTool(MemoryTool):
    MUTATES = True
    SCHEMA = {
        "name": SPLIT_TOOL,
        "description": (
            "Replace one memory that mixes several facts by 2 to 5 memories whose texts you write, each at "
            "most {max_content_chars} characters."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "memory_id": {"type": "integer", "description": "Id of the memory to split."},
                "parts": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "2 to 5 new memory texts, each at most {max_content_chars} characters.",
                },
            },
            "required": ["memory_id", "parts"],
        },
    }

    COMPACT_SCHEMA = compact_schema(
        SCHEMA,
        "Replace one memory by 2-5 whose texts you write, each at most {max_content_chars} characters.",
        memory_id=None,
        parts="2-5 texts",
    )

    async def run(self, store, params):
        memory_id = _int_arg(params, "memory_id")
        parts = _text_list(params, "parts", 2, 5)
        for i, part in enumerate(parts, start=1):
            self._content(part, f"part {i}", "write one short fact per part")
        new_ids = await store.asplit(memory_id, parts)
        return f"Split [{memory_id}] into:\n" + "\n".join(format_record(store.get(i)) for i in new_ids)


class SampleMemoryTool(MemoryTool):
    SCHEMA = {
        "name": SAMPLE_TOOL,
        "description": "List some memories to get an overview of the database.",
        "parameters": {
            "type": "object",
            "properties": {
                "k": {"type": "integer", "description": f"How many memories (1-{MAX_TOP_K}, default 5)."},
                "strategy": {
                    "type": "string",
                    "enum": ["random", "diverse", "recent"],
                    "description": "random; diverse (spread over the whole database); recent (latest sessions and your own).",
                },
            },
            "required": [],
        },
    }

    COMPACT_SCHEMA = compact_schema(SCHEMA, "List some memories for an overview.", k=f"1-{MAX_TOP_K}, default 5")

    async def run(self, store, params):
        k = _int_arg(params, "k", default=5, low=1, high=MAX_TOP_K)
        strategy = params.get("strategy") or "random"
        # Records in id order: base memories follow the conversation, created ones come last.
        records = sorted(store.records(), key=lambda r: r.id)
        if not records:
            return "The memory database is empty. Create memories with manage_memory."
        k = min(k, len(records))
        if strategy == "random":
            # Seeded by the trial and its size so a rollout is reproducible.
            seed = hashlib.sha256(f"{store.namespace}:{len(records)}".encode()).hexdigest()
            chosen = sorted(random.Random(seed).sample(records, k), key=lambda r: r.id)
        elif strategy == "diverse":
            chosen = (
                [records[round(i * (len(records) - 1) / max(k - 1, 1))] for i in range(k)] if k > 1 else records[:1]
            )
        elif strategy == "recent":
            chosen = records[-k:]
        else:
            raise ToolArgumentError("Argument 'strategy' must be 'random', 'diverse' or 'recent'.")
        return f"{k} of {len(records)} memories ({strategy}):\n" + "\n".join(format_record(r) for r in chosen)


TOOL_CLASSES = (
    SearchMemoryTool,
    ManageMemoryTool,
    DeleteMemoryTool,
    MergeMemoryTool,
    SplitMemoryTool,
    SampleMemoryTool,
)
