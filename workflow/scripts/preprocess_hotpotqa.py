from memupdate.data.hotpotqa import preprocess_hotpotqa
from memupdate.models.prepare import read_download
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
preprocess_hotpotqa(
    snakemake.input.data,
    snakemake.output.rows,
    num_docs=int(snakemake.wildcards.ndocs),
    seed=snakemake.params.seed,
    limit=snakemake.params.limit,
    # A hub model's tokenizer is read from its download (compute nodes may have no network).
    tokenizer=read_download(snakemake.input.tokenizer)["path"]
    if "tokenizer" in snakemake.input.keys()
    else snakemake.params.tokenizer,
    summary_path=snakemake.output.summary,
    test_percent=snakemake.params.test_percent,
    sha256=snakemake.params.sha256,
)
