# Serving: a vLLM OpenAI server per (experiment, purpose, served model): for the fixed role of the
# other training stage, and for evaluation. The marker is temp(): the server stops as soon as Snakemake
# deletes it (its consumers are done), and every server still running stops when the run ends
# (onsuccess/onerror in the Snakefile).


rule serve_model:
    input:
        unpack(get_serve_inputs),
    output:
        marker=temp("results/{exp}/serve/{purpose}/{served}.ready.json"),
    log:
        "logs/serve_model/{exp}/{purpose}/{served}.log",
    benchmark:
        "benchmarks/serve_model/{exp}/{purpose}/{served}.tsv"
    conda:
        "../workflow/envs/memupdate.yaml"
    resources:
        runtime=60,
        mem_mb=2000,
        server=server_request,
    params:
        served_model_name=get_served_model_name,
        settings=get_serving_settings,
        server_log=get_server_log,
        registry=SERVER_REGISTRY,
    script:
        "../workflow/scripts/serve_model.py"
