import asyncio
import dataclasses
import json

import pytest
from verl.tools.tool_registry import initialize_tools_from_config

from memupdate.memory.environment import MemoryEnvironment, MemoryEnvironmentError
from memupdate.memory.manager import manager_for
from memupdate.names import MEMORY_TOOLS
from memupdate.settings import DEFAULT_MAX_CONTENT_CHARS
from memupdate.tools.config import TOOL_CONFIG, write_tool_config
from memupdate.tools.memory_tools import (
    DELTA_KEY,
    NAMESPACE_KEY,
    TOOL_CLASSES,
    ManageMemoryTool,
    agent_data_for,
    format_record,
)

BASE_NS = "conv-26-qa0-ff702917"


@pytest.fixture(scope="module")
def environment(memories_parquet, cache_dir, embedder):
    return MemoryEnvironment(memories=memories_parquet, embeddings=cache_dir, embedding_model=embedder.model_name)


@pytest.fixture(scope="module")
def tool_config(environment, tmp_path_factory):
    """A tool's config as a run's tools.yaml gives it: the run's memory-environment file."""
    return {"type": "native", "environment": str(environment.write(tmp_path_factory.mktemp("run")))}


@pytest.fixture(scope="module")
def tools(tool_config):
    return {cls.SCHEMA["name"]: cls(tool_config) for cls in TOOL_CLASSES}


_counter = iter(range(10**6))


def new_agent_data(request_id=None):
    return agent_data_for(request_id or f"{next(_counter):08x}deadbeef", "conv-26", BASE_NS)


def call(tools, agent_data, name, **params):
    response, reward, metrics = asyncio.run(tools[name].execute("instance", params, agent_data=agent_data))
    assert reward == 0.0 and metrics["tool"] == name
    return response.text, metrics["ok"]


def test_tools_load_through_verls_registry_from_a_runs_copy_of_the_shipped_yaml(
    repo_root, environment, tool_config, tmp_path
):
    path = write_tool_config(TOOL_CONFIG, tool_config["environment"], tmp_path)
    loaded = initialize_tools_from_config(str(path))
    assert [t.name for t in loaded] == list(MEMORY_TOOLS)
    assert all(t.environment == environment and t.manager is manager_for(environment) for t in loaded)
    schema = loaded[0].get_openai_tool_schema().model_dump()
    assert schema["function"]["parameters"]["required"] == ["query"]


def test_search_shows_short_ids_and_details(tools):
    text, ok = call(tools, new_agent_data(), "search_memory", query="LGBTQ support group", top_k=3)
    assert ok and text.startswith("Found 3 memories:")
    first = text.splitlines()[1]
    assert first.startswith(
        "[0] (Caroline, session 1, 1:56 pm on 8 May, 2023) Caroline attended an LGBTQ support group"
    )


def test_search_names_the_querys_words_each_result_holds_where_its_environment_says(environment, tmp_path):
    """The ids and texts a search shows stay as they are; with ``search_matches`` each line also names the query's
    content words it holds, the highlight a small policy can choose a memory by."""
    plain = {
        cls.SCHEMA["name"]: cls({"type": "native", "environment": str(environment.write(tmp_path))})
        for cls in TOOL_CLASSES
    }
    marked_env = dataclasses.replace(environment, search_matches=True).write(tmp_path / "marked")
    marked = {cls.SCHEMA["name"]: cls({"type": "native", "environment": str(marked_env)}) for cls in TOOL_CLASSES}
    query = "When did Caroline go to the LGBTQ support group?"
    before, ok = call(plain, new_agent_data(), "search_memory", query=query, top_k=5)
    after, ok_too = call(marked, new_agent_data(), "search_memory", query=query, top_k=5)
    assert ok and ok_too and "[matches:" not in before
    for line, marked_line in zip(before.splitlines()[1:], after.splitlines()[1:], strict=True):
        assert marked_line.startswith(line + " [matches: ")
    # The memory the question is about holds more of its words than the one ranked above it.
    lines = {line.split("]", 1)[0]: line for line in after.splitlines()[1:]}
    assert lines["[0"].endswith("[matches: caroline, lgbtq, support, group]"), after
    assert lines["[82"].endswith("[matches: caroline, lgbtq, group]"), after


