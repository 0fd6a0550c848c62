from memupdate.data.locomo import preprocess_locomo
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
out = snakemake.output
preprocess_locomo(
    snakemake.input.data,
    {"train": out.train, "val": out.val, "test": out.test, "memories": out.memories},
    split=snakemake.params.split,
    split_name=snakemake.params.split_name,
    memory_sources=snakemake.params.memory_sources,
    drop_categories=snakemake.params.drop_categories,
    summary_path=out.summary,
    sha256=snakemake.params.sha256,
)
