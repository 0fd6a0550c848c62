from memupdate.eval.policy import policy_report
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
inputs = dict(snakemake.input.items())
flags = inputs.pop("flags", None)
policy_report(inputs, snakemake.params.training_metrics, snakemake.output.report, flags)
