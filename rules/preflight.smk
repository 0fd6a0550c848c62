# Preflight: on one GPU node, check what the run needs (CUDA, NCCL, flash-attn, the verl and vLLM versions,
# every model offline, checkpoint disk) and fail in minutes with the fix, not hours into a training job:
#   snakemake --profile profiles/slurm preflight --config scale=full
# Every job that asks for GPUs waits for its report (gpu_preflight), unless `--config preflight=false`. It reruns
# only when its report is missing: after changing the environment, add `-R preflight`.

from memupdate.cluster import Job


rule preflight:
    input:
        get_preflight_inputs,
    output:
        PREFLIGHT_REPORT,
    log:
        "logs/preflight/preflight.log",
    benchmark:
        "benchmarks/preflight/preflight.tsv"
    conda:
        "../workflow/envs/memupdate.yaml"
    resources:
        # One GPU, asked for as every GPU rule asks (memupdate.cluster.Job: gres gpu:1, tasks_per_gpu=0).
        **Job(gpus_per_node=1, cpus_per_task=4, mem_mb=16000, runtime=20).snakemake(),
    params:
        config=config,
        experiments=SCALE["experiments"],
    script:
        "../workflow/scripts/preflight.py"
