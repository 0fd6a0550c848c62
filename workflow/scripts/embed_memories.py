from memupdate.memory.cache import build_embedding_cache
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
build_embedding_cache(
    snakemake.input.memories,
    snakemake.output.cache,
    snakemake.params.model,
    snakemake.params.batch_size,
    summary_path=snakemake.output.summary,
    pool_dir=snakemake.params.pool,
)
