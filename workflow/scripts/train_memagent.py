from memupdate.training.stages import train_memagent
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
train_memagent(
    backend=snakemake.params.backend,
    settings=snakemake.params.settings,
    loop=snakemake.params.loop,
    model=snakemake.input.model,
    train_files=[snakemake.input.train],
    run_dir=snakemake.params.run_dir,
)
