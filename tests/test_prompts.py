"""The protocol prompts: the verbatim files under memupdate/prompt_files, how they are filled, and the judge in
JSON mode with unparseable replies counted (issue 14, item 7).

The upstream text itself lives only in the YAML files (each with its sha256, checked at load); these
tests check what identifies it and how it is filled."""

import asyncio
import json
import re
import shutil

import pytest
import yaml

from memupdate import prompts
from memupdate.eval.locomo import judge_predictions
from memupdate.eval.report import load_jsonl
from memupdate.prompts import (
    PromptFileError,
    load_prompts,
    memory_line,
    parse_judge,
    qa_messages,
    render_judge,
    within_budget,
)
from memupdate.rewards.scorers import JudgeScorer, QAItem, ReaderScorer, Retrieved
from memupdate.serving.client import Endpoint, OpenAIClient

MEMORIES = [
    Retrieved("Caroline went to the LGBTQ support group.", date="1:56 pm on 8 May, 2023", speaker="Caroline"),
    Retrieved("Melanie painted a sunrise.", date="1:56 pm on 8 May, 2023", speaker="Melanie"),
    Retrieved("A note without a date or speaker."),
]


def render_qa(*args, **kwargs) -> str:
    """The QA model's message text (what :func:`qa_messages` sends)."""
    return qa_messages(*args, **kwargs)[0]["content"]


@pytest.fixture(scope="module")
def prompts_dir():
    """The verbatim files the package ships."""
    return prompts.DEFAULT_PROMPTS_DIR


def test_files_name_their_upstream_source_and_hash(prompts_dir):
    for protocol, repository in (("locomo", "snap-research/LoCoMo"), ("mem0", "mem0ai/mem0")):
        data = yaml.safe_load((prompts_dir / f"{protocol}.yaml").read_text(encoding="utf-8"))
        assert data["protocol"] == protocol and data["how_upstream_fills"].strip()
        assert set(data["templates"]) == set(prompts.TEMPLATE_KEYS[protocol])
        for key, entry in data["templates"].items():
            source = entry["source"]
            assert source["repository"] == repository, key
            assert re.fullmatch(r"[0-9a-f]{40}", source["commit"]), key
            assert source["path"] in (
                "task_eval/gpt_utils.py",
                "evaluation/prompts.py",
                "evaluation/metrics/llm_judge.py",
            )
            assert re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]), key


def test_locomo_texts_keep_upstream_layout(prompts_dir):
    p = load_prompts("locomo", prompts_dir)
    qa, cat5 = p.text("qa"), p.text("qa_category_5")
    # Upstream's triple-quoted strings open and close with a newline; one positional placeholder each.
    assert qa.startswith("\nBased on the above context, write an answer in the form of a short phrase")
    assert qa.endswith("\n\nQuestion: {} Short answer:\n") and qa.count("{}") == 1
    assert cat5 == "\nBased on the above context, answer the following question.\n\nQuestion: {} Short answer:\n"
    assert p.text("category_2_suffix") == " Use DATE of CONVERSATION to answer with an approximate date."
    assert p.text("category_5_suffix") == " Select the correct answer: (a) {} (b) {}. "
    assert "is wriiten at the beginning" in p.text("conversation_start")  # upstream's typo, kept


def test_mem0_texts_keep_upstream_layout(prompts_dir):
    p = load_prompts("mem0", prompts_dir)
    answer, judge = p.text("answer"), p.text("judge")
    assert answer.startswith("\n    You are an intelligent memory assistant tasked with retrieving accurate")
    assert answer.endswith("    Question: {{question}}\n\n    Answer:\n    ")  # the indented last line
    for name in (
        "speaker_1_user_id",
        "speaker_1_memories",
        "speaker_2_user_id",
        "speaker_2_memories",
        "question",
    ):
        assert "{{" + name + "}}" in answer
    assert "These memories contain \n" in answer  # trailing spaces survive the YAML
    assert judge.startswith("\nYour task is to label an answer to a question as ’CORRECT’ or ’WRONG’.")
    assert judge.endswith('Just return the label CORRECT or WRONG in a json format with the key as "label".\n')
    assert set(re.findall(r"\{(\w+)\}", judge)) == {"question", "gold_answer", "generated_answer"}


