"""End to end: verl's AgentLoopWorker runs our MemoryUpdate loop, tools and reward manager against a
real vLLM OpenAI server on the CPU, token ids in and out."""

import asyncio

import numpy as np
import pytest
from verl import DataProto
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

from memupdate.agents.memory_loop import TERMINATION_REASONS
from memupdate.bench.rollout import LOOP_MAX_MODEL_LEN, vllm_loop_config
from memupdate.rollout.workers import in_process_workers
from memupdate.serving.token_client import VLLMTokenClient

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_agent_loop_worker_with_our_loop_against_vllm(
    vllm_server, tiny_model_dir, locomo_rows, cache_dir, repo_root, monkeypatch, tmp_path
):
    # The session's tiny server (tests/conftest.py) holds the context the loop's episodes need.
    command = vllm_server.command
    assert int(command[command.index("--max-model-len") + 1]) >= LOOP_MAX_MODEL_LEN
    monkeypatch.chdir(repo_root)
    for name in ("MEMUPDATE_MEMORIES", "MEMUPDATE_EMBEDDINGS", "MEMUPDATE_EMBEDDING_MODEL"):
        monkeypatch.setenv(name, "")  # vllm_loop_config sets them; monkeypatch undoes it after the test
    config = vllm_loop_config(
        tiny_model_dir,
        locomo_rows["train"],
        locomo_rows["memories"],
        cache_dir,
        tmp_path,
        rollout_n=2,
        max_assistant_turns=2,
        response_length=512,
    )
    client = VLLMTokenClient(vllm_server.endpoint, max_tokens=32)

    async def main():
        worker = in_process_workers(config, client)
        dataset = RLHFDataset([str(locomo_rows["train"])], worker.tokenizer, config.data, max_samples=2)
        batch = DataProto.from_single_dict(collate_fn([dataset[0], dataset[1]]))
        batch = batch.repeat(repeat_times=2, interleave=True)
        return await worker.generate_sequences(batch), worker.tokenizer

    out, tokenizer = asyncio.run(main())
    responses, mask = out.batch["responses"], out.batch["response_mask"]
    assert responses.shape[0] == 4 and out.batch["rm_scores"].shape == responses.shape
    generated = responses[mask.bool()]
    assert generated.numel() > 0 and int(generated.max()) < len(tokenizer)
    reasons = set(out.non_tensor_batch["termination_reason"])
    assert reasons <= set(TERMINATION_REASONS)
    assert all(d["sample_id"] == "conv-26" for d in out.non_tensor_batch["memory_delta"])
    assert np.isfinite(out.batch["rm_scores"].sum(-1).numpy()).all()
