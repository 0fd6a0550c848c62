# Shared helpers: scale selection, wildcard constraints and input functions (no logic in rules).

from pathlib import Path

SCALE = config["scales"][config["scale"]]
DATA_FILES = config["data"]["files"]
LOCOMO_SPLITS = ["train", "val", "test"]
# One folder per embedding model, named by the model's last path component.
EMBEDDING_MODEL = config["memory"]["embedding_model"]
EMBEDDING_TAG = Path(EMBEDDING_MODEL).name
EMBEDDINGS = f"results/embeddings/{EMBEDDING_TAG}"


wildcard_constraints:
    name="|".join(DATA_FILES),
    split="|".join(config["data"]["hotpotqa"]["splits"]),
    ndocs=r"\d+",
    model="|".join(config["models"]),
    exp="|".join(config["experiments"]),


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


def get_experiment(wildcards):
    name = wildcards.exp
    if name not in config["experiments"]:
        raise ValueError(
            f"no experiment {name!r} in config/config.yaml (have {sorted(config['experiments'])})"
        )
    return config["experiments"][name]


def get_model_spec(wildcards):
    return config["models"][wildcards.model]


def get_stage1_inputs(wildcards):
    experiment = get_experiment(wildcards)
    return {
        "model": f"results/models/{experiment['policy']}",
        "train": "results/data/locomo/train.parquet",
        "memories": "results/data/locomo/memories.parquet",
        "embeddings": f"{EMBEDDINGS}/memories",
    }


def get_stage1_settings(wildcards):
    return get_experiment(wildcards)["stage1"]


def get_run_dir(wildcards):
    return f"results/{wildcards.exp}/stage1"


def get_final_outputs():
    checkpoints = expand("results/{exp}/stage1/ckpt", exp=SCALE["experiments"])
    return [
        *get_locomo_outputs(),
        *get_hotpotqa_outputs(),
        f"{EMBEDDINGS}/memories",
        *checkpoints,
    ]
