"""memupdate: train LLM memory agents with GRPO on verl, driven by Snakemake."""

__version__ = "0.1.0"
