# Models: self-contained Hugging Face checkpoint folders every generating rule reads.


# A hub model's download, on the machine that submits the jobs (a local rule: compute nodes often have no
# network), into the Hugging Face cache (HF_HOME, shared by every node); prepare_model reads it offline.
rule download_model:
    output:
        marker="results/models/{model}.download.json",
    log:
        "logs/download_model/{model}.log",
    benchmark:
        "benchmarks/download_model/{model}.tsv"
    conda:
        "../workflow/envs/memupdate.yaml"
    params:
        spec=get_model_spec,
    script:
        "../workflow/scripts/download_model.py"


rule prepare_model:
    input:
        unpack(get_prepare_model_inputs),
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
