# Shared helpers: scale selection, wildcard constraints and input functions (no logic in rules).

import functools
import re
from pathlib import Path

from snakemake.io import apply_wildcards, regex_from_filepattern
from snakemake.iocontainers import Wildcards

from memupdate import plan as planning
from memupdate.cluster import RESOURCES_FILE, read_table
from memupdate.experiment import Experiment
from memupdate.models.hub import is_hub_id
from memupdate.settings import (
    ServeSettings,
    build,
    check_lengths,
    check_positions,
    experiment_stages,
)

SCALE = config["scales"][config["scale"]]
# The experiment of the short paths results/stage<N>/ckpt, results/eval/report.json.
DEFAULT_EXPERIMENT = SCALE["default_experiment"]
DATA_FILES = config["data"]["files"]
LOCOMO_SPLITS = ["train", "val", "test"]
# One folder per embedding model, named by the model's last path component.
EMBEDDING_MODEL = config["memory"]["embedding_model"]
# Cap on a memory text the agent writes; reaches the memory tools like the embedding model does.
MAX_CONTENT_CHARS = config["memory"]["max_content_chars"]
EMBEDDING_TAG = Path(EMBEDDING_MODEL).name
EMBEDDINGS = f"results/embeddings/{EMBEDDING_TAG}"
# Each experiment of the checked config with what the workflow asks of it: kind, stages, reward, evaluations.
EXPERIMENTS = {
    name: Experiment(name, section, config["reward"], MAX_CONTENT_CHARS)
    for name, section in config["experiments"].items()
}
# The memory a server holds on the run's own machine (serving.local_mem_mb).
LOCAL_SERVER_MB = build(ServeSettings, config["serving"], "serving").local_mem_mb
# Memory of a verl training job on a CPU node, MB (measured 10-14 GB with the tiny and the 135M models); on GPU
# nodes profiles/slurm/resources.yaml's rows give theirs.
VERL_CPU_MEM_MB = 14000
# The GPU preflight's report (rule preflight), an input of every job that asks for GPUs (gpu_preflight).
PREFLIGHT_REPORT = "results/preflight.json"


def one_of(names):
    """A wildcard pattern matching exactly these names (a name's '.' is a character, not "any")."""
    return "|".join(re.escape(name) for name in names)


wildcard_constraints:
    name=one_of(DATA_FILES),
    split=one_of(config["data"]["hotpotqa"]["splits"]),
    ndocs=r"\d+",
    model=one_of(config["models"]),
    exp=one_of(config["experiments"]),
    served=r"qa-base|base|sft|stage[1-9]\d*|memagent",
    purpose="train|eval",
    n=r"[1-9]\d*",
    stage=r"stage[1-9]\d*|memagent",
    report="eval|memagent_eval",


def data_file_path(name):
    return f"resources/data/{name}.json"


def get_data_file_spec(wildcards):
    spec = DATA_FILES[wildcards.name]
    return {
        "source": spec["source"],
        "sha256": spec["sha256"],
        "filename": spec.get("filename"),
        "mirrors": config["data"].get("mirrors", []),
    }


def get_locomo_input(wildcards):
    return data_file_path(config["data"]["locomo"]["file"])


def get_hotpotqa_input(wildcards):
    return data_file_path(config["data"]["hotpotqa"]["splits"][wildcards.split])


def get_hotpotqa_sha256(wildcards):
    return DATA_FILES[config["data"]["hotpotqa"]["splits"][wildcards.split]]["sha256"]


def get_locomo_outputs():
    return expand(
        "results/data/locomo/{part}.parquet", part=[*LOCOMO_SPLITS, "memories"]
    )


def get_hotpotqa_outputs():
    return expand(
        "results/data/hotpotqa/{split}-{ndocs}.parquet",
        split=config["data"]["hotpotqa"]["splits"],
        ndocs=SCALE["hotpotqa_num_docs"],
    )


def get_hotpotqa_data():
    """Every haystack of the scale and its train/test split (the hotpotqa_data target, a DVC stage)."""
    return get_hotpotqa_outputs() + expand(
        "results/data/hotpotqa/{split}-{ndocs}.{part}.parquet",
        split=config["data"]["hotpotqa"]["splits"],
        ndocs=SCALE["hotpotqa_num_docs"],
        part=["train", "test"],
    )


