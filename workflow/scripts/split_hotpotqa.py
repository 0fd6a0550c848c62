from memupdate.data.hotpotqa import split_rows
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
split_rows(
    snakemake.input.rows,
    {"train": snakemake.output.train, "test": snakemake.output.test},
    snakemake.params.test_percent,
)
