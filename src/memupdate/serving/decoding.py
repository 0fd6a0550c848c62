"""How a served model is asked to decode: every request states every sampling key.

An OpenAI-compatible server fills each sampling key a request leaves out from the model's
``generation_config.json`` (vLLM's server does by default; Qwen2.5-Instruct's sets
``repetition_penalty`` 1.05), while verl sends its own value (1.0) for every key of the trained role. Two
callers of one served role that leave out different keys therefore ask two different decoders: the
reward's S(initial) (the reader scorer) and S(final) (the QA phase) would not be answers of one model.
So :class:`~memupdate.serving.client.OpenAIClient` refuses a request without all of :data:`SAMPLING_KEYS`,
:class:`~memupdate.serving.token_client.VLLMTokenClient` always sends them, and a fixed (served, not
trained) role decodes as :data:`GREEDY` says, whoever asks it: the QA phase, the reader and judge scorers,
the evaluation.

>>> GREEDY.request(32)
{'temperature': 0.0, 'top_p': 1.0, 'top_k': -1, 'repetition_penalty': 1.0, 'max_tokens': 32}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

#: The keys every request to a served model states, so none is left to the model's generation config.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens")


@dataclass(frozen=True)
class Decoding:
    """A decoder: every sampling key but the length cap, which each caller gives (its role's answer cap).

    >>> Decoding(temperature=0.7).params()
    {'temperature': 0.7, 'top_p': 1.0, 'top_k': -1, 'repetition_penalty': 1.0}
    """

    temperature: float = 0.0
    top_p: float = 1.0
    #: -1: no top-k cut (vLLM's and verl's "off").
    top_k: int = -1
    repetition_penalty: float = 1.0

    def params(self) -> dict[str, Any]:
        """The sampling keys without ``max_tokens``: for a caller whose client caps the length (verl's turns)."""
        return asdict(self)

    def request(self, max_tokens: int) -> dict[str, Any]:
        """All of :data:`SAMPLING_KEYS`, as :meth:`OpenAIClient.chat <memupdate.serving.client.OpenAIClient.chat>`
        takes them."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        return {**self.params(), "max_tokens": int(max_tokens)}


#: A fixed role's decoder: greedy, with no truncation or penalty, so a GRPO group varies only in what is
#: trained and one question asked twice (S(initial) by the reader, S(final) by the QA phase) gets one answer.
GREEDY = Decoding()
#: vLLM's ``SamplingParams`` defaults, which verl's own vLLM server decodes with for a key verl does not
#: send: what the token client sends for a key verl-style sampling params leave out.
VLLM_DEFAULTS = Decoding(temperature=1.0)