def get_experiment(wildcards):
    """The job's experiment (memupdate.experiment.Experiment: what an experiment means, answered once)."""
    name = wildcards.exp
    if name not in EXPERIMENTS:
        raise ValueError(
            f"no experiment {name!r} in config/config.yaml (have {sorted(config['experiments'])})"
        )
    _check_contexts(name)
    return EXPERIMENTS[name]


@functools.cache
def _check_contexts(name):
    """Once per experiment of this DAG: its episodes fit the servers, and the servers its models
    (memupdate.settings.check_lengths, check_positions)."""
    experiment = config["experiments"][name]
    check_lengths(name, experiment, config["serving"])
    check_positions(name, experiment, config["models"], config["serving"])


def get_model_spec(wildcards):
    return config["models"][wildcards.model]


def hub_download(model):
    """The download marker of a model given by a hub id (memupdate.models.prepare.download_model), or None."""
    spec = config["models"][model]
    if spec["kind"] == "hf" and is_hub_id(spec["name_or_path"]):
        return f"results/models/{model}.download.json"
    return None


def get_prepare_model_inputs(wildcards):
    download = hub_download(wildcards.model)
    return {"download": download} if download else {}


def tokenizer_inputs(dataset):
    """The input function of a dataset's haystack tokenizer (data.<dataset>.tokenizer): one that names a hub model
    of `models:` is read from that model's download."""

    def inputs(wildcards):
        name = config["data"][dataset]["tokenizer"]
        for model, spec in config["models"].items():
            if spec.get("name_or_path") == name and hub_download(model):
                return {"tokenizer": hub_download(model)}
        return {}

    return inputs


def local_servers_mb(input):
    """The memory of the servers a job reads, where they run on the run's own machine: a serve job ends once its
    server answers, so the server's memory is counted by the jobs that use it (serving.local_mem_mb each). On Slurm
    each server is a job of its own, with its own memory."""
    if planning.submits_to_slurm(workflow):
        return 0
    servers = sum(1 for path in input if SERVE_MARKER_REGEX.fullmatch(str(path)))
    return servers * LOCAL_SERVER_MB


def serve_job_mem_mb(wildcards):
    """A serve job's memory: on this machine the server it starts (counted by its consumers once it answers)."""
    return 2000 if planning.submits_to_slurm(workflow) else LOCAL_SERVER_MB


def job_resources(rule, model_of, **own):
    """The rule's resources: its own (``own``), raised to its row of profiles/slurm/resources.yaml for the model
    its job handles (``model_of(wildcards)``), with the memory of the servers it reads here (memupdate.plan).
    """
    return PLANNER.resources(rule, model_of, local_servers_mb, **own)


def gpu_preflight(sized):
    """An input function: the preflight's report (rule preflight) for a job of ``sized`` whose row asks for GPUs,
    unless config `preflight` is false; nothing for a CPU job (the smoke scale, the rehearsal).
    """

    def inputs(wildcards):
        if config["preflight"] and PLANNER.row(sized, wildcards).gpus_per_node:
            return {"preflight": PREFLIGHT_REPORT}
        return {}

    return inputs


def get_preflight_inputs(wildcards):
    """The downloads of the models the scale's experiments load: the preflight checks that each resolves offline."""
    experiments = [config["experiments"][name] for name in SCALE["experiments"]]
    models = dict.fromkeys(
        e[role] for e in experiments for role in ("policy", "qa_model") if e.get(role)
    )
    return [download for download in map(hub_download, models) if download]


def plan_units(sized, wildcards):
    """What a row's per-unit figure counts: a stage's training steps; LoCoMo's evaluated systems (no update,
    full context, one per stage, with a cold start the base and cold-start policies); MemAgent's passes.
    """
    if sized == "train_stage":
        return planning.training_steps(get_stage(wildcards).settings)
    if sized == "train_memagent":
        return planning.training_steps(get_experiment(wildcards).memagent["train"])
    if sized == "eval_locomo":
        sft = 2 if get_experiment(wildcards).has_cold_start else 0
        return 2 + len(get_stages(wildcards)) + sft
    if sized == "eval_memagent":
        return planning.memagent_systems(get_experiment(wildcards).memagent["eval"])
    return None