def test_search_filters(tools):
    text, ok = call(tools, new_agent_data(), "search_memory", query="painting", top_k=20, speaker="Melanie", session=2)
    assert ok
    lines = text.splitlines()[1:]
    assert lines and all("(Melanie, session 2," in line for line in lines)
    text, ok = call(tools, new_agent_data(), "search_memory", query="painting", source="agent")
    assert ok and text.startswith("No memories found with filters {'source': 'agent'}")


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"query": "  "}, "Argument 'query' must be a non-empty string"),
        ({}, "Argument 'query' must be a non-empty string"),
        ({"query": "x", "top_k": "five"}, "Argument 'top_k' must be an integer, got 'five'"),
        ({"query": "x", "top_k": 500}, "Argument 'top_k' must be between 1 and 20, got 500"),
        ({"query": "x", "source": "rumour"}, "source"),
    ],
)
def test_search_bad_arguments_are_instructions(tools, params, message):
    text, ok = call(tools, new_agent_data(), "search_memory", **params)
    assert not ok and message in text


def test_create_update_delete_change_the_store_and_the_delta(tools):
    agent = new_agent_data()
    text, ok = call(
        tools,
        agent,
        "manage_memory",
        operation="create",
        content="Caroline went to an LGBTQ support group on 7 May 2023.",
        metadata={"speaker": "Caroline"},
    )
    assert ok and text.startswith("Created memory [184] (Caroline)")
    assert agent.extra_fields[NAMESPACE_KEY] == f"{BASE_NS}-{agent.request_id}"
    delta = agent.extra_fields[DELTA_KEY]
    assert [r["id"] for r in delta["created"]] == [184] and delta["created"][0]["source"] == "agent"
    json.dumps(delta)  # travels with the trajectory: must be JSON

    text, _ = call(tools, agent, "search_memory", query="When did Caroline go to the support group?", top_k=1)
    assert text.splitlines()[1].startswith("[184]")

    text, ok = call(
        tools,
        agent,
        "manage_memory",
        operation="update",
        memory_id="[0]",
        content="Caroline first attended an LGBTQ support group on 7 May 2023.",
    )
    assert ok and text.startswith("Updated memory [0]") and "first attended" in text
    text, ok = call(tools, agent, "delete_memory", memory_id=184, reason="duplicate of [0]")
    assert ok and text == "Deleted memory [184]. 184 memories remain."
    delta = agent.extra_fields[DELTA_KEY]
    assert delta["deleted"] == [184] and [r["id"] for r in delta["updated"]] == [0]
    text, ok = call(tools, agent, "delete_memory", memory_id=184)
    assert not ok and text == "Memory [184] was deleted. Call search_memory first to get valid ids."


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (
            {"operation": "update", "memory_id": 999, "content": "x"},
            "Memory [999] does not exist. Call search_memory first",
        ),
        ({"operation": "create", "content": "x", "memory_id": 3}, "Do not pass memory_id when creating"),
        ({"operation": "create"}, "Argument 'content' must be a non-empty string"),
        ({"operation": "update", "memory_id": 3}, "Nothing to update"),
        ({"operation": "remove", "content": "x"}, "'operation' must be 'create' or 'update'"),
        ({"operation": "create", "content": "x", "metadata": {"mood": "sad"}}, "Unknown metadata keys ['mood']"),
        ({"operation": "create", "content": "x", "metadata": "Caroline"}, "'metadata' must be an object"),
        # A detail is rendered beside the content: uncapped, it was a second, unbounded content (issue 37).
        (
            {"operation": "create", "content": "x", "metadata": {"date": "8 May " * 20_000}},
            "metadata 'date' must be text of at most 64 characters",
        ),
        # A NUL in a detail reached the reader's prompt (issue 58).
        (
            {"operation": "create", "content": "x", "metadata": {"speaker": "Caro\x00line"}},
            "metadata 'speaker' must be plain text, without control characters",
        ),
        (
            {"operation": "create", "content": "x", "metadata": {"session": -3}},
            "session must be 0 or more, got -3",
        ),
        ({"operation": "update", "memory_id": True, "content": "x"}, "'memory_id' must be an integer, got True"),
        ({"operation": "update", "memory_id": 3, "content": "x", "keywords": "y"}, "either 'content'"),
        ({"operation": "update", "memory_id": 3, "keywords": " "}, "Argument 'keywords' must be a non-empty string"),
        (
            {"operation": "update", "memory_id": 3, "keywords": "word " * 80},
            "the limit is 300: use fewer keywords",
        ),
    ],
)
def test_manage_bad_arguments_are_instructions(tools, params, message):
    agent = new_agent_data()
    text, ok = call(tools, agent, "manage_memory", **params)
    assert not ok and message in text
    assert DELTA_KEY not in agent.extra_fields


