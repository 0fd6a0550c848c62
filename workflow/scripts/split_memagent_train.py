from memupdate.data.hotpotqa import split_cold_start
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
split_cold_start(
    snakemake.input.rows,
    {"sft": snakemake.output.sft, "grpo": snakemake.output.grpo},
    snakemake.params.sft_percent,
)
