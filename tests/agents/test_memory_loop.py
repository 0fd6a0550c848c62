"""The MemoryUpdate agent loop, run the way verl's AgentLoopWorker runs it, on tiny random models."""

import asyncio
import copy

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.experimental.agent_loop.agent_loop import DictConfigWrap
from verl.experimental.agent_loop.tool_agent_loop import ToolListWrap
from verl.tools.tool_registry import load_all_tools
from verl.utils.dataset.rl_dataset import RLHFDataset

from memupdate.agents.context import LoopContext
from memupdate.agents.fields import ANSWER_KEY, DELTA_KEY, QA_CONTEXT_KEY, ROLE_KEY, TERMINATION_KEY
from memupdate.agents.memory_loop import MemoryUpdateAgentLoop, qa_settings
from memupdate.eval.locomo import LocomoEvaluator
from memupdate.memory.environment import MemoryEnvironment
from memupdate.memory.manager import manager_for
from memupdate.memory.store import TrialStore
from memupdate.prompts import qa_messages, within_budget
from memupdate.rewards.memory import MemoryRewardConfig
from memupdate.rewards.scorers import QAItem, ReaderScorer
from memupdate.rollout.config import RolloutConfig, run_config
from memupdate.serving.client import Endpoint, OpenAIClient
from memupdate.serving.decoding import GREEDY, SAMPLING_KEYS
from memupdate.serving.hf_generate import HFGenerator
from memupdate.serving.token_client import VLLMTokenClient
from memupdate.settings import LocomoEvalSettings
from memupdate.tools.config import TOOL_CONFIG


@pytest.fixture()
def setup(tiny_models, locomo_rows, cache_dir, tmp_path):
    models, rows = tiny_models, locomo_rows
    cfg = RolloutConfig(
        model_path=str(models / "policy"),
        train_files=[str(rows["train"])],
        run_dir=str(tmp_path),
        tool_config=str(TOOL_CONFIG),
        memory=MemoryEnvironment(memories=rows["memories"], embeddings=cache_dir),
        prompt_length=4096,
        response_length=2048,
        max_new_tokens=12,
        max_assistant_turns=2,
    )
    config = run_config(cfg)
    tokenizer = AutoTokenizer.from_pretrained(models / "policy")
    dataset = RLHFDataset(cfg.train_files, tokenizer, config.data)
    tools = load_all_tools(config.actor_rollout_ref.rollout.multi_turn.tool_config_path, None)
    policy = HFGenerator(AutoModelForCausalLM.from_pretrained(models / "policy"), tokenizer, max_new_tokens=12)
    fixed = HFGenerator(AutoModelForCausalLM.from_pretrained(models / "fixed"), tokenizer, max_new_tokens=12, seed=7)
    return config, tokenizer, dataset, tools, policy, fixed


def run_episode(setup, **loop_kwargs):
    config, tokenizer, dataset, tools, policy, fixed = setup
    row = dataset[0]

    async def main():
        # Built inside the running event loop, as verl's worker does.
        loop = MemoryUpdateAgentLoop(
            trainer_config=DictConfigWrap(config),
            server_manager=policy,
            tokenizer=tokenizer,
            processor=None,
            dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(config.data),
            tools=ToolListWrap(tools),
            **({"fixed_model": fixed} | loop_kwargs),
        )
        kwargs = {k: v for k, v in row.items() if not isinstance(v, torch.Tensor)}
        return await loop.run({"temperature": 1.0, "top_p": 1.0, "top_k": -1}, **kwargs)

    return asyncio.run(main()), policy, fixed


def segments(mask):
    """Runs of equal mask values: [(value, length), ...]."""
    runs = []
    for m in mask:
        if runs and runs[-1][0] == m:
            runs[-1][1] += 1
        else:
            runs.append([m, 1])
    return [tuple(r) for r in runs]


class Recording:
    """A generator that remembers what it was asked (prompt ids, sampling params) and answers as ``server``."""

    def __init__(self, server):
        self.server, self.calls = server, []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        self.calls.append((list(prompt_ids), dict(sampling_params)))
        return await self.server.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)