def test_locomo_renders_rag_context_then_question_per_category(prompts_dir):
    p = load_prompts("locomo", prompts_dir)
    context = (
        "1:56 pm on 8 May, 2023: Caroline went to the LGBTQ support group.\n"
        "1:56 pm on 8 May, 2023: Melanie painted a sunrise.\n"
        "A note without a date or speaker."
    )
    one = render_qa("locomo", "What did Caroline go to?", 1, MEMORIES, prompts_dir=prompts_dir)
    assert one == context + "\n\n" + p.text("qa").format("What did Caroline go to?")
    assert one.endswith("\n\nQuestion: What did Caroline go to? Short answer:\n")

    two = render_qa("locomo", "When did Caroline go?", 2, MEMORIES, prompts_dir=prompts_dir)
    assert two.startswith(context + "\n\n\nBased on the above context, write an answer")
    assert two.endswith(
        "Question: When did Caroline go? Use DATE of CONVERSATION to answer with an approximate date. Short answer:\n"
    )

    choices = {"a": "Not mentioned in the conversation", "b": "self-care is important"}
    five = render_qa("locomo", "What did Caroline realize?", 5, MEMORIES, choices, prompts_dir=prompts_dir)
    assert five == context + "\n\n" + p.text("qa_category_5").format(
        "What did Caroline realize? Select the correct answer: (a) Not mentioned in the conversation "
        "(b) self-care is important. "
    )
    with pytest.raises(ValueError, match="category-5 question 'Who\\?' needs choices"):
        render_qa("locomo", "Who?", 5, MEMORIES, prompts_dir=prompts_dir)
    with pytest.raises(ValueError, match="category must be 1..5"):
        render_qa("locomo", "Who?", 6, MEMORIES, prompts_dir=prompts_dir)
    # A brace in the question is text, not a placeholder (upstream's .format on question + suffix fails).
    assert "(a) x (b) y" in render_qa("locomo", "{odd}?", 5, [], {"a": "x", "b": "y"}, prompts_dir=prompts_dir)


def test_locomo_full_context_layout(prompts_dir):
    p = load_prompts("locomo", prompts_dir)
    start = p.text("conversation_start").format("Caroline", "Melanie")
    rendered = p.render_context(start + "DATE: 8 May\nCONVERSATION:\n...", "Q?", 4)
    assert rendered.startswith("Below is a conversation between two people: Caroline and Melanie.")
    assert rendered.endswith(
        "...\n\n\nBased on the above context, write an answer in the form of a short phrase"
        " for the following question. Answer with exact words from the context whenever"
        " possible.\n\nQuestion: Q? Short answer:\n"
    )
    with pytest.raises(ValueError, match="LoCoMo's layout"):
        load_prompts("mem0", prompts_dir).render_context("c", "Q?", 1)


def test_mem0_splits_memories_by_speaker_into_the_jinja_template(prompts_dir):
    rendered = render_qa(
        "mem0",
        "When did Caroline go?",
        2,
        MEMORIES,
        speakers=("Caroline", "Melanie"),
        prompts_dir=prompts_dir,
    )
    first = json.dumps(
        ["1:56 pm on 8 May, 2023: Caroline went to the LGBTQ support group.", "A note without a date or speaker."],
        indent=4,
    )
    second = json.dumps(["1:56 pm on 8 May, 2023: Melanie painted a sunrise."], indent=4)
    assert (
        f"    Memories for user Caroline:\n\n    {first}\n\n    Memories for user Melanie:\n\n    {second}\n"
        in rendered
    )
    # Mem0 asks the raw question in every category (no LoCoMo suffix), and keeps its indented last line.
    assert rendered.endswith("    Question: When did Caroline go?\n\n    Answer:\n    ")
    assert "{{" not in rendered and "Use DATE" not in rendered
    # Category 5 needs no choices under Mem0; speakers default to the memories' own, in rank order.
    five = render_qa("mem0", "Q?", 5, MEMORIES[::-1], prompts_dir=prompts_dir)
    assert "Memories for user Melanie:" in five.split("Memories for user Caroline:")[0]
    with pytest.raises(ValueError, match="two speaker names"):
        render_qa("mem0", "Q?", 1, MEMORIES, speakers=("Caroline",), prompts_dir=prompts_dir)