def plan_disk(sized, wildcards, model):
    """Checkpoint disk of a training job, GB: verl's saves kept (memupdate.plan.saves_kept) at
    plan.save_bytes_per_param and the merged bf16 ckpt/; the cold start: ckpt/ only.
    """
    if sized not in planning.TRAINING:
        return None
    params = planning.model_params(model, config["models"][model])
    saves = 0
    if sized in ("train_stage", "train_memagent"):
        memagent = sized == "train_memagent"
        settings = (
            get_experiment(wildcards).memagent["train"]
            if memagent
            else get_stage(wildcards).settings
        )
        defaults = planning.trainer_defaults("memagent" if memagent else "memupdate")
        saves = planning.saves_kept(settings, defaults)
    return planning.checkpoint_gb(params, saves, PLANNER.limits)


def serve_consumers(sized, wildcards):
    """(rule, wildcards) of the jobs that read a served model's marker: the experiment's evaluation, or the
    training stages that ask for it (their inputs, as get_stage_inputs gives them)."""
    exp, purpose = wildcards.exp, wildcards.purpose
    if purpose == "eval":
        evaluation = "eval_memagent" if EXPERIMENTS[exp].is_memagent else "eval_locomo"
        return [(evaluation, Wildcards(fromdict={"exp": exp}))]
    marker = serve_marker(exp, wildcards.served, purpose)
    consumers = []
    for name in get_stages(wildcards):
        stage = Wildcards(fromdict={"exp": exp, "n": name.removeprefix("stage")})
        if marker in get_stage_inputs(stage).values():
            consumers.append(("train_stage", stage))
    return consumers


def rule_benchmark(name, wildcards):
    """The benchmark file of a job of rule ``name``, where a previous run measured its time."""
    pattern = getattr(rules, name).benchmark
    return apply_wildcards(str(pattern), wildcards) if pattern else None


# What the heavy jobs ask Slurm for, per rule and model, and how long they are expected to take (memupdate.plan),
# checked here, when the Snakefile loads. The partition's time limit comes from the environment, the table, or
# Slurm itself (sinfo, where there is one); every job's limit fits it, or the job resumes after a cut, or the run
# is refused. The plan of a run's GPU-sized jobs is printed once Snakemake has built the DAG (a dry run too).
PLANNER = planning.JobPlanner(
    workflow,
    read_table(Path(workflow.basedir) / RESOURCES_FILE, config["models"]),
    logger,
    units=plan_units,
    disk=plan_disk,
    consumers=serve_consumers,
    benchmark=rule_benchmark,
)
PLANNER.print_after_dag()


def model_wildcard(wildcards):
    return wildcards.model


def policy_of(wildcards):
    return get_experiment(wildcards).policy


def role_model_of(wildcards, role):
    """The model (a key of config `models`) that plays a role: the QA model for qa, else the policy."""
    return get_qa_model(wildcards) if role == "qa" else policy_of(wildcards)


def served_model_of(wildcards):
    """The model (a key of config `models`) behind a served name: the QA model for qa-base and the QA
    stages, else the policy."""
    if wildcards.served == "qa-base":
        return get_qa_model(wildcards)
    stage = get_stages(wildcards).get(wildcards.served)
    return role_model_of(wildcards, stage.role if stage else "memory")


PLANNER.model_of["serve_model"] = served_model_of


def get_serving_settings(wildcards, resources=None):
    """config's serving section, with the server job's sbatch options raised to the model's row of
    profiles/slurm/resources.yaml (a 7B server asks for a GPU, a smoke one for CPUs). As serve_model's
    params, it also takes that job's partition, account and QoS (its resources slurm_partition,
    slurm_account and qos, from the profile) where serving.slurm sets none, so the server's own job lands
    where every other job does."""
    from memupdate.serving.launch import with_job_placement

    row = PLANNER.row("serve_model", wildcards).server()
    slurm = with_job_placement({**config["serving"]["slurm"], **row}, resources)
    return {**config["serving"], "slurm": slurm}


def server_request(wildcards):
    """The server job's request, shown with serve_model's resources by `snakemake -n` (the Slurm plugin
    ignores these names; serve_model submits the server's own job with them). Its partition, account and
    QoS are serve_model's own job's (with_job_placement at submission), which the profile reads from the
    user's environment, as here."""
    from memupdate.cluster import PLACEMENT_ENV, placement

    job = {resource: placement(resource) for resource in PLACEMENT_ENV}
    slurm = get_serving_settings(wildcards, job)["slurm"]
    return " ".join(f"{k}={v}" for k, v in sorted(slurm.items()) if v is not None)