#: A merge of memories 0 and 1 of conv-26 that keeps both texts, and its split back: they keep the evidence.
MERGED_0_1 = "Caroline attended an LGBTQ support group recently and found the transgender stories inspiring; it made her feel accepted and gave her courage to embrace herself."
SPLIT_MERGED = [
    "Caroline attended an LGBTQ support group recently and found the transgender stories inspiring.",
    "It made her feel accepted and gave her courage to embrace herself.",
]


def test_merge_and_split(tools):
    agent = new_agent_data()
    text, ok = call(tools, agent, "merge_memory", memory_ids=[0, 1], content=MERGED_0_1)
    assert ok and text.startswith("Merged [0], [1] into [184]")
    merged = tools["merge_memory"].manager.get(agent.extra_fields[NAMESPACE_KEY]).get(184)
    assert set(merged.evidence) == {"D1:3", "D1:7"}
    text, ok = call(tools, agent, "split_memory", memory_id=184, parts=SPLIT_MERGED)
    assert ok and "[185]" in text and "[186]" in text
    delta = agent.extra_fields[DELTA_KEY]
    assert delta["ops"]["merge"] == 1 and delta["ops"]["split"] == 1 and 0 in delta["deleted"]


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("merge_memory", {"memory_ids": [0], "content": "x"}, "needs 2 to 5 ids, got 1"),
        ("merge_memory", {"memory_ids": [0, 1, 2, 3, 4, 5], "content": "x"}, "needs 2 to 5 ids, got 6"),
        ("merge_memory", {"memory_ids": [0, 0], "content": "x"}, "repeats an id"),
        ("merge_memory", {"memory_ids": "0,1", "content": "x"}, "must be a list of memory ids"),
        ("merge_memory", {"memory_ids": [0, 999], "content": "x"}, "Memory [999] does not exist"),
        ("split_memory", {"memory_id": 0, "parts": ["only one"]}, "needs 2 to 5 parts, got 1"),
        ("split_memory", {"memory_id": 0, "parts": ["a", ""]}, "list of non-empty strings"),
        ("sample_memory", {"strategy": "best"}, "'strategy' must be 'random', 'diverse' or 'recent'"),
        ("delete_memory", {}, "Missing argument 'memory_id'"),
    ],
)
def test_other_bad_arguments_are_instructions(tools, name, params, message):
    text, ok = call(tools, new_agent_data(), name, **params)
    assert not ok and message in text


def test_sample_strategies(tools):
    agent = new_agent_data("0badc0de00000000")
    text, _ = call(tools, agent, "sample_memory", k=3, strategy="random")
    again, _ = call(tools, agent, "sample_memory", k=3, strategy="random")
    assert text == again and text.startswith("3 of 184 memories (random):")
    text, _ = call(tools, agent, "sample_memory", k=3, strategy="diverse")
    assert [line.split("]")[0] for line in text.splitlines()[1:]] == ["[0", "[92", "[183"]
    call(tools, agent, "manage_memory", operation="create", content="Melanie plans a camping trip in July.")
    text, _ = call(tools, agent, "sample_memory", k=2, strategy="recent")
    assert text.splitlines()[-1].startswith("[184]")


