"""The cold start (memupdate.training.sft): the scripted expert's demonstrations through the real loop and
tools, and supervised fine-tuning on the policy's own tokens."""

from __future__ import annotations

import json
import re
import statistics

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoTokenizer

from memupdate.data.ingestion import build_ingestion_rows
from memupdate.names import MANAGE_TOOL, MERGE_TOOL, SEARCH_TOOL
from memupdate.settings import DEFAULT_MAX_CONTENT_CHARS, RewardSettings
from memupdate.training.demonstrations import DONE, read_memories
from memupdate.training.ingestion_expert import merge_chars
from memupdate.training.memagent_expert import NOTHING_YET, covers
from memupdate.training.sft import DEMONSTRATION_SUMMARY, DEMONSTRATIONS, cold_start, cold_start_memagent
from memupdate.training.verl_sft import ROWS_FILE

# The tests that run verl's SFT trainer (through the module's fixtures) are marked verl_cpu one by one: the refusals
# start nothing, and run with the parallel tests.
pytestmark = [pytest.mark.slow]

#: The tools the expert uses, in compact form: the prompt a CPU experiment gives its policy.
TOOLS = {"names": [SEARCH_TOOL, MANAGE_TOOL], "compact": True}
#: The ingestion expert's: it merges what a session repeats.
INGEST_TOOLS = {"names": [SEARCH_TOOL, MERGE_TOOL], "compact": True}

#: The episode's lengths: the promoting update's call is the longest reply (~300 characters of text).
EPISODE = {
    "max_new_tokens": 512,
    "prompt_length": 4096,
    "response_length": 2048,
    "max_assistant_turns": 4,
    "max_tool_response_length": 2600,
}


#: verl's SFT trainer on this machine's CPU.
ON_CPU = {"trainer.device": "cpu"}


def train_cold_start(tiny_model_dir, rows, locomo_rows, cache_dir, run_dir, settings):
    """The cold start on conv-26's ``rows`` with the tiny model, the episode's lengths and the compact tools,
    fine-tuned by verl's SFT trainer on CPU."""
    return cold_start(
        settings={**settings, "lr": 1e-3, "search_top_k": 10},
        episode=EPISODE,
        model=str(tiny_model_dir),
        train_files=[str(rows)],
        memories=str(locomo_rows["memories"]),
        embeddings=str(cache_dir),
        run_dir=str(run_dir),
        # cpu_demo's reward with test_cpu_demo's idle-edit cost: an edit that gains nothing costs 0.05.
        reward={"scorer": "evidence_recall", "idle_edit_cost": 0.05, "efficiency": {"max_total_memories": None}},
        tools=TOOLS,
        layout=ON_CPU,
    )


@pytest.fixture(scope="module")
def sft_run(tiny_model_dir, locomo_rows, held_out_cache, headroom_mix, tmp_path_factory):
    """On conv-26's mix as cpu_demo draws it (half its rows with headroom), so that the expert both promotes and
    stops: on conv-26's rows in order, the first 8 hold no promotion, and the keep rule went untested."""
    run_dir = tmp_path_factory.mktemp("sft") / "run"
    rows = headroom_mix("train", share=0.5)
    return run_dir, train_cold_start(tiny_model_dir, rows, locomo_rows, held_out_cache, run_dir, SFT)


#: Two epochs of batches of two kept episodes; of the 8 episodes, stops beyond the kept edits' count are kept
#: up to 4 rows (balance_edits).
SFT = {"epochs": 2, "batch_size": 2, "micro_batch_size": 1, "max_rows": 8, "min_rows": 4}


