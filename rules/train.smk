# Training: GRPO stages. Stage 1 trains the memory role.


rule train_stage1:
    input:
        unpack(get_stage1_inputs),
    output:
        ckpt=directory("results/{exp}/stage1/ckpt"),
    log:
        "logs/train_stage1/{exp}.log",
    benchmark:
        "benchmarks/train_stage1/{exp}.tsv"
    conda:
        "../workflow/envs/memupdate.yaml"
    threads: 2
    resources:
        runtime=120,
        mem_mb=8000,
    params:
        settings=get_stage1_settings,
        run_dir=get_run_dir,
        tool_config="config/tools/memory_tools.yaml",
        embedding_model=EMBEDDING_MODEL,
        reward=config["reward"],
    script:
        "../workflow/scripts/train_stage1.py"
