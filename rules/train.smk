# Training: the two GRPO stages. Stage 1 trains the memory role (the QA role is the served base QA
# model); stage 2 trains the QA role (the memory role is the served stage-1 model). An experiment with an
# `sft` section starts stage 1 from its cold start: the policy fine-tuned on the scripted expert's
# demonstration episodes of the train rows (memupdate.training.demonstrations).


rule train_sft:
    input:
        **memory_inputs(),
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
        backend=get_backend,
        layout=get_sft_layout,
        settings=get_sft_settings,
        # The demonstrations are stage 1's episodes: its lengths and turns.
        stage=get_stage1_episode,
        run_dir=get_sft_run_dir,
        embedding_model=EMBEDDING_MODEL,
        max_content_chars=MAX_CONTENT_CHARS,
        tools=get_tool_settings,
        reward=get_sft_reward,
    script:
        "../workflow/scripts/train_sft.py"


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
        **job_resources("train_stage1", policy_of, runtime=120, mem_mb=8000),
    params:
        backend=get_backend,
        # The role trained: memory (stage 1) or qa (stage 2); memupdate.agents.memory_loop.
        training_stage="memory",
        settings=get_stage1_settings,
        run_dir=get_stage1_run_dir,
        embedding_model=EMBEDDING_MODEL,
        max_content_chars=MAX_CONTENT_CHARS,
        tools=get_tool_settings,
        reward=get_stage1_reward,
        # The verl backend's own rollout server (memupdate_vllm, on CPU) runs with these.
        serving=config["serving"],
    script:
        "../workflow/scripts/train_stage.py"


rule train_stage2:
    input:
        unpack(get_stage2_inputs),
    output:
        ckpt=directory("results/{exp}/stage2/ckpt"),
    log:
        "logs/train_stage2/{exp}.log",
    benchmark:
        "benchmarks/train_stage2/{exp}.tsv"
    conda:
        "../workflow/envs/memupdate.yaml"
    threads: 2
    resources:
        **job_resources("train_stage2", qa_model_of, runtime=120, mem_mb=8000),
    params:
        backend=get_backend,
        # The role trained: memory (stage 1) or qa (stage 2); memupdate.agents.memory_loop.
        training_stage="qa",
        settings=get_stage2_settings,
        run_dir=get_stage2_run_dir,
        embedding_model=EMBEDDING_MODEL,
        max_content_chars=MAX_CONTENT_CHARS,
        tools=get_tool_settings,
        reward=get_stage2_reward,
        serving=config["serving"],
    script:
        "../workflow/scripts/train_stage.py"