# Servers started by serve_model are recorded here and stopped when the run ends (the Snakefile's hooks:
# memupdate.serving.lifecycle).
SERVER_REGISTRY = "logs/serve_model/running"


# A server's readiness marker (serve_model's output); among a job's inputs, a server the job talks to while it runs.
SERVE_MARKER = "results/{exp}/serve/{purpose}/{served}.ready.json"
SERVE_MARKER_REGEX = re.compile(regex_from_filepattern(SERVE_MARKER))


def serve_marker(exp, served, purpose):
    """Training and evaluation ask for their own servers: a marker made for one consumer in a run
    would otherwise count as an updated input of the other, and retrain a finished stage.
    """
    return SERVE_MARKER.format(exp=exp, purpose=purpose, served=served)


def memory_inputs():
    return {
        "train": "results/data/locomo/train.parquet",
        "memories": "results/data/locomo/memories.parquet",
        "embeddings": f"{EMBEDDINGS}/memories",
    }


def validation_inputs(wildcards):
    """verl validates on the held-out validation conversation(s) (their questions, or their sessions for an
    ingestion experiment)."""
    if is_ingestion(wildcards):
        return {"val": f"results/{wildcards.exp}/data/ingest.val.parquet"}
    return {"val": question_rows(wildcards, "val")}


def get_qa_model(wildcards):
    return get_experiment(wildcards).qa_model


def get_reward_config(wildcards):
    """The reward section of an experiment: the workflow's, with the experiment's own `reward` keys over it."""
    return get_experiment(wildcards).reward


def fixed_qa(stage):
    """The served QA role a memory stage is trained against: the latest QA stage before it, else qa-base."""
    return stage.fixed or "qa-base"


def get_judge_marker(wildcards):
    """The readiness marker of the served reward.judge, when a memory stage's reward asks it (the reader is the
    stage's fixed QA role, its `fixed` input, whose QA-phase answers it scores: memupdate.training.stages.stage_reward).
    """
    judge = get_experiment(wildcards).served_judge
    return {"judge": serve_marker(wildcards.exp, judge, "train")} if judge else {}


def get_stage_reward(wildcards):
    """The reward manager's settings for a stage (memupdate.experiment.Experiment.training_reward); a memory
    stage's also names the served judge's marker (listed as an input too, so its server runs).
    """
    reward = get_experiment(wildcards).training_reward
    if get_stage(wildcards).role == "memory":
        for role, marker in get_judge_marker(wildcards).items():
            reward[f"{role}_marker"] = marker
    return reward


def policy_model(wildcards):
    """The policy before any training: the prepared model of the experiment's `policy`."""
    return f"results/models/{get_experiment(wildcards).policy}"


def get_training_start(wildcards):
    """Where stage 1 (MemAgent: training) starts: the cold start's checkpoint when the experiment has an `sft`
    section, else the prepared policy."""
    if get_experiment(wildcards).has_cold_start:
        return f"results/{wildcards.exp}/sft/ckpt"
    return policy_model(wildcards)


def get_episode(wildcards):
    return get_experiment(wildcards).episode


def get_tool_settings(wildcards):
    return get_experiment(wildcards).tools


def get_sft_settings(wildcards):
    return get_experiment(wildcards).sft


def get_sft_run_dir(wildcards):
    return f"results/{wildcards.exp}/sft"


def get_sft_layout(wildcards):
    return get_experiment(wildcards).sft_layout


def get_sft_reward(wildcards):
    return get_experiment(wildcards).offline_reward


def get_stages(wildcards):
    return get_experiment(wildcards).stages


def stage_numbers():
    """The stage numbers any MemoryUpdate experiment of the config has; rules/train.smk defines one training
    rule per number."""
    return sorted(
        {
            int(name.removeprefix("stage"))
            for experiment in EXPERIMENTS.values()
            for name in experiment.stages
        }
    )


def get_stage(wildcards):
    """The stage of a training job (wildcard n)."""
    return get_experiment(wildcards).stage(wildcards.n)


def stage_checkpoint(exp, name):
    return f"results/{exp}/{name}/ckpt"


