"""The ChatML tool template renders Qwen2.5's layout, and verl reads back what it teaches."""

from __future__ import annotations

import asyncio
import json

import pytest
from verl.experimental.agent_loop.tool_parser import ToolParser
from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

from memupdate.chat_templates import TEMPLATE_DIR, available_chat_templates, load_chat_template
from memupdate.models.prepare import prepare_model


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    """The default tiny model's tokenizer, which prepare_model gives the repository's chatml_tools template."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("models") / "tiny"
    prepare_model({"kind": "tiny_random", "seed": 0}, out)
    return AutoTokenizer.from_pretrained(out)


SCHEMA = {
    "type": "function",
    "function": {
        "name": "search_memory",
        "description": "Search memories.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
SYSTEM = {"role": "system", "content": "You manage memories."}
USER = {"role": "user", "content": "Where did Ana go?"}
# verl's ToolAgentLoop stores arguments as a dict; OpenAI clients send a JSON string. Both must render alike.
ASSISTANT_CALLS = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"type": "function", "function": {"name": "search_memory", "arguments": {"query": "Ana trip"}}},
        {"type": "function", "function": {"name": "search_memory", "arguments": '{"query": "Ana travel"}'}},
    ],
}
TOOL_RESULTS = [
    {"role": "tool", "content": "[1] Ana went to Rome."},
    {"role": "tool", "content": "[2] Ana likes trains."},
]

TOOLS_SYSTEM = (
    "<|im_start|>system\nYou manage memories.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(SCHEMA)
    + "\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
CALLS = (
    "<|im_start|>assistant\n"
    '<tool_call>\n{"name": "search_memory", "arguments": {"query": "Ana trip"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "search_memory", "arguments": {"query": "Ana travel"}}\n</tool_call><|im_end|>\n'
)
RESULTS = (
    "<|im_start|>user\n"
    "<tool_response>\n[1] Ana went to Rome.\n</tool_response>\n"
    "<tool_response>\n[2] Ana likes trains.\n</tool_response><|im_end|>\n"
)


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_full_tool_conversation(tiny_tokenizer):
    messages = [SYSTEM, USER, ASSISTANT_CALLS, *TOOL_RESULTS]
    text = render(tiny_tokenizer, messages, tools=[SCHEMA], add_generation_prompt=True)
    expected = TOOLS_SYSTEM + "<|im_start|>user\nWhere did Ana go?<|im_end|>\n" + CALLS + RESULTS
    assert text == expected + "<|im_start|>assistant\n"


def test_plain_chat_has_no_default_system_prompt(tiny_tokenizer):
    messages = [USER, {"role": "assistant", "content": "Rome."}, {"role": "user", "content": "When?"}]
    assert render(tiny_tokenizer, messages) == (
        "<|im_start|>user\nWhere did Ana go?<|im_end|>\n<|im_start|>assistant\nRome.<|im_end|>\n"
        "<|im_start|>user\nWhen?<|im_end|>\n"
    )
    assert render(tiny_tokenizer, [SYSTEM, USER]).startswith("<|im_start|>system\nYou manage memories.<|im_end|>\n")


def test_tools_without_system_message(tiny_tokenizer):
    text = render(tiny_tokenizer, [USER], tools=[SCHEMA])
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call")


def test_assistant_text_before_tool_call(tiny_tokenizer):
    message = {**ASSISTANT_CALLS, "content": "Let me look.", "tool_calls": ASSISTANT_CALLS["tool_calls"][:1]}
    assert render(tiny_tokenizer, [USER, message]).endswith(
        '<|im_start|>assistant\nLet me look.\n<tool_call>\n{"name": "search_memory", '
        '"arguments": {"query": "Ana trip"}}\n</tool_call><|im_end|>\n'
    )


def test_hermes_parser_reads_the_taught_format(tiny_tokenizer):
    """What the template renders as an assistant turn is what verl's hermes parser extracts."""
    prompt = render(tiny_tokenizer, [SYSTEM, USER], tools=[SCHEMA], add_generation_prompt=True)
    full = render(tiny_tokenizer, [SYSTEM, USER, ASSISTANT_CALLS], tools=[SCHEMA])
    assert full.startswith(prompt)
    response_ids = tiny_tokenizer.encode(full[len(prompt) :], add_special_tokens=False)

    parser = ToolParser.get_tool_parser("hermes", tiny_tokenizer)
    content, calls = asyncio.run(parser.extract_tool_calls(response_ids))

    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("search_memory", {"query": "Ana trip"}),
        ("search_memory", {"query": "Ana travel"}),
    ]
    assert content.strip() == "<|im_end|>"


def test_verl_continuous_tokens_match_the_template(tiny_tokenizer):
    """verl re-renders each appended turn through the template and diffs token suffixes."""
    builder = create_continuous_token_builder(tiny_tokenizer, hf_model_type="qwen2")
    prompt = [SYSTEM, USER]
    initial = builder.build_initial_tokens(prompt, tools=[SCHEMA])
    assert tiny_tokenizer.decode(initial) == render(tiny_tokenizer, prompt, tools=[SCHEMA], add_generation_prompt=True)

    history = [*prompt, ASSISTANT_CALLS]
    appended = builder.tokenize_context_incremental_messages(history, [*history, *TOOL_RESULTS], tools=[SCHEMA])
    assert tiny_tokenizer.decode(appended) == RESULTS + "<|im_start|>assistant\n"

    history = [*history, *TOOL_RESULTS, {"role": "assistant", "content": "Rome."}]
    follow_up = {"role": "user", "content": "When?"}
    appended = builder.tokenize_context_incremental_messages(history, [*history, follow_up], tools=[SCHEMA])
    assert tiny_tokenizer.decode(appended) == "<|im_start|>user\nWhen?<|im_end|>\n<|im_start|>assistant\n"


def test_load_chat_template_reads_the_repository_file():
    assert "chatml_tools" in available_chat_templates()
    assert load_chat_template("chatml_tools") == (TEMPLATE_DIR / "chatml_tools.jinja").read_text(encoding="utf-8")


def test_unknown_chat_template_names_where_it_looked():
    with pytest.raises(
        FileNotFoundError, match=r"no chat template 'nope'.*chat_template_files.*available: .*'chatml_tools'"
    ):
        load_chat_template("nope")
