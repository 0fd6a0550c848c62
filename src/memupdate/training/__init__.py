"""Training backends: the verl launcher (GPU clusters, multi-node Ray) and the local single-process GRPO."""
