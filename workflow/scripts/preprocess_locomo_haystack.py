from memupdate.data.locomo_haystack import preprocess_locomo_haystack
from memupdate.models.prepare import read_download
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
settings = snakemake.params.settings
preprocess_locomo_haystack(
    snakemake.input.data,
    {"train": snakemake.output.train, "test": snakemake.output.test},
    snakemake.output.summary,
    split=snakemake.params.split,
    num_docs=int(snakemake.wildcards.ndocs),
    turns_per_window=settings["turns_per_window"],
    seed=settings["seed"],
    # A hub model's tokenizer is read from its download (compute nodes may have no network).
    tokenizer=read_download(snakemake.input.tokenizer)["path"]
    if "tokenizer" in snakemake.input.keys()
    else settings["tokenizer"],
    sha256=snakemake.params.sha256,
)
