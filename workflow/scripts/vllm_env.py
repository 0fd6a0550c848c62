from memupdate.serving.vllm_env import write_env_marker
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
write_env_marker(snakemake.output.marker)