@pytest.mark.verl_cpu
def test_demonstrations_are_the_experts_program_in_the_loops_format(sft_run, tiny_model_dir):
    run_dir, _ = sft_run
    records = [json.loads(line) for line in (run_dir / DEMONSTRATIONS).read_text().splitlines()]
    assert len(records) == 8
    for record in records:
        # Search with the question; promote the evidence the reader's context lacks, if the search shows it; stop.
        text = record["policy_text"]
        calls = calls_of(record)
        assert calls[0] == {"name": SEARCH_TOOL, "arguments": {"query": record["question"], "top_k": 10}}
        assert [c["name"] for c in calls[1:]] in ([], [MANAGE_TOOL])
        assert text.rstrip().endswith(DONE + "<|im_end|>")
        # Only the expert's own replies are trained: the tool's output (search results) never is.
        assert "Found " not in text and "Updated memory" not in text
        assert record["termination"] == "done" and record["well_formed_call"]
        assert record["edited"] == (len(calls) == 2)
    # The policy was shown the experiment's tools only, in compact form.
    tools = yaml.safe_load((run_dir / "tools.yaml").read_text())["tools"]
    assert [t["name"] for t in tools] == TOOLS["names"]
    environment = json.loads((run_dir / "memory_environment.json").read_text())
    assert environment["tools"] == TOOLS["names"] and environment["compact_schemas"] is True


def calls_of(record):
    """The tool calls of an episode's policy text, in order."""
    return [json.loads(c.split("</tool_call>")[0]) for c in record["policy_text"].split("<tool_call>\n")[1:]]


@pytest.mark.verl_cpu
def test_kept_edits_raised_the_training_reward_and_lowered_no_other(sft_run, locomo_rows):
    """The expert updates one memory that cites the question's evidence, putting key words in front of its text,
    and an edit is trained
    on only if it raised the training reward (evidence_recall) and lowered answer_recall nowhere; stops (no edit,
    reward 0) are kept beside the kept edits, no more of them."""
    run_dir, ckpt = sft_run
    records = [json.loads(line) for line in (run_dir / DEMONSTRATIONS).read_text().splitlines()]
    rows = {r["question"]: r for r in pq.read_table(locomo_rows["train"]).column("extra_info").to_pylist()}
    memories = read_memories(str(locomo_rows["memories"]))["conv-26"]
    for record in records:
        assert set(record["rewards"]) == {"answer_recall", "evidence_recall"}
        assert record["reward"] == pytest.approx(record["rewards"]["evidence_recall"])  # the training scorer
        evidence = set(rows[record["question"]]["evidence"])
        for call in calls_of(record)[1:]:
            args = call["arguments"]
            assert args["operation"] == "update" and memories[args["memory_id"]].evidence & evidence, call
            assert args["keywords"] and "content" not in args, call
        if record["edited"]:
            rewards = record["rewards"]
            assert record["kept"] == (rewards["evidence_recall"] > 0 and min(rewards.values()) >= 0), record
        else:
            assert record["rewards"] == {"answer_recall": 0.0, "evidence_recall": 0.0}
            assert record["kept"] != record.get("balanced_out", False)
    assert_stops_balanced(records, SFT["min_rows"])
    summary = json.loads((run_dir / DEMONSTRATION_SUMMARY).read_text())
    kept_edits = sum(r["kept"] and r["edited"] for r in records)
    # Both branches of the rule ran: a promotion kept, and an episode without an edit.
    assert kept_edits > 0 and not all(r["edited"] for r in records), records
    assert summary["kept"] == sum(r["kept"] for r in records) and summary["kept_edits"] == kept_edits
    # The kept edits raised the training scorer and lowered none: the other may be left flat on average.
    means = summary["kept_reward_mean"]
    assert min(means.values()) >= 0 and means["evidence_recall"] > 0, means


def assert_stops_balanced(records, min_rows):
    """As many stops are trained on as kept edits, and more while the kept rows are fewer than ``min_rows``
    (the tool format needs rows); the first stops in row order."""
    kept_edits = sum(r["kept"] and r["edited"] for r in records)
    stops = [r for r in records if not r["edited"]]
    kept_stops = min(len(stops), max(kept_edits, min_rows - kept_edits))
    assert [r["kept"] for r in stops] == [True] * kept_stops + [False] * (len(stops) - kept_stops), records


