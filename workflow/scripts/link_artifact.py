from memupdate.utils.io import link_artifact
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
link_artifact(snakemake.input[0], snakemake.output[0])
