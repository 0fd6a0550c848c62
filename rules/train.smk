# Training: the GRPO stages, stage1, stage2, ... in order (memupdate.settings.experiment_stages). Stage 1
# trains the memory role (the QA role is the served base QA model); stage 2 the QA role (the memory role is
# the served stage-1 model); each later stage its role again, from that role's latest checkpoint, against the
# other role's latest, on all train rows or its `train_on` selection. An experiment with an `sft` section
# starts stage 1 from its cold start: the policy fine-tuned on the scripted expert's demonstration episodes
# of the train rows (memupdate.training.demonstrations; sessions: memupdate.training.ingestion_expert).


rule train_sft:
    input:
        unpack(get_sft_inputs),
        unpack(gpu_preflight("train_sft")),
        model=policy_model,
    output:
        ckpt=directory("results/{exp}/sft/ckpt"),
    log:
        "logs/train_sft/{exp}.log",
    benchmark:
        "benchmarks/train_sft/{exp}.tsv"
    wildcard_constraints:
        exp=MEMUPDATE_EXPERIMENTS,
    conda:
        "../workflow/envs/memupdate.yaml"
    threads: 2
    resources:
        **job_resources("train_sft", policy_of, runtime=120, mem_mb=8000),
    params:
        layout=get_sft_layout,
        settings=get_sft_settings,
        # The demonstrations are the experiment's episodes, as training plays them.
        episode=get_episode,
        run_dir=get_sft_run_dir,
        embedding_model=EMBEDDING_MODEL,
        max_content_chars=MAX_CONTENT_CHARS,
        tools=get_tool_settings,
        reward=get_sft_reward,
    script:
        "../workflow/scripts/train_sft.py"


rule select_stage_rows:
    input:
        rows=get_train_rows,
    output:
        rows="results/{exp}/data/stage{n}.train.parquet",
    log:
        "logs/select_stage_rows/{exp}-stage{n}.log",
    localrule: True
    conda:
        "../workflow/envs/memupdate.yaml"
    params:
        train_on=get_train_on,
        ingestion=is_ingestion,
    script:
        "../workflow/scripts/select_stage_rows.py"


# One rule per stage number (train_stage1, train_stage2, ...): a DVC stage's --allowed-rules then names its own
# training and no other stage's, which Snakemake would otherwise rerun when `dvc pull` leaves it looking older.
for n in stage_numbers():

    rule:
        name:
            f"train_stage{n}"
        input:
            unpack(get_stage_inputs),
            unpack(gpu_preflight("train_stage")),
        output:
            ckpt=directory("results/{exp}/stage{n}/ckpt"),
        log:
            "logs/train_stage/{exp}-stage{n}.log",
        benchmark:
            "benchmarks/train_stage/{exp}-stage{n}.tsv"
        wildcard_constraints:
            n=str(n),
        conda:
            "../workflow/envs/memupdate.yaml"
        threads: 2
        resources:
            # verl on CPU holds 10-14 GB (Ray, the trainer and its reference, the rollout server): locally,
            # with --resources mem_mb=<the machine's> (run.sh), two such jobs never run together.
            **job_resources(
                "train_stage", stage_model_of, runtime=120, mem_mb=VERL_CPU_MEM_MB
            ),
        params:
            # The role trained: memory or qa (memupdate.agents.memory_loop's trained_role).
            trained_role=get_stage_role,
            settings=get_stage_settings,
            episode=get_episode,
            run_dir=get_stage_run_dir,
            embedding_model=EMBEDDING_MODEL,
            max_content_chars=MAX_CONTENT_CHARS,
            tools=get_tool_settings,
            reward=get_stage_reward,
            # verl's rollout server on CPU (memupdate_vllm) runs with these.
            serving=config["serving"],
        script:
            "../workflow/scripts/train_stage.py"
