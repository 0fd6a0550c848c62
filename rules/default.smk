# The default experiment (scales.<scale>.default_experiment) at the short paths: results/stage<N>/ckpt
# (results/stage1/ckpt, results/stage2/ckpt, ...) and results/eval/report.json (results/memagent/ckpt and
# results/memagent_eval/ for a MemAgent default) are hard links to its results/<experiment>/... artifacts:
# no checkpoint is stored twice.


rule default_checkpoint:
    input:
        ckpt=get_default_checkpoint,
    output:
        ckpt=directory("results/{stage}/ckpt"),
    log:
        "logs/default_checkpoint/{stage}.log",
    localrule: True
    conda:
        "../workflow/envs/memupdate.yaml"
    script:
        "../workflow/scripts/link_artifact.py"


rule default_report:
    input:
        report=get_default_report,
    output:
        report="results/{report}/report.json",
    log:
        "logs/default_report/{report}.log",
    localrule: True
    conda:
        "../workflow/envs/memupdate.yaml"
    script:
        "../workflow/scripts/link_artifact.py"
