"""Token-in, token-out generation with Hugging Face transformers, shaped like verl's ``LLMServerClient``.

Tests and the in-process policy evaluation (``server: hf``) hand this object to verl's ``AgentLoopWorker`` as
its server: verl only calls
``await generate(request_id, prompt_ids=..., sampling_params=...)`` (``verl-0.9.1.md`` §2b).

Sampling is reproducible: every request draws from its own generator, seeded by (seed, request id,
turn), and requests run one at a time, so results do not depend on how concurrent trajectories
interleave. That costs throughput against batching; the vLLM client is the fast path.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import defaultdict
from typing import Any

import torch
from verl.workers.rollout.replica import TokenOutput

logger = logging.getLogger(__name__)


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, generator: torch.Generator) -> int:
    """One token from ``logits`` [vocab]: greedy at temperature 0, else top-k / top-p sampling.

    >>> sample_token(torch.tensor([0.0, 5.0, 1.0]), 0.0, 1.0, -1, torch.Generator())
    1
    """
    if temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits.float() / temperature
    if top_k and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


class HFGenerator:
    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, max_new_tokens: int, seed: int = 0):
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.generated_tokens = 0
        self.seconds = 0.0
        self._turns: dict[str, int] = defaultdict(int)
        # One forward at a time: two threads on 2 cores only slow each other down.
        self._lock = threading.Lock()

    def _seed_for(self, request_id: str) -> int:
        self._turns[request_id] += 1
        key = f"{self.seed}:{request_id}:{self._turns[request_id]}"
        return int(hashlib.sha256(key.encode()).hexdigest()[:15], 16)

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs
    ) -> TokenOutput:
        seed = self._seed_for(request_id)
        tokens = await asyncio.to_thread(self._generate, list(prompt_ids), sampling_params, seed)
        return TokenOutput(token_ids=tokens, log_probs=None, stop_reason="completed")

    @torch.no_grad()
    def _generate(self, prompt_ids: list[int], params: dict[str, Any], seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        stop = set(params.get("stop_token_ids") or []) | {self.tokenizer.eos_token_id}
        max_new = min(self.max_new_tokens, params.get("max_tokens") or self.max_new_tokens)
        temperature = float(params.get("temperature", 1.0))
        top_p, top_k = float(params.get("top_p", 1.0)), int(params.get("top_k", -1) or -1)
        with self._lock:
            start = time.perf_counter()
            was_training = self.model.training
            self.model.eval()
            try:
                out = self.model(torch.tensor([prompt_ids]), use_cache=True)
                tokens: list[int] = []
                for _ in range(max_new):
                    token = sample_token(out.logits[0, -1], temperature, top_p, top_k, generator)
                    tokens.append(token)
                    if token in stop:
                        break
                    out = self.model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
            finally:
                self.model.train(was_training)
                self.seconds += time.perf_counter() - start
        self.generated_tokens += len(tokens)
        return tokens