def test_qa_messages_carry_the_file_role(prompts_dir):
    messages = prompts.qa_messages("mem0", "Q?", 1, MEMORIES, prompts_dir=prompts_dir)
    assert messages == [{"role": "user", "content": render_qa("mem0", "Q?", 1, MEMORIES, prompts_dir=prompts_dir)}]


def test_judge_prompt_and_parse(prompts_dir):
    text = render_judge("When?", "7 May 2023", "May 7th", prompts_dir=prompts_dir)
    assert "Question: When?\nGold answer: 7 May 2023\nGenerated answer: May 7th\n" in text
    assert parse_judge('{"label": "CORRECT"}') == 1.0
    assert parse_judge('```json\n{"label": "WRONG"}\n```') == 0.0
    assert parse_judge('Reasoning first. {"label": "CORRECT"}') == 1.0  # Mem0's extract_json
    for reply in (
        "CORRECT",
        "",
        "{not json}",
        '{"label": "correct"}',
        '{"verdict": "CORRECT"}',
        '["CORRECT"]',
        '{"label": 1}',
    ):
        assert parse_judge(reply) is None, reply


def test_load_errors_name_the_file(prompts_dir, tmp_path):
    with pytest.raises(PromptFileError, match=f"prompt file {tmp_path}/locomo.yaml for protocol 'locomo' does not"):
        load_prompts("locomo", tmp_path)
    with pytest.raises(ValueError, match="unknown prompt protocol 'zep'"):
        load_prompts("zep", prompts_dir)
    # An editor that strips trailing whitespace changes the verbatim text: refused, naming the template.
    shutil.copy(prompts_dir / "mem0.yaml", tmp_path / "mem0.yaml")
    text = (tmp_path / "mem0.yaml").read_text(encoding="utf-8")
    (tmp_path / "mem0.yaml").write_text("\n".join(line.rstrip() for line in text.split("\n")), encoding="utf-8")
    with pytest.raises(PromptFileError, match="templates.answer.text no longer matches its sha256"):
        load_prompts("mem0", tmp_path)


