from memupdate.data.headroom import write_headroom_rows
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
settings, reward = snakemake.params.settings, snakemake.params.reward
write_headroom_rows(
    snakemake.input.rows,
    snakemake.input.memories,
    snakemake.input.embeddings,
    snakemake.output.rows,
    snakemake.output.flags,
    embedding_model=snakemake.params.embedding_model,
    search_top_k=settings["search_top_k"],
    top_k=reward["top_k"],
    context_chars=reward["context_chars"],
    share=settings["share"],
    seed=settings["seed"],
    summary=snakemake.output.summary,
)
