"""Question-agnostic ingestion through the local GRPO backend: the session rows run through the same loop,
tools and reward manager as question rows, and the policy is never shown a question."""

import json

import pytest

from memupdate.data.ingestion import build_ingestion_rows
from memupdate.training.local import LocalGRPOTrainer


@pytest.mark.slow
def test_ingestion_episodes_train_and_no_prompt_shows_a_question(
    tmp_path, tiny_model, grpo_config, locomo_rows, locomo_conversations
):
    rows = tmp_path / "ingest.parquet"
    build_ingestion_rows(str(locomo_rows["train"]), str(locomo_rows["memories"]), str(rows), split="train")
    cfg = grpo_config(tiny_model, train_files=[str(rows)], steps=2, prompts_per_step=2, rollout_n=2, max_rows=4)
    trainer = LocalGRPOTrainer(cfg)
    # Every prompt the policy is given, as the tokens it was given (tool results included).
    given = []
    generate = trainer.server.generate

    async def recording(*, request_id, prompt_ids, sampling_params, **kwargs):
        given.append(trainer.tokenizer.decode(prompt_ids))
        return await generate(request_id=request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)

    trainer.server.generate = recording
    metrics = trainer.train()

    assert metrics["step"] == 2 and metrics["trajectories"] == 4 and len(given) >= 8
    assert all("has just ended" in text for text in given)
    questions = [q.question for c in locomo_conversations.values() for q in c.qa]
    leaked = {q for text in given for q in questions if q in text}
    assert not leaked, f"the ingestion policy was shown {sorted(leaked)[:3]}"
    # Each episode was scored on its session's questions (the reward's components are logged per step).
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["n_questions_mean"] >= 1 for m in lines)
