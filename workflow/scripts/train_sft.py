from memupdate.training.sft import cold_start
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
inputs, params = snakemake.input, snakemake.params
cold_start(
    settings=params.settings,
    episode=params.episode,
    model=inputs.model,
    train_files=[inputs.train],
    memories=inputs.memories,
    embeddings=inputs.embeddings,
    embedding_model=params.embedding_model,
    max_content_chars=params.max_content_chars,
    tools=params.tools,
    run_dir=params.run_dir,
    reward=params.reward,
    layout=params.layout,
)
