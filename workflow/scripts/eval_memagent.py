from memupdate.eval.memagent import memagent_length_curve
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
inputs = snakemake.input
memagent_length_curve(
    {"base": inputs.base, "trained": inputs.trained},
    {key.removeprefix("test_"): inputs[key] for key in inputs.keys() if key.startswith("test_")},
    snakemake.params.out_dir,
    snakemake.params.settings,
    experiment=snakemake.wildcards.exp,
)
