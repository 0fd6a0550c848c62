from memupdate.data.fetch import fetch_file
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
fetch_file(dest=snakemake.output.data, store=snakemake.params.store, **snakemake.params.spec)