def test_the_expert_needs_its_tools(tiny_model_dir, locomo_rows, cache_dir, tmp_path):
    with pytest.raises(ValueError, match="the expert uses search_memory, manage_memory, but the policy"):
        cold_start(
            settings={"max_rows": 2},
            episode=EPISODE,
            model=str(tiny_model_dir),
            train_files=[str(locomo_rows["train"])],
            memories=str(locomo_rows["memories"]),
            embeddings=str(cache_dir),
            run_dir=str(tmp_path / "run"),
            reward={},
            tools={"names": [SEARCH_TOOL, MERGE_TOOL]},
            layout=ON_CPU,
        )


def test_a_reply_cap_the_expert_cannot_keep_is_refused(tiny_model_dir, locomo_rows, cache_dir, tmp_path):
    """Demonstrations longer than the episode lets the policy reply would teach calls it can never finish."""
    with pytest.raises(ValueError, match="over the episode's max_new_tokens \\(16\\)"):
        cold_start(
            settings={"max_rows": 2},
            episode={**EPISODE, "max_new_tokens": 16},
            model=str(tiny_model_dir),
            train_files=[str(locomo_rows["train"])],
            memories=str(locomo_rows["memories"]),
            embeddings=str(cache_dir),
            run_dir=str(tmp_path / "run"),
            reward={},
            layout=ON_CPU,
        )
    assert not (tmp_path / "run" / "ckpt").exists()


