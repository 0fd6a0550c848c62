# Serving: a vLLM OpenAI server per (experiment, served model), for the fixed role of the other stage
# and for evaluation. The marker is temp(): it only means something while its server runs, and every
# server started by a run is stopped when the run ends (onsuccess/onerror in the Snakefile).


rule serve_model:
    input:
        model=get_served_model,
    output:
        marker=temp("results/{exp}/serve/{served}.ready.json"),
    log:
        "logs/serve_model/{exp}/{served}.log",
    benchmark:
        "benchmarks/serve_model/{exp}/{served}.tsv"
    conda:
        "../workflow/envs/memupdate.yaml"
    resources:
        runtime=60,
        mem_mb=2000,
    params:
        served_model_name=get_served_model_name,
        settings=config["serving"],
        server_log=get_server_log,
        registry=SERVER_REGISTRY,
    script:
        "../workflow/scripts/serve_model.py"
