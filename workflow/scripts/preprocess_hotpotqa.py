from memupdate.data.hotpotqa import preprocess_hotpotqa
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
preprocess_hotpotqa(
    snakemake.input.data,
    snakemake.output.rows,
    num_docs=int(snakemake.wildcards.ndocs),
    seed=snakemake.params.seed,
    limit=snakemake.params.limit,
    tokenizer=snakemake.params.tokenizer,
    summary_path=snakemake.output.summary,
    test_percent=snakemake.params.test_percent,
)
