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
    # Reading, the model's load and writing take as long as the embedding: at smoke scale the job keeps one core
    # busy on average (34 s of CPU in 66 s), so it counts one and runs beside the vLLM environment's build. On
    # Slurm it asks for two CPUs.
    threads: 1
    resources:
        runtime=60,
        mem_mb=4000,
        cpus_per_task=2,
    params:
        model=EMBEDDING_MODEL,
        batch_size=config["memory"]["embedding_batch_size"],
        # Outlives the output, which Snakemake deletes before a rerun: only new texts are embedded.
        pool=f"resources/embedding_pool/{EMBEDDING_TAG}",
    script:
        "../workflow/scripts/embed_memories.py"
