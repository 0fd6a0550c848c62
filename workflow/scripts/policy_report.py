from memupdate.eval.policy import policy_report
from memupdate.utils.logging import setup_logging

setup_logging(snakemake.log[0])
policy_report(dict(snakemake.input.items()), snakemake.params.training_metrics, snakemake.output.report)
