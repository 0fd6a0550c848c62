from memupdate.training.stages import train_memagent
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
inputs, params = snakemake.input, snakemake.params
train_memagent(
    settings=params.settings,
    loop=params.loop,
    model=inputs.model,
    train_files=[inputs.train],
    run_dir=params.run_dir,
    verl={"val_files": inputs.get("val"), "serving": params.serving},
)
