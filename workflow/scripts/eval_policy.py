from memupdate.eval.policy import evaluate_policy
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
inputs, params = snakemake.input, snakemake.params
settings = params.settings
evaluate_policy(
    model=inputs.model,
    rows=inputs.rows,
    memories=inputs.memories,
    embeddings=inputs.embeddings,
    out_dir=params.out_dir,
    episode=params.episode,
    reward=params.reward,
    n=settings["n"],
    questions=settings["questions"],
    batch_size=settings["batch_size"],
    seed=settings["seed"],
    server=settings["server"],
    serving=params.serving,
    embedding_model=params.embedding_model,
    max_content_chars=params.max_content_chars,
    tools=params.tools,
    flags=inputs.get("flags"),
)
