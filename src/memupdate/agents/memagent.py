"""The MemAgent loop: read a long context chunk by chunk, overwriting a bounded memory, then answer.

MemAgent (BytedTsinghua-SIA/MemAgent, ``notes/upstream-systems.md`` §2) as a verl agent loop registered
``memagent``. For each chunk of the row's ``context`` the policy sees the question, its current memory and
that chunk, and writes the new memory, which replaces the old one; a final turn answers from the memory
in ``\\boxed{}``. Every turn is its own conversation (its prompt never holds an earlier chunk), so one
trajectory yields one :class:`AgentLoopOutput` per turn, returned as a list: verl 0.9.1's V1 trainer
stores each one as its own row and gives them all the advantage of the final turn
(``compute_advantage_for_multi_trajectories``); :class:`memupdate.rollout.workers.MultiOutputAgentLoopWorker`
does the same for the in-process paths (evaluation, the cold start, benchmarks).

Fixes over upstream: the final turn has its own token limit (upstream reused the memory limit); the
memory is text with ``<think>`` blocks dropped, capped at ``max_memory_tokens`` with a visible marker when
the model did not finish it (upstream kept raw token ids and accepted cut memories silently); training
and evaluation use these same prompts (upstream evaluated with a different final prompt); a prompt that
does not fit ``rollout.prompt_length`` is an error naming the budget, not a silent left-truncation.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from memupdate.agents.context import LoopContext, process_context
from memupdate.agents.fields import (
    CHUNKS_KEY,
    CHUNKS_TOTAL_KEY,
    CONTEXT_KEY,
    FINAL_KEY,
    TRUNCATED_TOKENS_KEY,
    TRUNCATIONS_KEY,
    TURN_KEY,
    weight_versions,
)
from memupdate.agents.fields import MEMAGENT_ANSWER_KEY as ANSWER_KEY
from memupdate.agents.fields import MEMAGENT_MEMORY_KEY as MEMORY_KEY
from memupdate.names import MEMAGENT_AGENT
from memupdate.settings import MemAgentLoopSettings

logger = logging.getLogger(__name__)

MEMORY_PROMPT = (
    "You are presented with a problem, a section of an article that may contain the answer to the problem, "
    "and a previous memory. Please read the provided section carefully and update the memory with the new "
    "information that helps to answer the problem. Be sure to retain all relevant details from the previous "
    "memory while adding any new, useful information.\n\n"
    "<problem>\n{question}\n</problem>\n\n<memory>\n{memory}\n</memory>\n\n<section>\n{chunk}\n</section>\n\n"
    "Updated memory:"
)
FINAL_PROMPT = (
    "You are presented with a problem and a previous memory. Please answer the problem based on the previous "
    "memory and put the answer in \\boxed{{}}.\n\n"
    "<problem>\n{question}\n</problem>\n\n<memory>\n{memory}\n</memory>\n\nYour answer:"
)
#: The final prompt of MemAgent's own evaluation (``TEMPLATE_FINAL`` of ``taskutils/memory_eval/utils/recurrent.py``,
#: BytedTsinghua-SIA/MemAgent@76b7a658988e4ea53d7388a62de6c0ce79084146): its instruction verbatim, in this
#: module's layout (upstream adds a space after ``<problem>`` and a newline after ``Your answer:``).
ANSWER_IS_PROMPT = (
    "You are presented with a problem and a previous memory. Please answer the problem based on the previous "
    'memory and format your response as follows "Therefore, the answer is (insert answer here)".\n\n'
    "<problem>\n{question}\n</problem>\n\n<memory>\n{memory}\n</memory>\n\nYour answer:"
)
#: ``final_prompt`` choices: ``boxed`` (training's, and our evaluation's) or ``answer_is`` (MemAgent's evaluation).
FINAL_PROMPTS = {"boxed": FINAL_PROMPT, "answer_is": ANSWER_IS_PROMPT}
NO_MEMORY = "No previous memory"
TRUNCATION_MARK = " [memory cut at {limit} tokens]"


def split_chunks(ids: list[int], chunk_size: int, max_chunks: int | None) -> tuple[list[list[int]], int]:
    """``ids`` cut into chunks of ``chunk_size`` tokens, at most ``max_chunks`` of them (None: all of them); a
    longer context loses its middle (MemAgent's centre truncation: the head and the tail are where documents
    start and end). Returns the chunks and how many tokens were cut.

    >>> split_chunks(list(range(7)), 3, 2)
    ([[0, 1, 2], [4, 5, 6]], 1)
    >>> split_chunks(list(range(7)), 3, None)
    ([[0, 1, 2], [3, 4, 5], [6]], 0)
    """
    budget = len(ids) if max_chunks is None else chunk_size * max_chunks
    cut = max(0, len(ids) - budget)
    if cut:
        ids = ids[: budget // 2] + ids[len(ids) - (budget - budget // 2) :]
    return [ids[i : i + chunk_size] for i in range(0, len(ids), chunk_size)] or [[]], cut


def memory_text(text: str, finished: bool, limit: int) -> str:
    """The memory the next turn sees: the reply after any ``</think>``, stripped, and marked when the model hit
    the token cap before finishing it, so the policy can see (and learn) that it wrote too much.

    >>> memory_text("<think>hm</think> Paris is in France.", True, 64)
    'Paris is in France.'
    >>> memory_text("Paris is", False, 2)
    'Paris is [memory cut at 2 tokens]'
    """
    text = text.rsplit("</think>", 1)[-1].strip()
    return text + ("" if finished else TRUNCATION_MARK.format(limit=limit))


@register(MEMAGENT_AGENT)
class MemAgentLoop(AgentLoopBase):
    def __init__(
        self,
        *args,
        chunk_size: int = MemAgentLoopSettings.chunk_size,
        max_chunks: int | None = MemAgentLoopSettings.max_chunks,
        max_memory_tokens: int = MemAgentLoopSettings.max_memory_tokens,
        max_final_tokens: int = MemAgentLoopSettings.max_final_tokens,
        final_prompt: str = "boxed",
        context_key: str = "context",
        deterministic_ids: bool = False,
        loop_context: LoopContext | None = None,
        **kwargs,
    ):
        """Defaults are MemAgent's training budgets (5000-token chunks, 8 chunks, 1024-token memory), except the
        final answer's limit: a boxed short answer needs far fewer than the memory's 1024 tokens.
        ``max_chunks`` None reads every chunk (MemAgent's evaluation); ``final_prompt`` is a key of
        :data:`FINAL_PROMPTS`."""
        super().__init__(*args, **kwargs)
        budgets = {
            "chunk_size": chunk_size,
            "max_chunks": 1 if max_chunks is None else max_chunks,
            "max_memory_tokens": max_memory_tokens,
            "max_final_tokens": max_final_tokens,
        }
        for name, value in budgets.items():
            if value is None or int(value) < 1:
                raise ValueError(f"memagent: {name} must be a positive integer, got {value!r}")
        if final_prompt not in FINAL_PROMPTS:
            raise ValueError(f"memagent: final_prompt must be one of {sorted(FINAL_PROMPTS)}, got {final_prompt!r}")
        self.final_prompt = FINAL_PROMPTS[final_prompt]
        self.chunk_size = int(chunk_size)
        self.max_chunks = None if max_chunks is None else int(max_chunks)
        self.max_memory_tokens, self.max_final_tokens = int(max_memory_tokens), int(max_final_tokens)
        self.context_key = context_key
        self.deterministic_ids = deterministic_ids
        self.loop_context = loop_context or process_context()
        response_length = self.rollout_config.response_length
        if max(self.max_memory_tokens, self.max_final_tokens) > response_length:
            raise ValueError(
                f"memagent: max_memory_tokens {self.max_memory_tokens} / max_final_tokens {self.max_final_tokens} "
                f"exceed rollout.response_length {response_length}; raise response_length or lower them"
            )

    def _chat_ids(self, content: str) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}],
            add_generation_prompt=True,
            tokenize=True,
            **self.apply_chat_template_kwargs,
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    async def _turn(self, request_id: str, content: str, sampling_params: dict[str, Any], max_tokens: int, turn: int):
        prompt_ids = await self.loop.run_in_executor(None, self._chat_ids, content)
        limit = self.rollout_config.prompt_length
        if len(prompt_ids) > limit:
            raise ValueError(
                f"memagent turn {turn}: prompt of {len(prompt_ids)} tokens exceeds rollout.prompt_length {limit}; "
                f"it must hold the question, a {self.chunk_size}-token chunk and a {self.max_memory_tokens}-token "
                "memory: raise prompt_length or lower chunk_size / max_memory_tokens"
            )
        start = time.perf_counter()
        out = await self.server_manager.generate(
            request_id, prompt_ids=prompt_ids, sampling_params={**sampling_params, "max_tokens": max_tokens}
        )
        seconds = time.perf_counter() - start
        ids = list(out.token_ids)[:max_tokens]
        logprobs = list(out.log_probs)[: len(ids)] if out.log_probs else None
        return prompt_ids, ids, logprobs, seconds, weight_versions(out)

    def _finished(self, ids: list[int], max_tokens: int) -> bool:
        """Whether the model ended its reply itself (an end token, or fewer tokens than the cap)."""
        eos = self.tokenizer.eos_token_id
        return bool(ids) and (ids[-1] == eos or len(ids) < max_tokens)

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> list[AgentLoopOutput]:
        extra_info = kwargs.get("extra_info") or {}
        question = extra_info.get("question")
        context = kwargs.get(self.context_key)
        if not question or context is None:
            raise ValueError(
                f"memagent needs extra_info.question and a {self.context_key!r} column in the row "
                f"(row index {extra_info.get('index')!r}); build rows with `memupdate preprocess hotpotqa`"
            )
        # One id for the whole trajectory: servers keep a trajectory's requests together (sticky sessions).
        request_id = self.loop_context.next_request_id() if self.deterministic_ids else uuid.uuid4().hex
        context_ids = await self.loop.run_in_executor(
            None, lambda: self.tokenizer(str(context), add_special_tokens=False, verbose=False)["input_ids"]
        )
        chunks, dropped = split_chunks(list(context_ids), self.chunk_size, self.max_chunks)
        chunks_total = max(1, -(-len(context_ids) // self.chunk_size))
        memory, cut = NO_MEMORY, 0
        turns: list[tuple[list[int], list[int], list[float] | None, float, dict[str, Any]]] = []
        for i, chunk in enumerate(chunks):
            chunk_text = self.tokenizer.decode(chunk, skip_special_tokens=True)
            content = MEMORY_PROMPT.format(question=question, memory=memory, chunk=chunk_text)
            prompt_ids, ids, logprobs, seconds, versions = await self._turn(
                request_id, content, sampling_params, self.max_memory_tokens, i
            )
            finished = self._finished(ids, self.max_memory_tokens)
            cut += not finished
            memory = memory_text(self.tokenizer.decode(ids, skip_special_tokens=True), finished, self.max_memory_tokens)
            turns.append((prompt_ids, ids, logprobs, seconds, versions))
        content = self.final_prompt.format(question=question, memory=memory)
        final = await self._turn(request_id, content, sampling_params, self.max_final_tokens, len(chunks))
        turns.append(final)
        answer = self.tokenizer.decode(final[1], skip_special_tokens=True).strip()
        outputs = []
        for i, (prompt_ids, ids, logprobs, seconds, versions) in enumerate(turns):
            last = i == len(turns) - 1
            outputs.append(
                AgentLoopOutput(
                    prompt_ids=prompt_ids,
                    response_ids=ids,
                    response_mask=[1] * len(ids),
                    response_logprobs=logprobs,
                    num_turns=2,
                    metrics=AgentLoopMetrics(generate_sequences=seconds),
                    extra_fields={
                        TURN_KEY: i,
                        FINAL_KEY: last,
                        CHUNKS_KEY: len(chunks),
                        CONTEXT_KEY: len(context_ids),
                        CHUNKS_TOTAL_KEY: chunks_total,
                        TRUNCATED_TOKENS_KEY: dropped,
                        TRUNCATIONS_KEY: cut,
                        ANSWER_KEY: answer if last else None,
                        MEMORY_KEY: memory if last else None,
                        **versions,
                    },
                )
            )
        return outputs