def test_trajectories_are_isolated_and_parallel_first_calls_are_safe(tools, base):
    async def trajectory(i):
        agent = new_agent_data(f"{i:08x}cafecafe")
        # A turn with several parallel calls, the first of the trajectory: all race to open the store.
        await asyncio.gather(
            tools["search_memory"].execute("x", {"query": "support group"}, agent_data=agent),
            tools["manage_memory"].execute(
                "x", {"operation": "create", "content": f"fact number {i}"}, agent_data=agent
            ),
            tools["sample_memory"].execute("x", {"k": 2}, agent_data=agent),
        )
        return agent

    async def main():
        return await asyncio.gather(*(trajectory(i) for i in range(16)))

    agents = asyncio.run(main())
    manager = tools["search_memory"].manager
    for i, agent in enumerate(agents):
        store = manager.get(agent.extra_fields[NAMESPACE_KEY])
        created = [r.content for r in store.records() if r.source == "agent"]
        assert created == [f"fact number {i}"]
    assert len(base) == 184 and all(r.source == "observation" for r in base.records)


def test_format_record_truncates_long_content():
    from memupdate.memory.store import MemoryRecord

    record = MemoryRecord(3, "x" * 400, speaker="Ana")
    assert format_record(record) == "[3] (Ana) " + "x" * 300 + "..."


# ----------------------------------------------------------------------------------- issue 14: honest writes

WRITING_TOOLS = ("manage_memory", "merge_memory", "split_memory")


def store_of(tools, agent):
    return tools["search_memory"].manager.get(agent.extra_fields[NAMESPACE_KEY])


def test_the_content_cap_comes_from_the_environment_and_is_stated_in_every_writing_schema(
    repo_root, environment, tmp_path
):
    template = TOOL_CONFIG
    default = {
        t.name: t
        for t in initialize_tools_from_config(str(write_tool_config(template, environment.write(tmp_path), tmp_path)))
    }
    assert all(default[name].max_content_chars == DEFAULT_MAX_CONTENT_CHARS == 300 for name in WRITING_TOOLS)
    capped = dataclasses.replace(environment, max_content_chars=120).write(tmp_path / "capped")
    loaded = {
        t.name: t for t in initialize_tools_from_config(str(write_tool_config(template, capped, tmp_path / "capped")))
    }
    for name in WRITING_TOOLS:
        schema = json.dumps(loaded[name].get_openai_tool_schema().model_dump())
        assert loaded[name].max_content_chars == 120 and "at most 120 characters" in schema, name
        assert "{max_content_chars}" not in schema


@pytest.mark.parametrize("value", [0, -5, "many", 2.5, True])
def test_a_bad_content_cap_fails_naming_the_file_and_field(environment, tmp_path, value):
    path = environment.write(tmp_path)
    path.write_text(json.dumps({**json.loads(path.read_text()), "max_content_chars": value}))
    with pytest.raises(
        MemoryEnvironmentError, match=f"{path}: memory environment: max_content_chars must be a positive"
    ):
        ManageMemoryTool({"environment": str(path)})


