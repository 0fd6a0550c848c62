from memupdate.eval.locomo import evaluate_locomo
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
inputs, params = snakemake.input, snakemake.params
served = {"qa-base": "qa_base", "base": "base", "sft": "sft", **{name: name for name, _ in params.stages}}
evaluate_locomo(
    experiment=snakemake.wildcards.exp,
    test_file=inputs.test,
    memories=inputs.memories,
    embeddings=inputs.embeddings,
    embedding_model=params.embedding_model,
    tools=params.tools,
    conversations=inputs.conversations,
    markers={name: inputs.get(key) for name, key in served.items() if inputs.get(key)},
    out_dir=params.out_dir,
    settings=params.settings,
    episode=params.episode,
    training_metrics=params.training_metrics,
    published=params.published,
    split=params.split,
    stages=params.stages,
    ingestion=params.ingestion,
)
