from memupdate.training.local import local_config, train_local
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
inputs = snakemake.input
train_local(
    local_config(
        snakemake.params.settings,
        model_path=inputs.model,
        train_files=[inputs.train],
        memories=inputs.memories,
        embeddings=inputs.embeddings,
        tool_config=snakemake.params.tool_config,
        embedding_model=snakemake.params.embedding_model,
        run_dir=snakemake.params.run_dir,
        reward=snakemake.params.reward,
    )
)