def test_a_tool_without_an_environment_says_where_it_comes_from(tmp_path):
    with pytest.raises(ValueError, match="no 'environment': use the run's tools.yaml"):
        ManageMemoryTool({"type": "native"})
    with pytest.raises(MemoryEnvironmentError, match="no memory environment here"):
        ManageMemoryTool({"environment": str(tmp_path / "memory_environment.json")})


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        (
            "manage_memory",
            {"operation": "create", "content": "x" * 301},
            "content is 301 characters; the limit is 300: write one short fact.",
        ),
        (
            "manage_memory",
            {"operation": "update", "memory_id": 0, "content": "y" * 1234},
            "content is 1,234 characters; the limit is 300: write one short fact.",
        ),
        (
            "merge_memory",
            {"memory_ids": [0, 1], "content": "z" * 400},
            "content is 400 characters; the limit is 300: keep only the facts that matter, or merge fewer memories.",
        ),
        (
            "split_memory",
            {"memory_id": 0, "parts": ["short fact", "w" * 350]},
            "part 2 is 350 characters; the limit is 300: write one short fact per part.",
        ),
    ],
)
def test_over_long_content_is_refused_with_an_instruction(tools, name, params, message):
    agent = new_agent_data()
    text, ok = call(tools, agent, name, **params)
    assert not ok and text == message
    assert DELTA_KEY not in agent.extra_fields and len(store_of(tools, agent)) == 184


def test_content_at_the_cap_is_accepted(tools):
    agent = new_agent_data()
    text, ok = call(tools, agent, "manage_memory", operation="create", content="c" * 300)
    assert ok and len(store_of(tools, agent).get(184).content) == 300


def test_evidence_comes_only_from_the_memories_a_memory_derives_from(tools):
    """No writing tool takes evidence ids from its arguments, in metadata or anywhere else."""
    agent = new_agent_data()
    store_for = lambda: store_of(tools, agent)  # noqa: E731
    cited = ["D1:3", "D99:1", "D98:7"]  # the last two cited by no observation
    text, ok = call(
        tools, agent, "manage_memory", operation="create", content="Caroline likes tea.", metadata={"evidence": cited}
    )
    assert not ok and text.startswith("metadata 'evidence' cannot be set") and "Remove it and try again" in text
    # An argument the schema does not have is not read.
    _, ok = call(tools, agent, "manage_memory", operation="create", content="Caroline likes tea.", evidence=cited)
    assert ok and store_for().get(184).evidence == ()

    original = store_for().get(0).evidence
    assert original == ("D1:3",)
    text, ok = call(tools, agent, "manage_memory", operation="update", memory_id=0, metadata={"evidence": cited})
    assert not ok and text.startswith("metadata 'evidence' cannot be set")
    _, ok = call(
        tools,
        agent,
        "manage_memory",
        operation="update",
        memory_id=0,
        content="1:56 pm on 8 May, 2023: " + store_for().get(0).content,
        evidence=cited,
    )
    assert ok and store_for().get(0).evidence == original, "update keeps the original's evidence"

    _, ok = call(
        tools,
        agent,
        "merge_memory",
        memory_ids=[0, 1],
        content=MERGED_0_1,
        evidence=cited,
        metadata={"evidence": cited},
    )
    assert ok and store_for().get(185).evidence == ("D1:3", "D1:7"), "merge: the union of its sources' evidence"
    _, ok = call(
        tools,
        agent,
        "split_memory",
        memory_id=185,
        parts=SPLIT_MERGED,
        evidence=cited,
        metadata={"evidence": cited},
    )
    assert ok and [store_for().get(i).evidence for i in (186, 187)] == [("D1:3", "D1:7")] * 2
    assert all(not set(cited[1:]) & set(r.evidence) for r in store_for().records())


# ----------------------------------------------------------------------------------- issue 15: hostile arguments


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("delete_memory", {"memory_id": "²"}),  # isdigit() but int() raises: was an uncaught ValueError
        ("delete_memory", {"memory_id": "٣"}),  # Arabic 3: deleted memory 3
        ("delete_memory", {"memory_id": "[٣]"}),
        ("manage_memory", {"operation": "update", "memory_id": "３", "content": "x"}),  # fullwidth 3
        ("merge_memory", {"memory_ids": ["٣", "4"], "content": "x"}),
        ("split_memory", {"memory_id": "٣", "parts": ["a", "b"]}),
        ("search_memory", {"query": "x", "top_k": "٣"}),
        ("sample_memory", {"k": "²"}),
        # More than int() reads from text (4,300 digits): was a ValueError out of the tool (issue 37).
        ("delete_memory", {"memory_id": "3" * 5000}),
        ("merge_memory", {"memory_ids": ["4", "3" * 5000], "content": "x"}),
    ],
)
def test_ids_written_with_other_than_ascii_digits_are_instructions(tools, name, params):
    agent = new_agent_data()
    text, ok = call(tools, agent, name, **params)
    assert not ok and "must be an integer, got" in text
    assert DELTA_KEY not in agent.extra_fields and 3 in store_of(tools, agent) and len(store_of(tools, agent)) == 184


