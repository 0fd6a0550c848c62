from memupdate.data.ingestion import select_sessions
from memupdate.data.locomo import select_rows
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
select = select_sessions if snakemake.params.ingestion else select_rows
select(
    snakemake.input.rows,
    snakemake.output.rows,
    **snakemake.params.train_on,
    where=f"experiments.{snakemake.wildcards.exp}.stage{snakemake.wildcards.n}.train_on",
)