def get_stage_start(wildcards):
    """Where a stage starts: its role's latest checkpoint; a first memory stage starts where training does
    (get_training_start), a first QA stage from the QA model."""
    stage = get_stage(wildcards)
    if stage.start:
        return stage_checkpoint(wildcards.exp, stage.start)
    if stage.role == "memory":
        return get_training_start(wildcards)
    return f"results/models/{get_qa_model(wildcards)}"


def is_ingestion(wildcards):
    return get_experiment(wildcards).is_ingestion


def get_questions_per_session(wildcards):
    return get_experiment(wildcards).questions_per_session


def has_headroom_mix(wildcards):
    return get_experiment(wildcards).has_headroom_mix


def get_headroom_settings(wildcards):
    return get_experiment(wildcards).headroom


def question_rows(wildcards, part):
    """An experiment's question rows of a LoCoMo split: all of them, or its headroom mix."""
    if has_headroom_mix(wildcards):
        return f"results/{wildcards.exp}/data/headroom.{part}.parquet"
    return f"results/data/locomo/{part}.parquet"


def get_train_rows(wildcards):
    """The experiment's train rows: the questions (or their headroom mix), or for an ingestion experiment its
    sessions."""
    if is_ingestion(wildcards):
        return f"results/{wildcards.exp}/data/ingest.train.parquet"
    return question_rows(wildcards, "train")


def get_sft_inputs(wildcards):
    """The cold start's inputs: the memories, their embeddings and the train rows the expert plays."""
    return {**memory_inputs(), "train": get_train_rows(wildcards)}


def get_stage_rows(wildcards):
    """The train rows of a stage: all of them, or its train_on's selection (rule select_stage_rows)."""
    if get_stage(wildcards).train_on:
        return f"results/{wildcards.exp}/data/stage{wildcards.n}.train.parquet"
    return get_train_rows(wildcards)


def get_train_on(wildcards):
    return get_stage(wildcards).train_on


def get_stage_inputs(wildcards):
    stage = get_stage(wildcards)
    inputs = {
        "model": get_stage_start(wildcards),
        **memory_inputs(),
        "train": get_stage_rows(wildcards),
        **validation_inputs(wildcards),
    }
    if stage.role == "qa":
        # The memory role of a QA stage: the latest memory stage, served.
        inputs["fixed"] = serve_marker(wildcards.exp, stage.fixed, "train")
        return inputs
    # The QA phase (the served QA model answering after the memory turns) is what a served scorer reads.
    # Without a QA model, or with an offline scorer, a memory stage is single-role MemoryUpdate: nothing served.
    if get_experiment(wildcards).plays_qa_phase:
        inputs["fixed"] = serve_marker(wildcards.exp, fixed_qa(stage), "train")
    return {**inputs, **get_judge_marker(wildcards)}


def get_stage_settings(wildcards):
    return get_stage(wildcards).settings


def get_stage_role(wildcards):
    """The role a stage trains: memory or qa (memupdate.agents.memory_loop's trained_role)."""
    return get_stage(wildcards).role


def stage_model_of(wildcards):
    """The model a stage trains (a key of config `models`): the policy, or the QA model."""
    return role_model_of(wildcards, get_stage(wildcards).role)


def get_stage_run_dir(wildcards):
    return f"results/{wildcards.exp}/stage{wildcards.n}"


def get_served_model(wildcards):
    """The checkpoint folder a served name stands for: qa-base (the experiment's QA model), base (its
    policy before training) or a trained run of the experiment (stage1, stage2, memagent).
    """
    if wildcards.served == "qa-base":
        return f"results/models/{get_qa_model(wildcards)}"
    if wildcards.served == "base":
        return policy_model(wildcards)
    return f"results/{wildcards.exp}/{wildcards.served}/ckpt"


def get_serve_inputs(wildcards):
    """The served checkpoint. An evaluation server also waits for every checkpoint its evaluation needs: it
    would otherwise start as soon as its own model exists and sit idle through the training stages.
    """
    inputs = {"model": get_served_model(wildcards)}
    if wildcards.purpose == "eval":
        inputs.update(get_evaluated_checkpoints(wildcards))
    return inputs


def get_evaluated_checkpoints(wildcards):
    experiment = get_experiment(wildcards)
    trained = ["memagent"] if experiment.is_memagent else experiment.stages
    stages = [*(["sft"] if experiment.has_cold_start else []), *trained]
    return {f"ckpt_{s}": stage_checkpoint(wildcards.exp, s) for s in stages}


