# Serving: a vLLM OpenAI server per (experiment, purpose, served model): for the fixed role of the
# other training stage, and for evaluation. The marker is temp(): the server stops as soon as Snakemake
# deletes it (its consumers are done), and every server still running stops when the run ends
# (onsuccess/onerror in the Snakefile).


rule serve_model:
    input:
        unpack(get_serve_inputs),
        # The server's own job asks for GPUs.
        unpack(gpu_preflight("serve_model")),
    output:
        marker=temp("results/{exp}/serve/{purpose}/{served}.ready.json"),
    log:
        "logs/serve_model/{exp}/{purpose}/{served}.log",
    benchmark:
        "benchmarks/serve_model/{exp}/{purpose}/{served}.tsv"
    conda:
        "../workflow/envs/memupdate.yaml"
    # The job starts a server and waits for it to answer; the server, not the job, does the work, and it runs
    # outside Snakemake's count of cores from then on anyway. So the job holds no core: a training job (2
    # cores) starts beside a server's start-up instead of after it. (Snakemake 9 selects no job, not even one
    # of no core, while every core is held: a server ready while a training job runs waits for it; on the demos
    # run.sh counts one core more than the machine has, for their policy evaluations.) On Slurm, the job asks for
    # one CPU.
    threads: 0
    resources:
        runtime=60,
        mem_mb=serve_job_mem_mb,
        cpus_per_task=1,
        server=server_request,
    params:
        served_model_name=get_served_model_name,
        settings=get_serving_settings,
        server_log=get_server_log,
        registry=SERVER_REGISTRY,
    script:
        "../workflow/scripts/serve_model.py"
