"""Scores and reports from saved predictions: ``report.json`` (every number), ``report.md`` (from a template of
``templates/``) and PNG plots; Snakemake's report (``snakemake --report``) shows the last two.

Everything here is computed from ``predictions/<system>.jsonl`` and the training runs' ``metrics.jsonl``,
so a test (or a reader) can recompute every reported number from the saved files. Metrics come from
:mod:`memupdate.metrics` only, the implementations the rewards use.

Two protocols (``data-models-anchors.md`` §1): the official LoCoMo F1 over all five categories (category
5 scored as abstention), and the Mem0 protocol on categories 1-4 (set-based F1, BLEU-1, and J from a
served judge when one is given). Categories are reported by numeric id with the file's type names.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from memupdate import metrics
from memupdate.eval.stats import paired_by_key
from memupdate.utils.io import read_text_utf8, write_json_atomic, write_text_atomic

logger = logging.getLogger(__name__)

CATEGORY_NAMES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
MEM0_CATEGORIES = (1, 2, 3, 4)
#: Systems that may leave a question out (its prompt does not fit the model); every other system's
#: unanswered question scores 0.
MAY_SKIP = ("full_context",)


def score_prediction(record: Mapping[str, Any]) -> dict[str, float | None]:
    """The per-question scores of one saved prediction: LoCoMo F1 of the LoCoMo-protocol answer, Mem0 F1,
    BLEU-1 and J of the Mem0-protocol answer (None where a protocol does not ask the question, or was not
    run). A question asked but not answered scores 0: :func:`summarize` decides which records those are.

    >>> score_prediction({"predictions": {"locomo": "7 May 2023"}, "answer": "7 May 2023", "category": 2})["locomo_f1"]
    1.0
    >>> choices = {"a": "Bo", "b": "Not mentioned in the conversation"}
    >>> score_prediction({"predictions": {"locomo": "(b)"}, "category": 5, "choices": choices})["locomo_f1"]
    1.0
    >>> score_prediction({"predictions": {"locomo": None, "mem0": None}, "answer": "x", "category": 1})
    {'locomo_f1': 0.0, 'mem0_f1': 0.0, 'bleu1': 0.0, 'j': 0.0}
    """
    predictions, category = record.get("predictions") or {}, int(record["category"])
    scores: dict[str, float | None] = {"locomo_f1": None, "mem0_f1": None, "bleu1": None, "j": None}
    if "locomo" in predictions:
        prediction = predictions["locomo"]
        if prediction is None:
            scores["locomo_f1"] = 0.0
        elif category == 5:
            if record.get("choices"):
                prediction = metrics.locomo_choice_answer(str(prediction), record["choices"])
            scores["locomo_f1"] = metrics.locomo_f1(str(prediction), "", 5)
        else:
            scores["locomo_f1"] = metrics.locomo_f1(str(prediction), str(record["answer"]), category)
    if "mem0" in predictions and category in MEM0_CATEGORIES:
        prediction = predictions["mem0"]
        if prediction is None:
            scores.update(mem0_f1=0.0, bleu1=0.0, j=0.0)
        else:
            scores["mem0_f1"] = metrics.mem0_f1(str(prediction), str(record["answer"]))
            scores["bleu1"] = metrics.bleu1(str(prediction), str(record["answer"]))
            # A judge reply that could not be parsed counts as not correct, and is counted (summarize).
            judged = record.get("judge_model") is not None
            scores["j"] = float(record["judge"] or 0.0) if judged else None
    return scores


def _mean(values: Sequence[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return round(float(np.mean(values)), 4) if values else None


def _percentile(values: Sequence[float | None], q: float) -> float | None:
    values = [v for v in values if v is not None]
    return round(float(np.percentile(values, q)), 4) if values else None


def _answered(record: Mapping[str, Any]) -> bool:
    predictions = record.get("predictions") or {}
    return bool(predictions) and all(p is not None for p in predictions.values())


def summarize(records: Sequence[Mapping[str, Any]], *, may_skip: bool = False) -> dict[str, Any]:
    """Every number of one system's row in the report, from its saved predictions.

    Means are over every question asked: a question a memory system left unanswered scores 0 on every
    metric and is counted in ``unanswered``. Only a system that ``may_skip`` (``full_context``, whose
    prompt can exceed the model's context) leaves questions out of its means; they are counted in
    ``skipped``, and its row is reported apart because it is scored on fewer questions."""
    skipped = [r for r in records if may_skip and r.get("skipped")]
    scored = [{**r, **score_prediction(r)} for r in records if not (may_skip and r.get("skipped"))]
    mem0 = [r for r in scored if r["category"] in MEM0_CATEGORIES]
    per_category = {}
    for category, name in CATEGORY_NAMES.items():
        rows = [r for r in scored if r["category"] == category]
        per_category[str(category)] = {
            "name": name,
            "n": len(rows),
            "locomo_f1": _mean([r["locomo_f1"] for r in rows]),
            "mem0_f1": _mean([r["mem0_f1"] for r in rows]),
            "bleu1": _mean([r["bleu1"] for r in rows]),
            "j": _mean([r["j"] for r in rows]),
        }
    protocols = sorted({p for r in scored for p in (r.get("predictions") or {})})
    return {
        "questions": len(records),
        "scored": len(scored),
        "answered": sum(_answered(r) for r in scored),
        "unanswered": sum(not _answered(r) for r in scored),
        "skipped": len(skipped),
        "skip_reasons": skip_reasons([str(r.get("skipped")) for r in skipped]),
        "locomo": {"f1": _mean([r["locomo_f1"] for r in scored]), "n": sum(r["locomo_f1"] is not None for r in scored)},
        "mem0": {
            "f1": _mean([r["mem0_f1"] for r in mem0]),
            "bleu1": _mean([r["bleu1"] for r in mem0]),
            "j": _mean([r["j"] for r in mem0]),
            "j_unparsed": sum(bool(r.get("judge_unparsed")) for r in mem0),
            "n": sum(r["mem0_f1"] is not None for r in mem0),
        },
        "per_category": per_category,
        "evidence_recall_at_k": _mean([r.get("evidence_recall") for r in scored]),
        "context_chars_mean": _mean([r.get("context_chars") for r in scored]),
        # The prompt the QA model saw (chat template included), per protocol.
        "context_tokens_mean": {p: _mean([(r.get("context_tokens") or {}).get(p) for r in records]) for p in protocols},
        "latency_s": {
            "p50": _percentile([r.get("latency_s") for r in scored], 50),
            "p95": _percentile([r.get("latency_s") for r in scored], 95),
        },
        # How its memory was built: question-conditioned (an episode per question), question-agnostic (one
        # per session, no question seen) or None (no memory model: no_update, full_context).
        "memory_setting": next((r["memory_setting"] for r in records if r.get("memory_setting")), None),
        "termination": _counts(r.get("termination_reason") for r in scored if r.get("termination_reason")),
        "memory": _memory_stats([r["memory_stats"] for r in scored if r.get("memory_stats")]),
    }


_PROMPT_TOKENS = re.compile(r"(\d+) prompt tokens")


def skip_reasons(reasons: Sequence[str]) -> list[str]:
    """Why questions were skipped, one line per reason with the questions' prompt sizes as a range (one line
    per question would repeat the same reason sixty times).

    >>> skip_reasons(["locomo: 20389 prompt tokens > 4064", "locomo: 25627 prompt tokens > 4064", "other"])
    ['locomo: 20389-25627 prompt tokens > 4064 (2 questions)', 'other (1 question)']
    """
    groups: dict[str, list[int]] = {}
    for reason in reasons:
        for part in reason.split("; "):
            sizes = [int(n) for n in _PROMPT_TOKENS.findall(part)]
            groups.setdefault(_PROMPT_TOKENS.sub("{} prompt tokens", part), []).extend(sizes[:1] or [-1])
    lines = []
    for template, sizes in groups.items():
        known = [n for n in sizes if n >= 0]
        span = f"{min(known)}-{max(known)}" if known and min(known) != max(known) else str(known[0]) if known else ""
        count = f"{len(sizes)} question{'s' if len(sizes) > 1 else ''}"
        lines.append(f"{template.replace('{}', span) if known else template} ({count})")
    return lines


def ingestion_summary(log: Mapping[str, Any]) -> dict[str, Any]:
    """The report's numbers of an ingestion log: sessions, seconds (in all, per session batch, per episode),
    memories appended by the sessions and built by the episodes over all conversations, and how the
    episodes ended."""
    last = [sessions[-1] for sessions in log["conversations"].values() if sessions]
    every = [s for sessions in log["conversations"].values() for s in sessions]
    return {
        "episodes": log["episodes"],
        "termination": _counts(s["termination_reason"] for s in every if s.get("termination_reason")),
        "seconds": log["seconds"],
        "seconds_per_step": log["seconds_per_step"],
        "seconds_per_episode": log["seconds_per_episode"],
        "appended": sum(s["new_memories"] for s in every),
        "built": sum(s["memories"] for s in last),
    }


MEMORY_STATS = ("initial_count", "final_count", "created", "updated", "deleted", "merged", "split")


def _memory_stats(stats: Sequence[Mapping[str, Any]]) -> dict[str, float | None] | None:
    """Mean store size and edits per episode of a memory system (None for the systems without episodes)."""
    if not stats:
        return None
    return {f"{k}_mean": _mean([s.get(k) for s in stats]) for k in MEMORY_STATS}


def _counts(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out


class JSONLError(ValueError):
    """A line of a JSONL file is not a JSON object; the message names the file and the line."""


def load_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL file, one JSON object a line (blank lines skipped).

    A torn or edited line raises :class:`JSONLError` naming the file and line, torn last line included:
    a report must not quietly leave out a question (``eval locomo`` redoes a torn last line on resume).
    """
    path = Path(path)
    records = []
    for number, line in enumerate(read_text_utf8(path, JSONLError).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise JSONLError(
                f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno}); the line is torn or edited: "
                "rerun the step that wrote the file (`eval locomo` redoes a torn last line)"
            ) from None
        if not isinstance(record, dict):
            raise JSONLError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