def no_update_prompt_ids(setup, row, tokenizer):
    """What evaluation's no_update system sends the QA model for ``row``: the QA prompt over the initial
    store's top-k within the reward's budget, as one user message."""
    config = setup[0]
    info = row["extra_info"]
    reward = MemoryRewardConfig()
    manager = manager_for(MemoryEnvironment.read(config.reward.custom_reward_function.reward_kwargs.memory_environment))
    store = TrialStore(manager.base(info["sample_id"]))
    hits = store.search(manager.embedder.encode([info["question"]])[0], reward.top_k)
    memories = within_budget([h.record for h in hits], reward.context_chars)
    messages = qa_messages("locomo", info["question"], info["category"], memories)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_qa_phase_answers_from_a_fresh_prompt_exactly_as_no_update_does(setup):
    """The QA model sees the QA prompt over the final store and nothing of the episode: with no edit it is
    asked exactly what no_update asks, and (greedy) gives the same answer."""
    config, tokenizer, dataset, tools, policy, fixed = setup
    recording = Recording(fixed)
    output, policy, _ = run_episode(setup, trained_role="memory", qa_phase=True, fixed_model=recording)
    assert not any(output.extra_fields[DELTA_KEY].get(k) for k in ("created", "updated", "deleted"))
    ((prompt_ids, params),) = recording.calls
    expected = list(no_update_prompt_ids(setup, dataset[0], tokenizer))
    assert prompt_ids == expected and output.extra_fields[QA_CONTEXT_KEY] == len(expected)
    assert params["temperature"] == 0.0  # the fixed role decodes greedily
    # The memory transcript holds the policy's turns only: no QA prompt, no answer.
    assert set(output.response_mask) == {1} or 0 not in output.response_mask[: len(output.response_mask) // 2]
    assert "Short answer:" not in tokenizer.decode(output.prompt_ids + output.response_ids)
    assert fixed.generated_tokens > 0 and policy.generated_tokens > 0
    assert output.extra_fields[ROLE_KEY] == "memory"
    direct = HFGenerator(fixed.model, tokenizer, max_new_tokens=12, seed=99)
    answer = asyncio.run(
        direct.generate("x", prompt_ids=expected, sampling_params={"temperature": 0.0, "max_tokens": 32})
    )
    assert output.extra_fields[ANSWER_KEY] == tokenizer.decode(answer.token_ids, skip_special_tokens=True).strip()
    assert output.extra_fields[DELTA_KEY]["sample_id"] == "conv-26"
    assert output.extra_fields[TERMINATION_KEY] in ("no_tool_call", "done", "max_assistant_turns", "response_budget")


def test_qa_stage_trains_a_row_of_the_qa_prompt_and_its_answer(setup):
    config, tokenizer, dataset, tools, policy, fixed = setup
    recording = Recording(fixed)
    output, policy, _ = run_episode(setup, trained_role="qa", fixed_model=recording)
    # The trained row is the fresh QA prompt and the policy's answer, not the memory transcript's tail.
    assert output.prompt_ids == list(no_update_prompt_ids(setup, dataset[0], tokenizer))
    assert (
        output.response_mask == [1] * len(output.response_ids) and len(output.response_ids) == policy.generated_tokens
    )
    assert output.extra_fields[ANSWER_KEY] == tokenizer.decode(output.response_ids, skip_special_tokens=True).strip()
    # The fixed memory model played its turns greedily, so a GRPO group varies only in the answers.
    assert recording.calls and all(params["temperature"] == 0.0 for _, params in recording.calls)


def test_fixed_temperature_none_samples_the_fixed_role_like_the_policy(setup):
    recording = Recording(setup[5])
    run_episode(setup, trained_role="qa", fixed_model=recording, fixed_temperature=None)
    assert recording.calls and all(params["temperature"] == 1.0 for _, params in recording.calls)


def test_the_qa_phase_the_reader_and_the_evaluation_ask_the_qa_model_alike(setup, chat_server, tmp_path):
    """One decoder per role: asked one question over the same memories, the QA phase (through a served fixed
    model's client), the reward's reader scorer and the LoCoMo evaluation send the QA model the same prompt
    and every sampling key with the same value, greedy and capped at the reward's qa_max_tokens. A key left
    out would be filled by the server from the model's generation config (Qwen2.5-Instruct's
    repetition_penalty is 1.05), so S(initial) and S(final) could come from different decoders."""
    config, tokenizer, dataset, tools, policy, fixed = setup
    # The reward's answer cap, unlike every default, so a caller falling back to a default of its own shows.
    config = copy.deepcopy(config)
    OmegaConf.update(config, "reward.custom_reward_function.reward_kwargs.qa_max_tokens", 12, force_add=True)
    reward = config.reward.custom_reward_function.reward_kwargs
    qa = qa_settings(reward)
    recording = Recording(fixed)
    output, _, _ = run_episode(
        (config, *setup[1:]),
        trained_role="memory",
        qa_phase=True,
        fixed_model=recording,
        qa=qa,
        qa_max_tokens=reward.qa_max_tokens,  # as agent_loops.yaml passes the reward's
    )
    # No edit: the final store the QA phase read is the initial store the reader and the evaluation read.
    assert not any(output.extra_fields[DELTA_KEY].get(k) for k in ("created", "updated", "deleted"))
    ((prompt_ids, params),) = recording.calls
    # The body a served QA model gets from the fixed model's client (agent_loops.yaml's endpoint, its cap).
    served = VLLMTokenClient(Endpoint("http://127.0.0.1:1/v1", "qa"), config.actor_rollout_ref.rollout.response_length)
    qa_phase = served.build_payload(prompt_ids, params)

    info = dataset[0]["extra_info"]
    evaluator = LocomoEvaluator(
        test_file=str(dataset.data_files[0]),
        memory=MemoryEnvironment.read(reward.memory_environment),
        tool_config=TOOL_CONFIG,
        conversations=None,
        out_dir=str(tmp_path),
        settings=LocomoEvalSettings(
            protocols=[qa["qa_prompt"]],
            top_k=qa["top_k"],
            context_chars=qa["context_chars"],
            qa_max_tokens=reward.qa_max_tokens,
        ),
    )

    async def ask():
        async with chat_server(lambda messages: "7 May 2023") as server:
            # A client each: the second, identical, request would otherwise be answered from the first's cache.
            async with (
                OpenAIClient(Endpoint(server.url, "qa")) as reader_client,
                OpenAIClient(Endpoint(server.url, "qa")) as eval_client,
            ):
                memories = await evaluator.retrieve(info["sample_id"], info["question"], None)
                reader = ReaderScorer(reader_client, max_tokens=reward.qa_max_tokens, protocol=qa["qa_prompt"])
                await reader.answer(QAItem(info["question"], info["answer"], info["category"]), memories)
                record = {"question": info["question"], "category": info["category"], "choices": info.get("choices")}
                await evaluator.answer(eval_client, tokenizer, record, memories)
            return server.requests

    reader_request, eval_request = asyncio.run(ask())
    assert reader_request == eval_request
    ids = tokenizer.apply_chat_template(reader_request["messages"], add_generation_prompt=True, tokenize=True)
    assert qa_phase["prompt"] == list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    sampling = [{k: request[k] for k in SAMPLING_KEYS} for request in (qa_phase, reader_request, eval_request)]
    assert sampling == [GREEDY.request(reward.qa_max_tokens)] * 3


def test_a_role_no_config_can_select_is_refused(setup):
    with pytest.raises(ValueError, match="trained_role must be one of \\('memory', 'qa'\\)"):
        run_episode(setup, trained_role="joint", fixed_model=None)


def test_memory_stage_without_qa_phase_needs_no_fixed_model_and_qa_stage_does(setup):
    output, policy, _ = run_episode(setup, trained_role="memory", fixed_model=None)
    assert set(output.response_mask) == {1} or segments(output.response_mask)[0][0] == 1
    assert output.extra_fields[ANSWER_KEY] is None
    with pytest.raises(ValueError, match="needs fixed_model to play the memory role"):
        run_episode(setup, trained_role="qa", fixed_model=None)


def test_fixed_model_from_agent_loops_yaml_becomes_one_metered_vllm_token_client_per_context():
    from memupdate.serving.token_client import GenerationMeter, SharedGreedyRequests

    context = LoopContext("test")
    spec = {"base_url": "http://127.0.0.1:8011/v1", "model": "qa"}
    client = context.fixed_client(OmegaConf.create(spec), 64)
    assert isinstance(client, SharedGreedyRequests) and isinstance(client.client, GenerationMeter)
    assert isinstance(client.client.client, VLLMTokenClient)
    assert client.client.client.endpoint.model == "qa" and client.client.client.max_tokens == 64
    # Every trajectory's loop of a worker gets the same client (one HTTP session, one context-length lookup) ...
    assert context.fixed_client(dict(spec), 64) is client and context.fixed_seconds() == 0.0
    # ... unless it asks for another endpoint or cap; another worker's context has its own.
    assert context.fixed_client({**spec, "max_tokens": 8}, 64) is not client
    assert context.fixed_client(spec, 32) is not client
    assert LoopContext("other").fixed_client(spec, 64) is not client
    with pytest.raises(ValueError, match="no model name"):
        context.fixed_client({"base_url": "http://127.0.0.1:8011/v1", "model": ""}, 64)
    with pytest.raises(ValueError, match="fixed_model must be an endpoint"):
        context.fixed_client("qa-model", 64)


def test_a_groups_greedy_requests_to_the_fixed_model_are_generated_once(setup):
    """The 8 rollouts of a group replay the fixed role's greedy turns: one generation serves them all, in flight or
    finished; what they get equals a generation of their own; a sampled request is generated every time."""
    from memupdate.serving.token_client import GenerationMeter, SharedGreedyRequests

    _, tokenizer, _, _, _, fixed = setup
    prompt = tokenizer.encode("Who went camping in June?")
    greedy = {**GREEDY.params(), "logprobs": True}
    alone = asyncio.run(fixed.generate("alone", prompt_ids=prompt, sampling_params=greedy))
    meter = GenerationMeter(fixed)
    client = SharedGreedyRequests(meter)

    async def group(params, n=8):
        return await asyncio.gather(
            *(client.generate(f"r{i}", prompt_ids=prompt, sampling_params=params) for i in range(n))
        )

    outputs = asyncio.run(group(greedy))
    assert all(o.token_ids == alone.token_ids for o in outputs) and meter.generated_tokens == len(alone.token_ids)
    assert client.shared == 7 and outputs[0] is not outputs[1]
    # The next step draws the question again: answered from the finished generation.
    asyncio.run(group(greedy, n=1))
    assert client.shared == 8 and meter.generated_tokens == len(alone.token_ids)
    before = meter.generated_tokens
    asyncio.run(group({**greedy, "temperature": 1.0}, n=3))
    assert client.shared == 8 and meter.generated_tokens > before


def test_prompt_ids_are_built_once_per_prompt_and_equal_the_builders(setup, monkeypatch):
    from memupdate.agents import memory_loop

    config, tokenizer, dataset, tools, policy, fixed = setup
    context = LoopContext("test")
    built = []
    original = memory_loop.ToolAgentLoop.ct_build_initial_tokens

    async def counting(self, *args, **kwargs):
        ids = await original(self, *args, **kwargs)
        built.append(list(ids))
        return ids

    monkeypatch.setattr(memory_loop.ToolAgentLoop, "ct_build_initial_tokens", counting)

    async def main():
        loops = [
            MemoryUpdateAgentLoop(
                trainer_config=DictConfigWrap(config),
                server_manager=policy,
                tokenizer=tokenizer,
                processor=None,
                dataset_cls=RLHFDataset,
                data_config=DictConfigWrap(config.data),
                tools=ToolListWrap(tools),
                loop_context=context,
            )
            for _ in range(3)
        ]
        messages = list(dataset[0]["raw_prompt"])
        schemas = loops[0].tool_schemas
        first = await loops[0].ct_build_initial_tokens(messages, tools=schemas)
        first.append(-1)  # the caller owns its list: the cache must not change with it
        again = [await loop.ct_build_initial_tokens(messages, tools=schemas) for loop in loops[1:]]
        other = await loops[0].ct_build_initial_tokens(list(dataset[1]["raw_prompt"]), tools=schemas)
        return first, again, other

    first, again, other = asyncio.run(main())
    assert len(built) == 2  # the first prompt once, the second once
    assert again == [built[0], built[0]] and first[:-1] == built[0]
    assert other == built[1] != built[0]