def test_ids_written_as_ascii_digits_still_work(tools):
    agent = new_agent_data()
    assert call(tools, agent, "delete_memory", memory_id=" [3] ")[1]
    assert call(tools, agent, "merge_memory", memory_ids=["4", 5], content="Merged.")[1]
    assert not {3, 4, 5} & set(r.id for r in store_of(tools, agent).records())


def test_a_session_written_with_an_arabic_digit_is_an_instruction(tools):
    agent = new_agent_data()
    text, ok = call(tools, agent, "manage_memory", operation="create", content="x", metadata={"session": "٣"})
    assert not ok and text == "session must be an integer or null, got '٣'."
    assert DELTA_KEY not in agent.extra_fields


@pytest.mark.parametrize(
    ("name", "params", "where"),
    [
        (
            "manage_memory",
            {"operation": "create", "content": "Caroline \ud800 likes tea."},
            "'content' contains \\ud800 at position 9",
        ),
        (
            "manage_memory",
            {"operation": "create", "content": "ok", "metadata": {"speaker": "\udc00"}},
            "'metadata.speaker' contains \\udc00 at position 0",
        ),
        (
            "manage_memory",
            {"operation": "update", "memory_id": 0, "metadata": {"speaker": "Car\udfffoline"}},
            "'metadata.speaker'",
        ),
        (
            "manage_memory",
            {"operation": "create", "content": "ok", "metadata": {"\ud800": "x"}},
            "argument name 'metadata.\\ud800'",
        ),
        ("search_memory", {"query": "\ud800"}, "'query' contains \\ud800"),
        ("search_memory", {"query": "tea", "speaker": "\ud800"}, "'speaker'"),
        ("merge_memory", {"memory_ids": [0, 1], "content": "a\ud800"}, "'content'"),
        (
            "split_memory",
            {"memory_id": 0, "parts": ["fine", "bad \udbff"]},
            "'parts[1]' contains \\udbff at position 4",
        ),
        ("delete_memory", {"memory_id": 0, "reason": "\ud800"}, "'reason'"),
    ],
)
def test_lone_surrogates_are_refused_with_an_instruction(tools, name, params, where):
    """A lone surrogate (JSON "\\ud800") crashed the tokenizer, or was stored and broke the delta's UTF-8."""
    agent = new_agent_data()
    text, ok = call(tools, agent, name, **params)
    assert not ok and where in text and text.endswith(("try again.", "the names in the tool's schema.")), text
    text.encode("utf-8")  # the reply itself goes to the tokenizer
    store = store_of(tools, agent)
    assert DELTA_KEY not in agent.extra_fields and len(store) == 184 and not store.created()
    assert store.get(0).speaker == "Caroline"


def test_after_a_refused_surrogate_the_delta_still_encodes(tools):
    agent = new_agent_data()
    # The arguments as the model writes them: JSON, where a pair of \\u escapes is one character.
    refused = json.loads(r'{"operation": "create", "content": "ok", "metadata": {"speaker": "\ud83d"}}')
    assert call(tools, agent, "manage_memory", **refused) == (
        "Argument 'metadata.speaker' contains \\ud83d at position 0, half of a surrogate pair, which is not "
        "text: write plain text and try again.",
        False,
    )
    paired = json.loads(
        r'{"operation": "create", "content": "Ana loves bees \ud83d\udc1d", "metadata": {"speaker": "Ana"}}'
    )
    assert call(tools, agent, "manage_memory", **paired)[1]
    delta = agent.extra_fields[DELTA_KEY]
    assert [r["content"] for r in delta["created"]] == ["Ana loves bees \U0001f41d"]
    json.dumps(delta, ensure_ascii=False).encode("utf-8")


