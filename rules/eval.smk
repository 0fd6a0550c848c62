# Evaluation: LoCoMo test conversations, every system the experiment has (no update, full context,
# stage 1 with the base QA model, stage 1 with stage 2), against served models. Predictions under
# results/<exp>/eval/predictions/ survive a failed run, so a rerun completes only what is missing.


rule eval_locomo:
    input:
        unpack(get_eval_inputs),
    output:
        report="results/{exp}/eval/report.json",
    log:
        "logs/eval_locomo/{exp}.log",
    benchmark:
        "benchmarks/eval_locomo/{exp}.tsv"
    conda:
        "../workflow/envs/memupdate.yaml"
    threads: 2
    resources:
        runtime=120,
        mem_mb=6000,
    params:
        settings=get_eval_settings,
        training_metrics=get_training_metrics,
        out_dir=get_eval_dir,
        embedding_model=EMBEDDING_MODEL,
        published="config/published_locomo.yaml",
        split=config["data"]["locomo"]["split"],
    script:
        "../workflow/scripts/eval_locomo.py"
