from memupdate.preflight import run_preflight
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
run_preflight(snakemake.params.config, experiments=snakemake.params.experiments, json_path=snakemake.output[0])
