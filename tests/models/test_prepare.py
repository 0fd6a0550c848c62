"""prepare_model: deterministic tiny checkpoints, re-saved HF checkpoints, spec errors, atomic output."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from memupdate.chat_templates import load_chat_template
from memupdate.models import prepare
from memupdate.models.prepare import MANIFEST_NAME, prepare_model

SCHEMA = {
    "type": "function",
    "function": {
        "name": "delete_memory",
        "description": "Delete a memory by its id.",
        "parameters": {
            "type": "object",
            "properties": {"memory_id": {"type": "integer"}},
            "required": ["memory_id"],
        },
    },
}
CHECKPOINT_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    MANIFEST_NAME,
}


def manifest(path) -> dict:
    return json.loads((path / MANIFEST_NAME).read_text())


def test_tiny_random_is_deterministic(tiny_model_dir, tmp_path):
    # Best of three: one measurement on 2 cores shared with another test can take several times its time alone.
    elapsed = float("inf")
    for attempt in range(3):
        started = time.perf_counter()
        prepare_model({"kind": "tiny_random", "seed": 0}, tmp_path / ("again" if attempt == 0 else f"again{attempt}"))
        elapsed = min(elapsed, time.perf_counter() - started)
    assert elapsed < 2.0

    again = tmp_path / "again"
    assert {p.name for p in again.iterdir()} == CHECKPOINT_FILES
    for name in CHECKPOINT_FILES - {MANIFEST_NAME}:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    first, second = manifest(tiny_model_dir), manifest(again)
    first.pop("created"), second.pop("created")
    assert first == second

    prepare_model({"kind": "tiny_random", "seed": 1}, tmp_path / "other")
    weights = load_file(tiny_model_dir / "model.safetensors")
    other = load_file(tmp_path / "other" / "model.safetensors")
    assert weights.keys() == other.keys()
    assert not torch.equal(weights["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert (tmp_path / "other" / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()


def test_tiny_random_does_not_touch_the_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    prepare_model({"kind": "tiny_random", "seed": 5}, tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)


def test_tiny_random_loads_back_and_chats_with_tools(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.dtype == torch.float32
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 2)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
    assert model.config.vocab_size == len(tokenizer)

    assert tokenizer.chat_template == load_chat_template("chatml_tools")
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    for token in (
        "<|im_start|>",
        "<|im_end|>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ):
        assert tokenizer.tokenize(token) == [token]
    # verl's Qwen builder needs "\n" to be one token.
    assert len(tokenizer.encode("\n", add_special_tokens=False)) == 1

    messages = [{"role": "user", "content": "Forget memory 3."}]
    ids = tokenizer.apply_chat_template(messages, tools=[SCHEMA], add_generation_prompt=True, return_dict=False)
    text = tokenizer.decode(ids)
    assert '"name": "delete_memory"' in text
    assert text.endswith("<|im_start|>assistant\n")
    # Byte-level BPE: any text, even outside the training corpus, round-trips exactly.
    odd = "Zoë's café: 3.14 ≠ π\t🙂"
    assert tokenizer.decode(tokenizer.encode(odd, add_special_tokens=False)) == odd

    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert out[0, : len(ids)].tolist() == ids and len(ids) < out.shape[1] <= len(ids) + 4


def test_manifest(tiny_model_dir):
    m = manifest(tiny_model_dir)
    assert m["kind"] == "tiny_random"
    assert m["source"] is None and m["source_sha256"] is None
    assert m["parameters"] == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert m["dtype"] == "float32"
    assert m["chat_template"] == "chatml_tools"
    assert m["spec"]["hidden_size"] == 64 and m["spec"]["seed"] == 0
    assert m["created"].endswith("+00:00")
    assert set(m["versions"]) == {"memupdate", "torch", "transformers"}


def test_hf_resaves_a_local_checkpoint(tiny_model_dir, tmp_path):
    # A source whose tokenizer carries some other template.
    source = tmp_path / "source"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(source)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    tokenizer.save_pretrained(source)

    kept = prepare_model({"kind": "hf", "name_or_path": str(source)}, tmp_path / "kept")
    assert AutoTokenizer.from_pretrained(tmp_path / "kept").chat_template == tokenizer.chat_template
    assert kept["source"] == str(source) and kept["chat_template"] is None

    replaced = prepare_model(
        {"kind": "hf", "name_or_path": str(source), "chat_template": "chatml_tools", "dtype": "bfloat16"},
        tmp_path / "replaced",
    )
    assert AutoTokenizer.from_pretrained(tmp_path / "replaced").chat_template == load_chat_template("chatml_tools")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "replaced")
    assert model.dtype == torch.bfloat16
    assert replaced["dtype"] == "bfloat16" and replaced["parameters"] == manifest(tiny_model_dir)["parameters"]
    assert (tmp_path / "replaced" / "generation_config.json").is_file()


def test_a_spec_that_overstates_the_models_positions_is_refused(tiny_model_dir, tmp_path):
    """The dry run holds serving.max_model_len to the positions a spec declares; a model with fewer would pass a
    context vLLM then refuses, hours later."""
    spec = {"kind": "hf", "name_or_path": str(tiny_model_dir), "max_position_embeddings": 32768}
    with pytest.raises(ValueError, match=r"has 4096 positions \(max_position_embeddings\), its spec says 32768"):
        prepare_model(spec, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert prepare_model({**spec, "max_position_embeddings": 4096}, tmp_path / "out")["spec"]["max_position_embeddings"]


def test_a_hub_model_is_downloaded_once_and_prepared_with_no_network(tiny_model_dir, tmp_path, monkeypatch):
    """download_model (a local rule: the submitting machine has the network) fills the shared cache and records the
    commit; prepare_model (a compute node's job) reads that snapshot offline and pins the same commit."""
    import huggingface_hub

    # The hub cache as a download leaves it (models--org--name/snapshots/<commit>, refs/main), read offline.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(repo / "snapshots" / commit)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    spec = {"kind": "hf", "name_or_path": "org/tiny", "dtype": "float32"}

    record = prepare.download_model(spec, tmp_path / "tiny.download.json")
    assert record["commit"] == commit and record == json.loads((tmp_path / "tiny.download.json").read_text())
    with pytest.raises(ValueError, match="download_model"):
        prepare_model(spec, tmp_path / "undownloaded")
    built = prepare_model(spec, tmp_path / "tiny", download=tmp_path / "tiny.download.json")
    assert built["source"] == "org/tiny" and built["source_revision"] == commit
    assert built["parameters"] == manifest(tiny_model_dir)["parameters"]
    # A marker whose snapshot another machine's cache holds says what to share.
    (tmp_path / "other.json").write_text(json.dumps({**record, "path": "/elsewhere/snapshots/x"}))
    with pytest.raises(FileNotFoundError, match="HF_HOME must be on a file system every node shares"):
        prepare_model(spec, tmp_path / "other", download=tmp_path / "other.json")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (["tiny_random"], r"model spec.kind: null is not one of hf, smollm2_gguf, tiny_random"),
        ({}, r"model spec.kind: null is not one of hf, smollm2_gguf, tiny_random"),
        ({"kind": "gguf"}, r"model spec.kind: 'gguf' is not one of hf, smollm2_gguf, tiny_random"),
        ({"kind": "hf"}, r"model spec.name_or_path: required"),
        (
            {"kind": "tiny_random", "hiden_size": 32},
            r"model spec.hiden_size: unknown setting; did you mean hidden_size\?",
        ),
        ({"kind": "smollm2_gguf", "dtype": "float16"}, r"model spec.dtype: 'float16' is not one of bfloat16, float32"),
        ({"kind": "hf", "name_or_path": "x", "dtype": "fp32"}, r"model spec.dtype: 'fp32' is not one of auto"),
        ({"kind": "tiny_random", "layers": 0}, r"model spec.layers: 0 is below the minimum 1"),
        ({"kind": "tiny_random", "seed": "0"}, r"model spec.seed: '0' is not an integer"),
        ({"kind": "tiny_random", "heads": 3}, r"hidden_size divisible by heads"),
        ({"kind": "tiny_random", "chat_template": "qwen"}, r"chat_template 'qwen' is not one of "),
    ],
)
def test_bad_specs_are_rejected_before_anything_is_written(spec, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        prepare_model(spec, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def fail_manifest(*args, **kwargs):
    raise RuntimeError("disk full")


def test_failed_build_leaves_no_output_and_no_temp_dir(tmp_path, monkeypatch):
    # The manifest is written last, after the weights and tokenizer are already in the temp folder.
    monkeypatch.setattr(prepare, "write_json_atomic", fail_manifest)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare_model({"kind": "tiny_random"}, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_survives_a_failed_rebuild_and_is_replaced_by_a_good_one(tmp_path, monkeypatch):
    out = tmp_path / "out"
    prepare_model({"kind": "tiny_random", "seed": 0}, out)
    (out / "stale.txt").write_text("from an older build")
    before = (out / "model.safetensors").read_bytes()

    with monkeypatch.context() as patch:
        patch.setattr(prepare, "write_json_atomic", fail_manifest)
        with pytest.raises(RuntimeError, match="disk full"):
            prepare_model({"kind": "tiny_random", "seed": 1}, out)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    prepare_model({"kind": "tiny_random", "seed": 1}, out)
    assert (out / "model.safetensors").read_bytes() != before
    assert not (out / "stale.txt").exists()
    assert manifest(out)["spec"]["seed"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_output_gets_the_usual_permissions(tiny_model_dir):
    # mkdtemp/mkstemp create private 0700/0600 entries; the checkpoint gets what the umask allows.
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(tiny_model_dir.stat().st_mode) == 0o777 & ~umask
    assert {stat.S_IMODE(p.stat().st_mode) for p in tiny_model_dir.iterdir()} == {0o666 & ~umask}


def test_output_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "out").write_text("not a folder")
    with pytest.raises(FileExistsError, match="is not a folder"):
        prepare_model({"kind": "tiny_random"}, tmp_path / "out")
