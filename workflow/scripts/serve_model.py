from memupdate.serving.launch import serve_model
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
params = snakemake.params
serve_model(
    snakemake.input.model,
    snakemake.output.marker,
    served_model_name=params.served_model_name,
    settings=params.settings,
    server_log=params.server_log,
    registry_dir=params.registry,
)
