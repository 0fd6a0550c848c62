"""Training: verl's trainer through our launcher (GPU clusters or CPUs, multi-node Ray), and the cold start."""