# --------------------------------------------------------------------------------- training curves


def training_curves(metrics_files: Mapping[str, str | Path]) -> dict[str, list[dict[str, Any]]]:
    """Each training stage's per-step metrics (reward mean and spread, memories, turns, terminations) of the steps
    that trained: verl logs its validation before training as a step 0 with no training reward, which would plot as
    a reward of 0."""
    keep = (
        "step",
        "reward_mean",
        "reward_std",
        "reward_min",
        "reward_max",
        "num_turns_mean",
        "memories_final_mean",
        "ops_created_mean",
        "ops_updated_mean",
        "ops_deleted_mean",
        "qa_initial_mean",
        "qa_final_mean",
        "response_tokens_mean",
        "termination",
    )
    curves = {}
    for name, path in metrics_files.items():
        if Path(path).is_file():
            curves[name] = [{k: m.get(k) for k in keep} for m in load_jsonl(path) if "reward_mean" in m]
    return curves


#: Per-step training metrics the report plots (metrics.jsonl's keys: memupdate.training.tracking.VERL_METRICS), one
#: panel each; the held-out reward (verl's validation, at the steps it ran) shares the training reward's panel.
CURVES = ("reward_mean", "num_turns_mean", "response_tokens_mean", "kl")
HELDOUT_CURVE = "heldout_reward_mean"
#: How many held-out questions that validation scored (verl drops a trajectory that failed).
HELDOUT_QUESTIONS = "heldout_questions"


