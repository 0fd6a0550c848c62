# Data: verified copies of the public files, then verl-format rows.


rule fetch_data:
    output:
        data="resources/data/{name}.json",
    log:
        "logs/fetch_data/{name}.log",
    benchmark:
        "benchmarks/fetch_data/{name}.tsv"
    conda:
        "../workflow/envs/memupdate.yaml"
    resources:
        runtime=30,
    params:
        spec=get_data_file_spec,
        # Verified copies by sha256, kept outside the output, which Snakemake deletes before a rerun.
        store="resources/data/.verified",
    script:
        "../workflow/scripts/fetch_data.py"


rule preprocess_locomo:
    input:
        data=get_locomo_input,
    output:
        train="results/data/locomo/train.parquet",
        val="results/data/locomo/val.parquet",
        test="results/data/locomo/test.parquet",
        memories="results/data/locomo/memories.parquet",
        summary="results/data/locomo/summary.json",
    log:
        "logs/preprocess_locomo.log",
    benchmark:
        "benchmarks/preprocess_locomo.tsv"
    conda:
        "../workflow/envs/memupdate.yaml"
    resources:
        runtime=10,
    params:
        split_name=config["data"]["locomo"]["split"],
        split=config["data"]["locomo"]["splits"][config["data"]["locomo"]["split"]],
        memory_sources=config["data"]["locomo"]["memory_sources"],
        drop_categories=config["data"]["locomo"]["drop_categories"],
        sha256=DATA_FILES[config["data"]["locomo"]["file"]]["sha256"],
    script:
        "../workflow/scripts/preprocess_locomo.py"


rule ingestion_rows:
    # An ingestion experiment's episodes: one row per session of each conversation of the split, no question in
    # any prompt (memupdate.data.ingestion).
    input:
        rows="results/data/locomo/{part}.parquet",
        memories="results/data/locomo/memories.parquet",
    output:
        rows="results/{exp}/data/ingest.{part}.parquet",
    log:
        "logs/ingestion_rows/{exp}-{part}.log",
    wildcard_constraints:
        part="train|val|test",
    localrule: True
    conda:
        "../workflow/envs/memupdate.yaml"
    params:
        questions_per_session=get_questions_per_session,
    script:
        "../workflow/scripts/ingestion_rows.py"


rule headroom_rows:
    # An experiment's question rows as a mix of questions with headroom (gold evidence in the question's own search,
    # outside the reader's context) and others (memupdate.data.headroom), and every row's flags.
    input:
        rows="results/data/locomo/{part}.parquet",
        memories="results/data/locomo/memories.parquet",
        embeddings=f"{EMBEDDINGS}/memories",
    output:
        rows="results/{exp}/data/headroom.{part}.parquet",
        flags="results/{exp}/data/headroom.{part}.flags.parquet",
        summary="results/{exp}/data/headroom.{part}.summary.json",
    log:
        "logs/headroom_rows/{exp}-{part}.log",
    benchmark:
        "benchmarks/headroom_rows/{exp}-{part}.tsv"
    wildcard_constraints:
        part="train|val|test",
    conda:
        "../workflow/envs/memupdate.yaml"
    resources:
        runtime=10,
        mem_mb=3000,
    params:
        settings=get_headroom_settings,
        reward=get_reward_config,
        embedding_model=EMBEDDING_MODEL,
    script:
        "../workflow/scripts/headroom_rows.py"


rule preprocess_hotpotqa:
    input:
        unpack(tokenizer_inputs("hotpotqa")),
        data=get_hotpotqa_input,
    output:
        rows="results/data/hotpotqa/{split}-{ndocs}.parquet",
        summary="results/data/hotpotqa/{split}-{ndocs}.summary.json",
    log:
        "logs/preprocess_hotpotqa/{split}-{ndocs}.log",
    benchmark:
        "benchmarks/preprocess_hotpotqa/{split}-{ndocs}.tsv"
    conda:
        "../workflow/envs/memupdate.yaml"
    resources:
        runtime=30,
    params:
        seed=config["data"]["hotpotqa"]["seed"],
        tokenizer=config["data"]["hotpotqa"]["tokenizer"],
        limit=SCALE["hotpotqa_limit"],
        # Each part of split_hotpotqa draws its haystacks from its own paragraph pool.
        test_percent=config["data"]["hotpotqa"]["test_percent"],
        sha256=get_hotpotqa_sha256,
    script:
        "../workflow/scripts/preprocess_hotpotqa.py"


rule split_hotpotqa:
    input:
        rows="results/data/hotpotqa/{split}-{ndocs}.parquet",
    output:
        train="results/data/hotpotqa/{split}-{ndocs}.train.parquet",
        test="results/data/hotpotqa/{split}-{ndocs}.test.parquet",
    log:
        "logs/split_hotpotqa/{split}-{ndocs}.log",
    benchmark:
        "benchmarks/split_hotpotqa/{split}-{ndocs}.tsv"
    conda:
        "../workflow/envs/memupdate.yaml"
    resources:
        runtime=10,
    params:
        test_percent=config["data"]["hotpotqa"]["test_percent"],
    script:
        "../workflow/scripts/split_hotpotqa.py"


# A MemAgent experiment with `haystack: locomo`: LoCoMo conversations as haystacks of {ndocs} windows of turns, the
# questions whose answer their evidence turns hold, train and test by data.locomo's split (data.locomo_haystack).
rule preprocess_locomo_haystack:
    input:
        unpack(tokenizer_inputs("locomo_haystack")),
        data=get_locomo_input,
    output:
        train="results/data/locomo_haystack/{ndocs}.train.parquet",
        test="results/data/locomo_haystack/{ndocs}.test.parquet",
        summary="results/data/locomo_haystack/{ndocs}.summary.json",
    log:
        "logs/preprocess_locomo_haystack/{ndocs}.log",
    benchmark:
        "benchmarks/preprocess_locomo_haystack/{ndocs}.tsv"
    conda:
        "../workflow/envs/memupdate.yaml"
    resources:
        runtime=10,
    params:
        split=config["data"]["locomo"]["splits"][config["data"]["locomo"]["split"]],
        settings=config["data"]["locomo_haystack"],
        sha256=DATA_FILES[config["data"]["locomo"]["file"]]["sha256"],
    script:
        "../workflow/scripts/preprocess_locomo_haystack.py"


rule hotpotqa_data:
    # Target only: every MemAgent haystack of the scale, split into train and test questions.
    input:
        get_hotpotqa_data(),