def test_judge_predictions_json_mode_records_unparsed(tmp_path, prompts_dir, chat_server):
    path = tmp_path / "system.jsonl"
    records = [
        {"question": "When?", "answer": "7 May 2023", "predictions": {"mem0": "7 May"}, "category": 2},
        {"question": "Who?", "answer": "Bo", "predictions": {"mem0": "Al"}, "category": 1},
        {"question": "Why?", "answer": "rain", "predictions": {"mem0": "no idea"}, "category": 4},
        {"question": "What?", "answer": None, "predictions": {"locomo": "(a)"}, "category": 5},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    replies = {"7 May": '{"label": "CORRECT"}', "Al": '{"label": "WRONG"}', "no idea": "I think it is wrong"}

    async def main():
        async with (
            chat_server(lambda messages: replies[generated(messages[-1]["content"])]) as server,
            OpenAIClient(Endpoint(server.url, "judge")) as client,
        ):
            first = await judge_predictions(path, client, "judge-model", prompts_dir=prompts_dir)
            again = await judge_predictions(path, client, "judge-model", prompts_dir=prompts_dir)
        return first, again, server.requests

    first, again, requests = asyncio.run(main())
    judged = load_jsonl(path)
    assert [r.get("judge") for r in judged] == [1.0, 0.0, None, None]
    assert [r.get("judge_unparsed") for r in judged] == [False, False, True, None]  # category 5 is not judged
    assert judged[2]["judge_reply"] == "I think it is wrong" and judged[2]["judge_model"] == "judge-model"
    assert judged[0]["judge_prompt"] == prompts.judge_prompt_sha256(prompts_dir)
    assert first == again == 1 and len(requests) == 3  # judged once; the second pass asks nothing
    assert all(r["response_format"] == {"type": "json_object"} and r["temperature"] == 0.0 for r in requests)
    assert requests[0]["messages"] == prompts.judge_messages("When?", "7 May 2023", "7 May", prompts_dir=prompts_dir)


def generated(judge_prompt: str) -> str:
    return re.search(r"Generated answer: (.*)\n", judge_prompt).group(1)


def test_judge_scorer_counts_unparsed_replies(prompts_dir, chat_server):
    answers = {"When?": "7 May", "Who?": "Al"}  # the reader's answer to each question
    verdicts = {"7 May": "CORRECT, clearly", "Al": '{"label": "CORRECT"}'}  # the first has no JSON label
    items = [QAItem("When?", "7 May 2023", 2), QAItem("Who?", "Al", 1)]

    def reader_reply(prompt):
        return answers[re.search(r"Question: (\w+\?)", prompt).group(1)]

    async def main():
        async with (
            chat_server(lambda messages: reader_reply(messages[-1]["content"])) as rs,
            chat_server(lambda messages: verdicts[generated(messages[-1]["content"])]) as js,
        ):
            async with (
                OpenAIClient(Endpoint(rs.url, "qa")) as rc,
                OpenAIClient(Endpoint(js.url, "judge")) as jc,
            ):
                scorer = JudgeScorer(
                    ReaderScorer(rc, protocol="locomo", prompts_dir=prompts_dir), jc, prompts_dir=prompts_dir
                )
                return await scorer.score(items, [MEMORIES, MEMORIES]), scorer, rs.requests

    scores, scorer, reader_requests = asyncio.run(main())
    assert scores == [0.0, 1.0] and scorer.unparsed == 1 and scorer.judged == 2
    # The reader asked with LoCoMo's prompt: the category-2 question carries its suffix.
    asked = prompts.qa_messages("locomo", "When?", 2, MEMORIES, prompts_dir=prompts_dir)
    assert asked in [r["messages"] for r in reader_requests]


def test_the_readers_budget_counts_each_memory_as_rendered_and_keeps_whole_ones_in_rank_order():
    memories = [Retrieved("a" * 40, date="8 May"), Retrieved("b" * 50), Retrieved("c" * 5), Retrieved("d" * 5)]
    lines = [len(memory_line(m)) for m in memories]
    assert lines == [47, 50, 5, 5], "a date is shown as 'date: ' in front of the content"
    assert [m.content[0] for m in within_budget(memories, 107)] == ["a", "b", "c", "d"]
    assert [m.content[0] for m in within_budget(memories, 101)] == ["a", "b"], "stops at the first that overflows"
    assert [m.content[0] for m in within_budget(memories, 60)] == ["a"]
    cut = within_budget(memories, 25)
    assert [memory_line(m) for m in cut] == ["8 May: " + "a" * 18], "the first is cut to fit, never dropped"
    assert memories[0].content == "a" * 40, "the memory itself is not changed"
    assert within_budget([], 10) == []
    with pytest.raises(ValueError, match="max_chars must be >= 1"):
        within_budget(memories, 0)


def test_a_date_longer_than_the_budget_is_cut_with_it():
    """Metadata escapes no budget: a memory whose date alone overflows shows only the start of its date."""
    (cut,) = within_budget([Retrieved("fact", date="x" * 100_000)], 50)
    assert len(memory_line(cut)) <= 50


@pytest.mark.parametrize("protocol", ["locomo", "mem0"])
def test_both_protocols_show_each_memory_as_its_line(protocol):
    memories = [Retrieved("Ann moved to Oslo.", date="8 May, 2023", speaker="Ann"), Retrieved("Bo came.", speaker="Bo")]
    prompt = qa_messages(protocol, "Where did Ann move?", 1, memories, speakers=("Ann", "Bo"))[0]["content"]
    for memory in memories:
        assert memory_line(memory) in prompt
