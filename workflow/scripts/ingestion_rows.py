from memupdate.data.ingestion import build_ingestion_rows
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
build_ingestion_rows(
    snakemake.input.rows,
    snakemake.input.memories,
    snakemake.output.rows,
    split=snakemake.wildcards.part,
    questions_per_session=snakemake.params.questions_per_session,
)