def training_steps(metrics: str | Path, plot: Path) -> list[dict[str, Any]]:
    """A training run's per-step curves (:data:`CURVES` and the held-out reward, from its ``metrics.jsonl``),
    plotted into ``plot``, one panel each."""
    keys = ("step", *CURVES, HELDOUT_CURVE, HELDOUT_QUESTIONS)
    steps = [{k: step.get(k) for k in keys} for step in load_jsonl(metrics)]
    _plot_training(steps, plot)
    return steps


def _plot_training(steps: Sequence[Mapping[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [key for key in CURVES if any(s.get(key) is not None for s in steps)]
    fig, axes = plt.subplots(1, len(shown), figsize=(3.2 * len(shown), 2.8), squeeze=False)
    for ax, key in zip(axes[0], shown, strict=True):
        curves = [(key, "train")] + ([(HELDOUT_CURVE, "held out")] if key == "reward_mean" else [])
        for curve, label in curves:
            points = [(s["step"], s[curve]) for s in steps if s.get(curve) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=label)
        if len(ax.get_lines()) > 1:
            ax.legend(fontsize="small")
        ax.set_title(key)
        ax.set_xlabel("step")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)


# ---------------------------------------------------------------------------------------- plots


#: The folder of a report's plots, beside report.md: the rule's output that Snakemake's report shows.
FIGURES = "figures"


def _plots(report: Mapping[str, Any], folder: Path) -> list[str]:
    """The report's plots, written into ``folder`` (emptied first: a rerun leaves no stale one); their names."""
    import shutil

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = []
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    systems = report["systems"]
    if systems:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        width = 0.8 / max(1, len(systems))
        for i, (name, row) in enumerate(systems.items()):
            values = [row["per_category"][str(c)]["locomo_f1"] or 0.0 for c in CATEGORY_NAMES]
            ax.bar(np.arange(5) + i * width, values, width, label=name)
        ax.set_xticks(np.arange(5) + width * (len(systems) - 1) / 2)
        ax.set_xticklabels([f"{c} {n}" for c, n in CATEGORY_NAMES.items()])
        ax.set_ylabel("LoCoMo F1")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
        ax.set_title("LoCoMo F1 per category (numeric ids)")
        fig.tight_layout()
        fig.savefig(folder / "per_category.png", dpi=110)
        plt.close(fig)
        plots.append("per_category.png")
    curves = report["training"]
    if curves:
        fig, axes = plt.subplots(1, 5, figsize=(19, 3.4))
        reasons = sorted({r for steps in curves.values() for s in steps for r in (s["termination"] or {})})
        for name, steps in curves.items():
            x = [s["step"] for s in steps]
            mean = np.array([s["reward_mean"] or 0.0 for s in steps])
            std = np.array([s["reward_std"] or 0.0 for s in steps])
            axes[0].plot(x, mean, marker="o", label=name)
            axes[0].fill_between(x, mean - std, mean + std, alpha=0.2)
            axes[1].plot(x, [s["num_turns_mean"] or 0 for s in steps], marker="o", label=name)
            axes[2].plot(x, [s["memories_final_mean"] or 0 for s in steps], marker="o", label=name)
            for op, style in (("created", "-"), ("updated", "--"), ("deleted", ":")):
                values = [s.get(f"ops_{op}_mean") or 0 for s in steps]
                axes[3].plot(x, values, style, marker=".", label=f"{name}: {op}")
            # Share of episodes per termination reason, one line per (stage, reason).
            for reason in reasons:
                shares = [
                    (s["termination"] or {}).get(reason, 0) / max(1, sum((s["termination"] or {}).values()))
                    for s in steps
                ]
                axes[4].plot(x, shares, marker=".", label=f"{name}: {reason}")
        titles = (
            "reward (mean ± std)",
            "turns per episode",
            "memories at the end",
            "edits per episode",
            "termination reasons (share)",
        )
        for ax, title in zip(axes, titles, strict=True):
            ax.set_title(title)
            ax.set_xlabel("step")
        axes[3].legend(fontsize=7)
        axes[4].legend(fontsize=7)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(folder / "training.png", dpi=110)
        plt.close(fig)
        plots.append("training.png")
    return plots


# --------------------------------------------------------------------------------------- report


def _pct(value: float | None) -> str:
    """A score in [0, 1] as a percentage."""
    return "–" if value is None else f"{100 * value:.1f}"


def _num(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _models(row: Mapping[str, Any]) -> str:
    """``memory: <folder> / qa: <folder>`` from the checkpoint folders a system's predictions were made with."""
    models = row.get("models") or {}
    text = " / ".join(f"{role}: {Path(m['path']).name}" for role, m in sorted(models.items())) or "–"
    return f"{text} (the weights of {row['same_weights_as']}: its predictions)" if row.get("same_weights_as") else text


#: The report's label of a system's memory setting (summarize's ``memory_setting``).
SETTING_LABELS = {"question-conditioned": "conditioned", "question-agnostic": "agnostic", None: "–"}


def _tokens(row: Mapping[str, Any]) -> str:
    """Mean QA prompt tokens per protocol, ``locomo 812 / mem0 640``."""
    return " / ".join(f"{p} {_num(v, 0)}" for p, v in (row.get("context_tokens_mean") or {}).items()) or "–"


def _terminations(counts: Mapping[str, int] | None) -> str:
    """``done 2, no_tool_call 1``: episodes per reason, or – where none was recorded (verl's steps)."""
    return ", ".join(f"{k} {v}" for k, v in sorted((counts or {}).items())) or "–"


def render_markdown(report: Mapping[str, Any]) -> str:
    """``report.md`` from ``report.json``'s content, through ``templates/locomo_report.md.j2``."""
    return render_template(
        "locomo_report.md.j2",
        report=report,
        categories=CATEGORY_NAMES,
        memory_stats=MEMORY_STATS,
        figures=FIGURES,
        pct=_pct,
        num=_num,
        points=lambda value: f"{100 * value:+.1f}",
        metric_names=COMPARED_METRICS,
        models=_models,
        tokens=_tokens,
        terminations=_terminations,
        setting_label=lambda row: SETTING_LABELS[row.get("memory_setting")],
    )


def render_template(name: str, **context: Any) -> str:
    """A Markdown template of ``memupdate/eval/templates`` rendered with ``context`` (no HTML escaping: the
    output is Markdown)."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("memupdate.eval", "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    return env.get_template(name).render(**context)


def build_report(
    out_dir: str | Path,
    predictions: Mapping[str, str | Path],
    *,
    experiment: str,
    settings: Mapping[str, Any],
    judge: str | None = None,
    training_metrics: Mapping[str, str | Path] | None = None,
    published: str | Path | None = None,
    split: str | None = None,
) -> dict[str, Any]:
    """Write ``report.json``, ``report.md`` and the plots (``figures/``) into ``out_dir``; return the report.
    ``split`` names the LoCoMo split the test conversations come from (``data.locomo.split``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    systems, conversations, questions, asked = {}, set(), 0, {}
    per_question: dict[str, dict[str, dict[str, float]]] = {metric: {} for metric in COMPARED_METRICS}
    for name in system_order(predictions):
        path = predictions[name]
        records = load_jsonl(path)
        asked[name] = {r["namespace"] for r in records}
        systems[name] = summarize(records, may_skip=name in MAY_SKIP)
        scores = {r["namespace"]: score_prediction(r)["locomo_f1"] for r in records}
        if name not in MAY_SKIP and scores and None not in scores.values():
            per_question["locomo_f1"][name] = scores
            # The questions with gold evidence (LoCoMo's category 5 has none).
            recall = {r["namespace"]: r["evidence_recall"] for r in records if r.get("evidence_recall") is not None}
            if recall:
                per_question["evidence_recall"][name] = recall
        # The checkpoints the predictions were made with (the evaluator's fingerprint beside them).
        meta = Path(path).with_suffix(".meta.json")
        if meta.is_file():
            systems[name]["models"] = json.loads(meta.read_text(encoding="utf-8")).get("models")
        # A system whose memory model has another's weights took that one's predictions (LocomoEvaluator.run).
        twins = {r.get("same_weights_as") for r in records}
        if len(twins) == 1 and None not in twins:
            systems[name]["same_weights_as"] = twins.pop()
        # A question-agnostic system's ingestion (memupdate.eval.locomo.LocomoEvaluator.ingest): its time.
        log = out_dir / "runs" / name / "ingestion.json"
        if log.is_file():
            systems[name]["ingestion"] = ingestion_summary(json.loads(log.read_text(encoding="utf-8")))
            # Its episodes are sessions, not questions: their terminations are the ingestion's.
            systems[name]["termination"] = systems[name]["ingestion"]["termination"]
        conversations |= {r["sample_id"] for r in records}
        questions = max(questions, len(records))
    reference = next(iter(asked.values()), set())
    if any(a != reference for a in asked.values()):
        raise ValueError(
            f"systems were asked different questions ({ {n: len(a) for n, a in asked.items()} }); every system must "
            "answer the same ones: rerun the evaluation (or delete the predictions of the systems that differ)"
        )
    report: dict[str, Any] = {
        "experiment": experiment,
        "questions": questions,
        "split": split,
        "conversations": sorted(conversations),
        "settings": dict(settings),
        "judge": judge,
        "systems": systems,
        "comparisons": [c for metric in COMPARED_METRICS for c in comparisons(per_question[metric], metric)],
        "training": training_curves(training_metrics or {}),
    }
    if published:
        report["published"] = yaml.safe_load(Path(published).read_text(encoding="utf-8"))
    report["plots"] = _plots(report, out_dir / FIGURES)
    write_text_atomic(out_dir / "report.md", render_markdown(report))
    # Last: report.json is the rule's output, so it exists only once everything else does.
    write_json_atomic(out_dir / "report.json", report)
    return report


#: Report rows in this order, then the system after each training stage in stage order (:func:`stage_number`),
#: then any other system by name.
SYSTEM_ORDER = ("no_update", "full_context", "base+qa_base", "sft+qa_base")
#: Pairs of systems compared question by question (first minus second), where both were evaluated: what a
#: memory policy adds over the untouched store and over the policy before training; besides these, each
#: training stage's system is compared with the previous stage's (:func:`comparisons`).
COMPARISONS = (
    ("base+qa_base", "no_update"),
    ("sft+qa_base", "base+qa_base"),
    ("stage1+qa_base", "sft+qa_base"),
    ("stage1+qa_base", "base+qa_base"),
    ("stage1+qa_base", "no_update"),
)
#: The system after a training stage: ``<memory model>+<QA model>`` (memupdate.eval.locomo.stage_systems).
_STAGE_SYSTEM = re.compile(r"stage(\d+)\+(?:qa_base|stage(\d+))")


def stage_number(system: str) -> int | None:
    """The training stage a system is the result of (its latest checkpoint), None for any other system.

    >>> stage_number("stage3+stage2"), stage_number("stage1+stage2"), stage_number("sft+qa_base")
    (3, 2, None)
    """
    match = _STAGE_SYSTEM.fullmatch(system)
    if match is None:
        return None
    return max(int(n) for n in match.groups() if n)


def system_order(names: Iterable[str]) -> list[str]:
    """Report rows: :data:`SYSTEM_ORDER`, the stages' systems in stage order, then the rest by name.

    >>> system_order(["stage3+stage2", "zz", "stage1+qa_base", "no_update", "stage1+stage2"])
    ['no_update', 'stage1+qa_base', 'stage1+stage2', 'stage3+stage2', 'zz']
    """

    def rank(name: str) -> tuple[int, int, str]:
        if name in SYSTEM_ORDER:
            return 0, SYSTEM_ORDER.index(name), name
        stage = stage_number(name)
        return (1, stage, name) if stage is not None else (2, 0, name)

    return sorted(names, key=rank)


#: The per-question metrics the report compares, with their names in report.md.
COMPARED_METRICS = {"locomo_f1": "LoCoMo F1", "evidence_recall": "evidence recall@k"}


def comparisons(per_question: Mapping[str, Mapping[str, float]], metric: str = "locomo_f1") -> list[dict[str, Any]]:
    """Paired bootstrap 95% intervals (:func:`memupdate.eval.stats.paired_by_key`) of ``metric`` (one of
    :data:`COMPARED_METRICS`) for the :data:`COMPARISONS` and each training stage's system against the previous
    stage's, whose two systems both have per-question scores (namespace -> score).

    >>> out = comparisons({"no_update": {"q1": 0.0, "q2": 0.5}, "stage1+qa_base": {"q1": 1.0, "q2": 0.5}})
    >>> [(c["system"], c["baseline"], c["metric"], c["mean_difference"]) for c in out]
    [('stage1+qa_base', 'no_update', 'locomo_f1', 0.5)]
    """
    stages = [name for name in system_order(per_question) if stage_number(name) is not None]
    out = []
    for system, baseline in [*COMPARISONS, *((b, a) for a, b in zip(stages, stages[1:], strict=False))]:
        if system in per_question and baseline in per_question:
            interval = paired_by_key(per_question[system], per_question[baseline])
            out.append({"system": system, "baseline": baseline, "metric": metric, **interval})
    return out


def rebuild_report(
    out_dir: str | Path,
    *,
    experiment: str,
    training_metrics: Mapping[str, str | Path] | None = None,
    published: str | Path | None = None,
    split: str | None = None,
) -> dict[str, Any]:
    """The report again from ``out_dir/predictions`` alone (``memupdate eval report``): the settings come
    from the predictions' fingerprints, the judge's name from the judged records, the split's name from
    ``split`` or else the report being replaced."""
    previous = Path(out_dir) / "report.json"
    if split is None and previous.is_file():
        split = json.loads(previous.read_text(encoding="utf-8")).get("split")
    folder = Path(out_dir) / "predictions"
    files = {p.name[: -len(".jsonl")]: p for p in folder.glob("*.jsonl") if not p.name.endswith(".stale.jsonl")}
    if not files:
        raise FileNotFoundError(f"no predictions in {folder}: run `memupdate eval locomo` (or the eval_locomo rule)")
    predictions = {name: files[name] for name in system_order(files)}
    settings: dict[str, Any] = {}
    judges = set()
    for path in predictions.values():
        meta = path.with_suffix(".meta.json")
        if meta.is_file() and not settings:
            settings = json.loads(meta.read_text(encoding="utf-8")).get("settings", {})
        judges |= {r["judge_model"] for r in load_jsonl(path) if r.get("judge_model")}
    if len(judges) > 1:
        raise ValueError(
            f"predictions in {folder} were judged by different judges {sorted(judges)}; rerun the evaluation"
        )
    return build_report(
        out_dir,
        predictions,
        experiment=experiment,
        settings=settings,
        judge=next(iter(judges), None),
        training_metrics=training_metrics,
        published=published,
        split=split,
    )
