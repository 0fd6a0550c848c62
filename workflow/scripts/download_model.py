from memupdate.models.prepare import download_model
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
download_model(snakemake.params.spec, snakemake.output.marker)
