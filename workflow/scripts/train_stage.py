from memupdate.training.stages import train_stage
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
inputs, params = snakemake.input, snakemake.params
train_stage(
    trained_role=params.trained_role,
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
    fixed_marker=inputs.get("fixed"),
    verl={"val_files": inputs.get("val"), "serving": params.serving},
)
