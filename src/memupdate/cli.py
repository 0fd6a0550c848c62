"""The ``memupdate`` command line: the same functions the Snakemake scripts call."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from memupdate.utils.logging import setup_logging

logger = logging.getLogger(__name__)


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
    json.dump(summary["splits"], sys.stdout, indent=2)
    sys.stdout.write("\n")


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
    )
    json.dump(summary, sys.stdout, indent=2)
    sys.stdout.write("\n")


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
    hot.set_defaults(func=_cmd_preprocess_hotpotqa)

    score = sub.add_parser("score", help="score one prediction against one gold answer")
    score.add_argument("prediction")
    score.add_argument("answer")
    score.add_argument("--category", type=int, choices=range(1, 6), help="LoCoMo category for locomo_f1")
    score.set_defaults(func=_cmd_score)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging()
    args.func(args)


if __name__ == "__main__":
    main()