def get_served_model_name(wildcards):
    if wildcards.purpose == "train":
        return f"{wildcards.exp}-{wildcards.served}"
    return f"{wildcards.exp}-{wildcards.purpose}-{wildcards.served}"


def get_server_log(wildcards):
    return f"logs/serve_model/{wildcards.exp}/{wildcards.purpose}/{wildcards.served}.supervisor.log"


def get_eval_inputs(wildcards):
    inputs = {
        "test": "results/data/locomo/test.parquet",
        "memories": "results/data/locomo/memories.parquet",
        "embeddings": f"{EMBEDDINGS}/memories",
        "conversations": data_file_path(config["data"]["locomo"]["file"]),
        "qa_base": serve_marker(wildcards.exp, "qa-base", "eval"),
    }
    if get_experiment(wildcards).has_cold_start:
        # What each training step adds: the untrained policy and the cold start as memory models too.
        inputs["base"] = serve_marker(wildcards.exp, "base", "eval")
        inputs["sft"] = serve_marker(wildcards.exp, "sft", "eval")
    for name in get_stages(wildcards):
        inputs[name] = serve_marker(wildcards.exp, name, "eval")
    return inputs


def get_eval_stages(wildcards):
    """Each stage's name and role, in order: the report has a row per stage (the system after it)."""
    return [[stage.name, stage.role] for stage in get_stages(wildcards).values()]


def get_eval_settings(wildcards):
    return get_experiment(wildcards).eval_settings


def get_training_metrics(wildcards):
    return {
        s: f"results/{wildcards.exp}/{s}/metrics.jsonl" for s in get_stages(wildcards)
    }


def get_policy_eval_settings(wildcards):
    return get_experiment(wildcards).policy_eval


def policy_checkpoint(wildcards):
    """The checkpoint a policy name stands for: base (the prepared policy), sft, stage1."""
    if wildcards.policy == "base":
        return policy_model(wildcards)
    if wildcards.policy == "sft" and not get_experiment(wildcards).has_cold_start:
        raise ValueError(
            f"experiment {wildcards.exp!r} has no sft section: no cold start to evaluate"
        )
    return f"results/{wildcards.exp}/{wildcards.policy}/ckpt"


def get_policy_eval_inputs(wildcards):
    settings = get_policy_eval_settings(wildcards)
    inputs = {
        "model": policy_checkpoint(wildcards),
        "rows": question_rows(wildcards, settings["split"]),
        "memories": "results/data/locomo/memories.parquet",
        "embeddings": f"{EMBEDDINGS}/memories",
    }
    if has_headroom_mix(wildcards):
        # Which memory each held-out question's missing evidence is: the report's count of updates that named it.
        inputs["flags"] = (
            f"results/{wildcards.exp}/data/headroom.{settings['split']}.flags.parquet"
        )
    return inputs


def get_policy_eval_reward(wildcards):
    return get_experiment(wildcards).policy_eval_reward


def get_policy_summaries(wildcards):
    summaries = {
        p: f"results/{wildcards.exp}/policy_eval/{p}/summary.json"
        for p in get_experiment(wildcards).evaluated_policies
    }
    if has_headroom_mix(wildcards):
        # Every question of the held-out split, flagged: the report's strata and their shares.
        split = get_policy_eval_settings(wildcards)["split"]
        summaries["flags"] = (
            f"results/{wildcards.exp}/data/headroom.{split}.flags.parquet"
        )
    return summaries


def get_eval_dir(wildcards):
    return f"results/{wildcards.exp}/eval"


def is_memagent(name):
    return EXPERIMENTS[name].is_memagent


# The exp wildcard of rules that differ by kind (results/{exp}/sft/ckpt: train_sft or train_memagent_sft).
MEMUPDATE_EXPERIMENTS = one_of(n for n in config["experiments"] if not is_memagent(n))
MEMAGENT_EXPERIMENTS = one_of(n for n in config["experiments"] if is_memagent(n))


def get_memagent_experiment(wildcards):
    """A MemAgent experiment's section (kind: memagent)."""
    return get_experiment(wildcards).memagent


def haystack_rows(wildcards, ndocs, part):
    """The MemAgent rows of a part (train, test) at a haystack length, of the experiment's haystack."""
    if get_experiment(wildcards).haystack == "locomo":
        return f"results/data/locomo_haystack/{ndocs}.{part}.parquet"
    split = next(iter(config["data"]["hotpotqa"]["splits"]))
    return f"results/data/hotpotqa/{split}-{ndocs}.{part}.parquet"


