"""The in-process agent-loop worker: what it changes in verl's AgentLoopWorker gives verl's results."""

from types import SimpleNamespace

import hydra
import pytest
import torch
from transformers import AutoTokenizer
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

from memupdate.agents.memory_loop import MemoryUpdateAgentLoop
from memupdate.memory.environment import MemoryEnvironment
from memupdate.rollout.config import RolloutConfig, run_config
from memupdate.rollout.workers import MultiOutputAgentLoopWorker, in_process_workers
from memupdate.serving.hf_generate import HFGenerator
from memupdate.tools.config import TOOL_CONFIG


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("tokens", [[], [5], [5, 6, 7], list(range(10, 18)), list(range(10, 20))])
@pytest.mark.parametrize("with_mask", [True, False])
def test_padding_matches_verls_tokenizer_pad(tiny_models, side, tokens, with_mask):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models / "policy")
    args = {"max_length": 8, "padding_side": side, "return_attention_mask": with_mask}
    ours = MultiOutputAgentLoopWorker._pad_token_ids(SimpleNamespace(tokenizer=tokenizer), tokens, **args)
    verls = AgentLoopWorker._pad_token_ids(SimpleNamespace(tokenizer=tokenizer), tokens, **args)
    assert ours.keys() == verls.keys()
    for key in ours:
        assert ours[key].dtype == verls[key].dtype == torch.long
        assert torch.equal(ours[key], verls[key]), (key, ours[key], verls[key])


def test_agent_loop_constructor_is_resolved_once_and_every_trajectory_gets_a_fresh_loop(
    tiny_models, locomo_rows, cache_dir, monkeypatch, tmp_path
):
    cfg = RolloutConfig(
        model_path=str(tiny_models / "policy"),
        train_files=[str(locomo_rows["train"])],
        run_dir=str(tmp_path),
        tool_config=str(TOOL_CONFIG),
        memory=MemoryEnvironment(memories=locomo_rows["memories"], embeddings=cache_dir),
        reward={"top_k": 3, "qa_max_tokens": 7},
    )
    config = run_config(cfg)
    tokenizer = AutoTokenizer.from_pretrained(tiny_models / "policy")
    server = HFGenerator(None, tokenizer, max_new_tokens=4)
    worker = in_process_workers(config, server, reward=False)
    calls = []
    instantiate = hydra.utils.instantiate
    monkeypatch.setattr(hydra.utils, "instantiate", lambda *a, **k: calls.append(k) or instantiate(*a, **k))
    first, second = worker._new_agent_loop("memupdate_agent"), worker._new_agent_loop("memupdate_agent")
    assert len(calls) == 1 and calls[0]["_partial_"] is True
    assert type(first) is type(second) is MemoryUpdateAgentLoop and first is not second
    # Settings from the run's agent_loops.yaml reach every loop, and per-trajectory state is not shared.
    assert first.qa_max_tokens == second.qa_max_tokens == 7 and first.deterministic_ids
    # The QA phase retrieves as the reward does: its top_k is the reward's, read from verl's config.
    assert first.qa_top_k == second.qa_top_k == 3
    assert first.server_manager is server and first._namespace is None
    with pytest.raises(ValueError, match="not registered"):
        worker._new_agent_loop("no_such_loop")
