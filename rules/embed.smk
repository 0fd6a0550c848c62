# Embeddings: vectors of the initial memories, keyed by the sha256 of their text.


rule embed_memories:
    input:
        memories="results/data/locomo/memories.parquet",
    output:
        cache=directory(f"{EMBEDDINGS}/memories"),
        summary=f"{EMBEDDINGS}/memories.summary.json",
    log:
        "logs/embed_memories.log",
    benchmark:
        "benchmarks/embed_memories.tsv"
    conda:
        "../workflow/envs/memupdate.yaml"
    threads: 2
    resources:
        runtime=60,
        mem_mb=4000,
    params:
        model=EMBEDDING_MODEL,
        batch_size=config["memory"]["embedding_batch_size"],
        # Outlives the output, which Snakemake deletes before a rerun: only new texts are embedded.
        pool=f"resources/embedding_pool/{EMBEDDING_TAG}",
    script:
        "../workflow/scripts/embed_memories.py"
