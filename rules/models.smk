# Models: self-contained Hugging Face checkpoint folders every generating rule reads.


rule prepare_model:
    output:
        model=directory("results/models/{model}"),
    log:
        "logs/prepare_model/{model}.log",
    benchmark:
        "benchmarks/prepare_model/{model}.tsv"
    conda:
        "../workflow/envs/memupdate.yaml"
    resources:
        **job_resources("prepare_model", model_wildcard, runtime=30, mem_mb=4000),
    params:
        spec=get_model_spec,
    script:
        "../workflow/scripts/prepare_model.py"