# ----------------------------------------------------------------------------------- issue 19: shorter prompts


def test_an_environment_gives_the_policy_only_its_tools_in_compact_form(repo_root, environment, tmp_path):
    """A CPU experiment's prompt is mostly tool schemas: its environment keeps three, compact, and every
    worker that builds the tools from the run's tools.yaml gets the same."""
    few = dataclasses.replace(
        environment, tools=("search_memory", "manage_memory", "merge_memory"), compact_schemas=True
    ).write(tmp_path / "few")
    loaded = initialize_tools_from_config(str(write_tool_config(TOOL_CONFIG, few, tmp_path / "few")))
    assert [t.name for t in loaded] == ["search_memory", "manage_memory", "merge_memory"]
    full = {
        t.name: t
        for t in initialize_tools_from_config(
            str(write_tool_config(TOOL_CONFIG, environment.write(tmp_path), tmp_path))
        )
    }
    sizes = {"compact": 0, "full": 0}
    for tool in loaded:
        compact = json.dumps(tool.get_openai_tool_schema().model_dump(exclude_none=True))
        sizes["compact"] += len(compact)
        sizes["full"] += len(json.dumps(full[tool.name].get_openai_tool_schema().model_dump(exclude_none=True)))
        # The required arguments and the content cap are still stated.
        assert tool.get_openai_tool_schema().function.parameters.required == (
            full[tool.name].get_openai_tool_schema().function.parameters.required
        )
        assert tool.name == "search_memory" or "at most 300 characters" in compact
    assert sizes["compact"] < 0.7 * sizes["full"], sizes
    # The compact tools take the same arguments.
    tools = {t.name: t for t in loaded}
    text, ok = call(tools, new_agent_data(), "search_memory", query="LGBTQ support group", top_k=2, speaker="Caroline")
    assert ok and text.startswith("Found 2 memories:")


def test_an_environment_naming_a_tool_the_template_lacks_fails_naming_both(environment, tmp_path):
    template = tmp_path / "two.yaml"
    template.write_text(
        "tools:\n  - {name: search_memory, class_name: memupdate.tools.memory_tools.SearchMemoryTool}\n"
    )
    path = dataclasses.replace(environment, tools=("search_memory", "merge_memory")).write(tmp_path)
    with pytest.raises(ValueError, match=f"{template}: the memory environment {path} names tools \\['merge_memory'\\]"):
        write_tool_config(template, path, tmp_path)


@pytest.mark.parametrize("tools", [(), ("search_memory", "search_memory"), ("search_memory", "forget")])
def test_a_bad_tool_list_fails_in_the_environment(environment, tools):
    with pytest.raises(MemoryEnvironmentError, match="memory environment: tools"):
        dataclasses.replace(environment, tools=tools)


def test_keywords_go_in_front_of_a_memorys_text_which_keeps_its_evidence(tools):
    """An update by keywords rewrites a memory without the model retyping it: the text is kept whole behind the
    words, so the memory keeps its evidence, and its new embedding is that of the whole new text."""
    agent = new_agent_data()
    _, ok = call(tools, agent, "search_memory", query="LGBTQ support group", top_k=1)
    store = asyncio.run(tools["manage_memory"].store_for(agent))
    before = store.get(0)
    text, ok = call(tools, agent, "manage_memory", operation="update", memory_id=0, keywords="Caroline support group")
    after = store.get(0)
    assert ok and text.startswith("Updated memory [0]")
    assert after.content == f"Caroline support group: {before.content}" and after.evidence == before.evidence
    assert after.evidence and agent.extra_fields[DELTA_KEY]["updated"][0]["content"] == after.content
