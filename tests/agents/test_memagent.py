"""The MemAgent loop through verl's worker, on a tiny random model: one chunk per prompt, a bounded memory,
one row per turn, the score on the final turn."""

import asyncio

import numpy as np
import pytest
from verl import DataProto
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

from memupdate.agents.memagent import FINAL_PROMPT, MEMORY_PROMPT, NO_MEMORY, split_chunks
from memupdate.rewards.memagent import memagent_reward
from memupdate.rollout.config import run_config
from memupdate.rollout.workers import FINAL_MASK_KEY, TRAJECTORY_KEY, TURN_INDEX_KEY, in_process_workers
from memupdate.serving.hf_generate import HFGenerator

CHUNK, MAX_CHUNKS = 48, 3  # as the memagent_config fixture sets them


def test_split_chunks_keeps_head_and_tail_of_an_overlong_context():
    chunks, cut = split_chunks(list(range(10)), 2, 3)
    assert cut == 4 and chunks == [[0, 1], [2, 7], [8, 9]]
    assert split_chunks([], 4, 2) == ([[]], 0)


def test_split_chunks_without_a_budget_reads_everything():
    chunks, cut = split_chunks(list(range(10)), 3, None)
    assert cut == 0 and chunks == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_memagent_reward_scores_the_boxed_answer_only():
    assert memagent_reward(r"\boxed{Paris, France}", ["Paris"]) == {
        "score": 0.0,
        "exact_match": 0.0,
        "sub_em": 1.0,
        "f1": pytest.approx(2 / 3),
        "boxed": 1.0,
    }
    assert memagent_reward(r"first \boxed{Rome} then \boxed{the Paris}", ["Paris"])["score"] == 1.0
    with pytest.raises(ValueError, match="gold answer"):
        memagent_reward("x", [])


@pytest.mark.slow
def test_each_turn_is_its_own_conversation_with_one_chunk(tmp_path, tiny_models, hotpot_rows, memagent_config):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_models / "policy"
    cfg = memagent_config(tmp_path, model_dir, hotpot_rows)
    config = run_config(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    server = HFGenerator(AutoModelForCausalLM.from_pretrained(model_dir), tokenizer, max_new_tokens=12)

    async def main():
        worker = in_process_workers(config, server)
        dataset = RLHFDataset([str(hotpot_rows)], worker.tokenizer, config.data, max_samples=2)
        batch = DataProto.from_single_dict(collate_fn([dataset[0], dataset[1]]))
        return batch, await worker.generate_sequences(batch.repeat(repeat_times=2, interleave=True))

    prompts, out = asyncio.run(main())
    extra = out.non_tensor_batch
    assert sorted(set(extra[TRAJECTORY_KEY].tolist())) == [0, 1, 2, 3]
    for t in range(4):
        rows = np.flatnonzero(extra[TRAJECTORY_KEY] == t)
        context = prompts.non_tensor_batch["context"][t // 2]
        ids = tokenizer(context, add_special_tokens=False)["input_ids"]
        chunks = [tokenizer.decode(c, skip_special_tokens=True) for c in split_chunks(ids, CHUNK, MAX_CHUNKS)[0]]
        assert len(rows) == len(chunks) + 1 and extra[TURN_INDEX_KEY][rows].tolist() == list(range(len(rows)))
        assert extra[FINAL_MASK_KEY][rows].tolist() == [False] * len(chunks) + [True]
        for turn, row in enumerate(rows):
            length = int(out.batch["attention_mask"][row, : out.batch["prompts"].size(1)].sum())
            text = tokenizer.decode(out.batch["prompts"][row, -length:])
            held = [i for i, chunk in enumerate(chunks) if f"<section>\n{chunk}\n</section>" in text]
            if turn < len(chunks):
                assert held == [turn], (turn, held)  # exactly its own chunk, no earlier one
                assert MEMORY_PROMPT.split("{")[0] in text
                assert (NO_MEMORY in text) == (turn == 0)
            else:
                assert held == [] and "<section>" not in text and FINAL_PROMPT.split("{")[0][:40] in text
        # Memories are capped: no memory turn generated more than max_memory_tokens.
        assert int(out.batch["response_mask"][rows].sum(-1).max()) <= 12
        # The reward is the final turn's, copied to every turn (as verl's V1 worker does).
        scores = out.batch["rm_scores"][rows].sum(-1)
        assert len(set(scores.tolist())) == 1
    assert {"exact_match", "sub_em", "f1", "boxed", "chunks"} <= set(extra)
