from memupdate.models.prepare import prepare_model
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
prepare_model(snakemake.params.spec, snakemake.output.model, download=snakemake.input.get("download"))
