# MemAgent: one policy trained with trajectory-level GRPO to read HotpotQA haystacks chunk by chunk, then
# evaluated against its base model on held-out questions at every haystack length, both served.


# With sft.questions_percent, the cold start learns from that share of the train questions and GRPO trains on the
# others, which the cold start never saw.
rule split_memagent_train:
    input:
        rows=get_memagent_split_input,
    output:
        sft="results/{exp}/data/sft.parquet",
        grpo="results/{exp}/data/grpo.parquet",
    log:
        "logs/split_memagent_train/{exp}.log",
    benchmark:
        "benchmarks/split_memagent_train/{exp}.tsv"
    wildcard_constraints:
        exp=MEMAGENT_EXPERIMENTS,
    conda:
        "../workflow/envs/memupdate.yaml"
    resources:
        runtime=10,
    params:
        sft_percent=get_memagent_sft_percent,
    script:
        "../workflow/scripts/split_memagent_train.py"


# An experiment with an `sft` section trains from its cold start: the policy fine-tuned on the scripted
# expert's trajectories of the train questions (memupdate.training.memagent_expert).
rule train_memagent_sft:
    input:
        unpack(get_memagent_sft_inputs),
        unpack(gpu_preflight("train_memagent_sft")),
    output:
        ckpt=directory("results/{exp}/sft/ckpt"),
    log:
        "logs/train_memagent_sft/{exp}.log",
    benchmark:
        "benchmarks/train_memagent_sft/{exp}.tsv"
    wildcard_constraints:
        exp=MEMAGENT_EXPERIMENTS,
    conda:
        "../workflow/envs/memupdate.yaml"
    threads: 2
    resources:
        **job_resources("train_memagent_sft", policy_of, runtime=120, mem_mb=8000),
    params:
        layout=get_sft_layout,
        settings=get_sft_settings,
        loop=get_memagent_loop,
        run_dir=get_sft_run_dir,
    script:
        "../workflow/scripts/train_memagent_sft.py"


rule train_memagent:
    input:
        unpack(get_memagent_train_inputs),
        unpack(gpu_preflight("train_memagent")),
    output:
        ckpt=directory("results/{exp}/memagent/ckpt"),
    log:
        "logs/train_memagent/{exp}.log",
    benchmark:
        "benchmarks/train_memagent/{exp}.tsv"
    conda:
        "../workflow/envs/memupdate.yaml"
    threads: 2
    resources:
        # As train_stage's (rules/train.smk).
        **job_resources(
            "train_memagent", policy_of, runtime=120, mem_mb=VERL_CPU_MEM_MB
        ),
    params:
        settings=get_memagent_train_settings,
        loop=get_memagent_loop,
        run_dir=get_memagent_run_dir,
        # verl's rollout server on CPU (memupdate_vllm) runs with these.
        serving=config["serving"],
    script:
        "../workflow/scripts/train_memagent.py"


rule eval_memagent:
    input:
        unpack(get_memagent_eval_inputs),
        unpack(gpu_preflight("eval_memagent")),
    output:
        report="results/{exp}/memagent_eval/report.json",
        markdown=report(
            "results/{exp}/memagent_eval/report.md",
            caption="../report/eval_memagent.rst",
            category="MemAgent evaluation",
            subcategory="{exp}",
            labels={"experiment": "{exp}", "content": "tables"},
        ),
        curve=report(
            "results/{exp}/memagent_eval/length_curve.png",
            caption="../report/eval_memagent_curve.rst",
            category="MemAgent evaluation",
            subcategory="{exp}",
            labels={"experiment": "{exp}", "content": "length curve"},
        ),
    log:
        "logs/eval_memagent/{exp}.log",
    benchmark:
        "benchmarks/eval_memagent/{exp}.tsv"
    conda:
        "../workflow/envs/memupdate.yaml"
    # A client, as eval_locomo: the models are served (serve_model); this job holds tokenizers and the agent
    # loop only, and counts no core (two CPUs on Slurm).
    threads: 0
    resources:
        **job_resources(
            "eval_memagent", policy_of, runtime=120, mem_mb=4000, cpus_per_task=2
        ),
    params:
        settings=get_memagent_eval_settings,
        out_dir=get_memagent_eval_dir,
        # Written by train_memagent beside its checkpoint: the report's learning curve.
        training_metrics=lambda wildcards: f"results/{wildcards.exp}/memagent/metrics.jsonl",
    script:
        "../workflow/scripts/eval_memagent.py"