def get_memagent_train_inputs(wildcards):
    """verl validates on held-out questions (a sample of the test split's: grpo_memagent.yaml), never on the
    training file."""
    experiment = get_memagent_experiment(wildcards)
    return {
        "model": get_training_start(wildcards),
        "train": memagent_train_rows(wildcards, "grpo"),
        "val": haystack_rows(wildcards, experiment["train"]["num_docs"], "test"),
    }


def get_memagent_sft_inputs(wildcards):
    return {
        "model": policy_model(wildcards),
        "train": memagent_train_rows(wildcards, "sft"),
    }


def memagent_train_rows(wildcards, part):
    """The train questions the cold start (part sft) or GRPO (part grpo) plays: all of them, or with
    sft.questions_percent their share of them (split_memagent_train)."""
    if not get_experiment(wildcards).splits_memagent_train:
        return get_memagent_split_input(wildcards)
    return f"results/{wildcards.exp}/data/{part}.parquet"


def get_memagent_split_input(wildcards):
    return haystack_rows(
        wildcards, get_memagent_experiment(wildcards)["train"]["num_docs"], "train"
    )


def get_memagent_sft_percent(wildcards):
    return get_memagent_experiment(wildcards)["sft"]["questions_percent"]


def get_memagent_train_settings(wildcards):
    return get_experiment(wildcards).memagent_train


def get_memagent_loop(wildcards):
    return get_memagent_experiment(wildcards)["loop"]


def get_memagent_run_dir(wildcards):
    return f"results/{wildcards.exp}/memagent"


def get_memagent_eval_inputs(wildcards):
    """The base policy, the cold start (an experiment with an sft section) and the trained policy, each
    served for the evaluation, in that order: the report compares each with the one before it.
    """
    experiment = get_memagent_experiment(wildcards)
    inputs = {
        "base": serve_marker(wildcards.exp, "base", "eval"),
        **(
            {"sft": serve_marker(wildcards.exp, "sft", "eval")}
            if get_experiment(wildcards).has_cold_start
            else {}
        ),
        "trained": serve_marker(wildcards.exp, "memagent", "eval"),
    }
    for ndocs in experiment["eval"]["num_docs"]:
        inputs[f"test_{ndocs}"] = haystack_rows(wildcards, ndocs, "test")
    return inputs


def get_memagent_eval_settings(wildcards):
    return get_experiment(wildcards).memagent_eval


def get_memagent_eval_dir(wildcards):
    return f"results/{wildcards.exp}/memagent_eval"


def default_experiment_artifact(kind, leaf):
    """results/<default experiment>/<kind>/<leaf>: what a short path (results/stage2/ckpt, ...) stands for."""
    experiment = config["experiments"][DEFAULT_EXPERIMENT]
    memagent = is_memagent(DEFAULT_EXPERIMENT)
    has = {
        "eval": "qa_model" in experiment and not memagent,
        "memagent": memagent,
        "memagent_eval": memagent,
    }
    if not has.get(kind, kind in experiment and not memagent):
        raise ValueError(
            f"the default experiment {DEFAULT_EXPERIMENT!r} (scales.{config['scale']}.default_experiment) has no "
            f"{kind}: ask for results/<experiment>/{kind}/... of an experiment that has one"
        )
    return f"results/{DEFAULT_EXPERIMENT}/{kind}/{leaf}"


def get_default_checkpoint(wildcards):
    return default_experiment_artifact(wildcards.stage, "ckpt")


def get_default_report(wildcards):
    return default_experiment_artifact(wildcards.report, "report.json")


def get_final_outputs():
    outputs = [*get_locomo_outputs(), *get_hotpotqa_outputs(), f"{EMBEDDINGS}/memories"]
    for name in SCALE["experiments"]:
        if is_memagent(name):
            outputs.append(f"results/{name}/memagent_eval/report.json")
            continue
        for stage in experiment_stages(config["experiments"][name]):
            outputs.append(stage_checkpoint(name, stage.name))
        if "qa_model" in config["experiments"][name]:
            outputs.append(f"results/{name}/eval/report.json")
        if "policy_eval" in config["experiments"][name]:
            outputs.append(f"results/{name}/policy_eval/report.json")
    return outputs