@pytest.mark.verl_cpu
def test_verls_sft_trainer_fine_tunes_on_the_policys_own_tokens(sft_run, tiny_model_dir):
    """The demonstrations, as token rows, through verl's SFT trainer (FSDP engine; here on verl's cpu platform),
    merged into the checkpoint stage 1 starts from."""
    run_dir, ckpt = sft_run
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert (manifest["backend"], manifest["kind"], manifest["base_model"]) == ("verl", "sft", str(tiny_model_dir))
    assert (run_dir / "hydra" / ".hydra" / "config.yaml").is_file()  # hydra wrote into the run, not the cwd
    assert manifest["git"] and manifest["config_digest"]
    assert (
        AutoTokenizer.from_pretrained(ckpt).chat_template == AutoTokenizer.from_pretrained(tiny_model_dir).chat_template
    )
    # verl trained on the kept episodes' rows, the loss on the policy's tokens only: never the prompt (the
    # question) nor a tool's output (search results).
    records = [json.loads(line) for line in (run_dir / DEMONSTRATIONS).read_text().splitlines()]
    rows = pq.read_table(run_dir / ROWS_FILE).to_pylist()
    assert len(rows) == sum(r["kept"] for r in records) >= 2
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for row in rows:
        trained = tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])
        assert trained.startswith("<tool_call>") and "Found " not in trained and "Target question" not in trained
        assert "Target question" in tokenizer.decode(row["input_ids"])
    # Two epochs on the same rows: the second epoch's mean loss is at least 5% below the first's (each epoch's
    # steps cover every row once but a last partial batch, which verl drops, so the means compare nearly the same
    # rows; single steps hold different ones; measured 6.17 -> 5.72, -7%, with the tiny model), and the weights
    # moved.
    losses = sft_losses(run_dir)
    assert len(losses) == SFT["epochs"] * (len(rows) // SFT["batch_size"]), losses
    assert_epoch_loss_falls(losses, SFT["epochs"])
    trained, base = load_file(ckpt / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(base[name], tensor.to(base[name].dtype)) for name, tensor in trained.items())


def assert_epoch_loss_falls(losses: list[float], epochs: int, margin: float = 0.05) -> None:
    """The last epoch's mean step loss is at least ``margin`` below the first epoch's."""
    per_epoch = len(losses) // epochs
    first, last = statistics.fmean(losses[:per_epoch]), statistics.fmean(losses[-per_epoch:])
    assert last < (1 - margin) * first, losses


def sft_losses(run_dir) -> list[float]:
    """The loss of each of verl's SFT steps, from its file logger."""
    return [r["data"]["train/loss"] for r in map(json.loads, (run_dir / "tracking.jsonl").read_text().splitlines())]


# ------------------------------------------------------------------------------------------- ingestion

#: The longest text the ingestion expert merges into, with the reward's default budget.
MERGE_CHARS = merge_chars(DEFAULT_MAX_CONTENT_CHARS, RewardSettings.top_k, RewardSettings.context_chars)
#: An ingestion episode's lengths: a session's memories in the tiny vocabulary, two searches and merges.
INGEST_EPISODE = {**EPISODE, "prompt_length": 6144, "response_length": 4096, "max_assistant_turns": 5}


#: Of the 12 sessions' episodes, stops kept up to 4 rows (balance_edits).
INGEST_MIN_ROWS = 4


@pytest.fixture(scope="module")
def ingest_sft(tiny_model_dir, locomo_rows, cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ingest-sft")
    rows = out / "ingest.parquet"
    build_ingestion_rows(str(locomo_rows["train"]), str(locomo_rows["memories"]), str(rows), split="train")
    ckpt = cold_start(
        # conv-26's first 12 sessions: its first merges come in sessions 10 and 11 (one pays less than nothing).
        settings={
            "epochs": 1,
            "batch_size": 1,
            "micro_batch_size": 1,
            "lr": 1e-3,
            "max_rows": 12,
            "min_rows": INGEST_MIN_ROWS,
            "search_top_k": 5,
        },
        episode=INGEST_EPISODE,
        model=str(tiny_model_dir),
        train_files=[str(rows)],
        memories=str(locomo_rows["memories"]),
        embeddings=str(cache_dir),
        run_dir=str(out / "run"),
        reward={"scorer": "evidence_recall", "efficiency": {"max_total_memories": None}},
        tools=INGEST_TOOLS,
        layout=ON_CPU,
    )
    return out / "run", rows, ckpt


@pytest.mark.verl_cpu
def test_ingestion_demonstrations_merge_what_belongs_together(ingest_sft, locomo_conversations):
    """The ingestion expert searches with a new memory's text and merges the memories shown that cite one
    question's evidence; it is never shown a question. Under the reward that pays for no trick (issue 34) its
    merges do not raise the reward on these sessions (they sum to about -0.005): a merged memory is longer and
    ranks lower; which demonstrations a cold start should keep is the experts' open half of that issue."""
    run_dir, rows, ckpt = ingest_sft
    prompts = {r["extra_info"]["session"]: r["prompt"][1]["content"] for r in pq.read_table(rows).to_pylist()}
    records = [json.loads(line) for line in (run_dir / DEMONSTRATIONS).read_text().splitlines()]
    assert len(records) == 12 and all(r["question"] is None for r in records)
    questions = [q.question for c in locomo_conversations.values() for q in c.qa]
    merged = []
    for record in records:
        text = record["policy_text"]
        calls = [json.loads(c.split("</tool_call>")[0]) for c in text.split("<tool_call>\n")[1:]]
        for before, call in zip([None, *calls], calls, strict=False):
            if call["name"] == SEARCH_TOOL:
                # The query is one of the session's new memories, as the prompt shows it.
                assert call["arguments"]["query"] in prompts[record["session"]]
                continue
            # A merge of what the search just showed, in two memories' share of the reader's budget over 5
            # results (a search that shows too little is followed by the next search).
            assert call["name"] == MERGE_TOOL and before["name"] == SEARCH_TOOL
            assert len(call["arguments"]["memory_ids"]) >= 2 and len(call["arguments"]["content"]) <= MERGE_CHARS
        # The loop checks the turn limit first: a DONE on the last turn ends at max_assistant_turns.
        assert text.rstrip().endswith(DONE + "<|im_end|>")
        assert record["termination"] in ("done", "max_assistant_turns")
        assert not [q for q in questions if q in text or q in prompts[record["session"]]]
        # A merge is trained on only if the training scorer (evidence_recall) paid for it and the other did not
        # fall; a stop changed nothing.
        assert record["edited"] == bool(record.get("ops_merged"))
        if record["edited"]:
            rewards = record["rewards"]
            assert record["kept"] == (rewards["evidence_recall"] > 0 and min(rewards.values()) >= 0), record
            merged.append(record["reward"])
        else:
            assert record["rewards"] == {"answer_recall": 0.0, "evidence_recall": 0.0}
    assert merged, records
    assert_stops_balanced(records, INGEST_MIN_ROWS)
    assert json.loads((ckpt / "manifest.json").read_text())["kind"] == "sft"


# ------------------------------------------------------------------------------------------- MemAgent

#: Every chunk read (no centre truncation), so every supporting sentence passes the expert; the tiny BPE takes
#: about a token per character, and three supporting sentences are about 400 characters.
MEMAGENT_LOOP = {"chunk_size": 128, "max_chunks": None, "max_memory_tokens": 1024, "max_final_tokens": 64}
#: Batches of two kept turns.
MEMAGENT_SFT = {"epochs": 2, "batch_size": 2, "micro_batch_size": 1, "lr": 1e-3, "max_rows": 4}


@pytest.fixture(scope="module")
def memagent_sft(tiny_model_dir, hotpot_rows, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("memagent-sft") / "run"
    ckpt = cold_start_memagent(
        settings=MEMAGENT_SFT,
        loop=MEMAGENT_LOOP,
        model=str(tiny_model_dir),
        train_files=[str(hotpot_rows)],
        run_dir=str(run_dir),
        layout=ON_CPU,
    )
    return run_dir, ckpt


@pytest.mark.verl_cpu
def test_memagent_demonstrations_keep_the_supporting_facts_and_box_the_answer(memagent_sft, hotpot_rows):
    run_dir, ckpt = memagent_sft
    rows = {r["extra_info"]["question"]: r["extra_info"] for r in pq.read_table(hotpot_rows).to_pylist()}
    records = [json.loads(line) for line in (run_dir / DEMONSTRATIONS).read_text().splitlines()]
    assert len(records) == 4
    for record in records:
        info = rows[record["question"]]
        # The gold answer in \boxed{} earns the MemAgent reward; the memory holds the evidence, not the answer
        # as such (unless a supporting sentence states it).
        assert record["reward"] == 1.0, record
        assert record["turns"] >= 2
        assert record["kept"] == covers(record["memory"], info["supporting_facts"])  # reward 1, so coverage decides
        # Only evidence: every word of the memory (or the part a chunk boundary left of it) is in a supporting fact.
        facts = " ".join(info["supporting_facts"])
        assert all(w in facts for w in re.findall(r"\w+", record["memory"])) or record["memory"] == NOTHING_YET
    assert any(r["kept"] for r in records)
    summary = json.loads((run_dir / DEMONSTRATION_SUMMARY).read_text())
    # MemAgent's counts, not MemoryUpdate's edits and stops.
    assert summary["kept"] == sum(r["kept"] for r in records) and "kept_edits" not in summary
    assert summary["rows"] == sum(r["turns"] for r in records if r["kept"])
    assert summary["dropped_uncovered"] == sum(not r["covered"] for r in records)


@pytest.mark.verl_cpu
def test_memagent_sft_trains_on_every_turn_of_the_kept_trajectories(memagent_sft, tiny_model_dir):
    run_dir, ckpt = memagent_sft
    records = [json.loads(line) for line in (run_dir / DEMONSTRATIONS).read_text().splitlines()]
    rows = sum(r["turns"] for r in records if r["kept"])
    assert len(pq.read_table(run_dir / ROWS_FILE)) == rows
    losses = sft_losses(run_dir)
    assert len(losses) == MEMAGENT_SFT["epochs"] * (rows // MEMAGENT_SFT["batch_size"])
    assert_epoch_loss_falls(losses, MEMAGENT_SFT["epochs"])
    trained, base = load_file(ckpt / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(base[name], tensor.to(base[name].dtype)) for name, tensor in trained.items())
