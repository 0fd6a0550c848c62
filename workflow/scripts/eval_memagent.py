from memupdate.eval.memagent import memagent_length_curve
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
inputs, params = snakemake.input, snakemake.params
memagent_length_curve(
    {name: inputs[name] for name in ("base", "sft", "trained") if name in inputs.keys()},
    {key.removeprefix("test_"): inputs[key] for key in inputs.keys() if key.startswith("test_")},
    params.out_dir,
    params.settings,
    experiment=snakemake.wildcards.exp,
    training_metrics=params.training_metrics,
)
