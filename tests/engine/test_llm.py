"""The offline API in vLLM's shape: LLM(model=...), generate with one prompt or many, n outputs, chat."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.request import SamplingParams
from model.chat import encode_messages
from model.generate import greedy
from model.quant_linear import Int8Linear
from model.tiny import cached_tiny, write_tiny
from model.tokenizer import prompt_ids

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=cached_tiny("v41"), max_model_len=512, kv_cache_memory=32 * 2**20)


def test_generate_one_string_returns_one_result_with_text(llm: LLM):
    [result] = llm.generate("Hello", GREEDY, use_tqdm=False)
    assert result.prompt == "Hello" and result.outputs[0].text
    assert result.prompt_token_ids == prompt_ids(
        llm.engine.tokenizer, "Hello", llm.engine.model.cfg.bos_token_id
    )
    assert len(result.outputs[0].token_ids) == 4 and result.outputs[0].finish_reason == "length"


def test_prompt_forms_agree(llm: LLM):
    [text] = llm.generate({"prompt": "Hello"}, GREEDY, use_tqdm=False)
    [ids] = llm.generate({"prompt_token_ids": text.prompt_token_ids}, GREEDY, use_tqdm=False)
    [plain] = llm.generate([text.prompt_token_ids], sampling_params=GREEDY, use_tqdm=False)
    assert text.outputs[0].token_ids == ids.outputs[0].token_ids == plain.outputs[0].token_ids


def test_n_outputs_draw_from_seed_plus_i(llm: LLM):
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=3, ignore_eos=True)
    [result] = llm.generate("Tell me", sampled, use_tqdm=False)
    assert [o.index for o in result.outputs] == [0, 1, 2]
    for i, output in enumerate(result.outputs):
        alone = SamplingParams(max_tokens=6, temperature=1.0, seed=5 + i, ignore_eos=True)
        [single] = llm.generate("Tell me", alone, use_tqdm=False)
        assert output.token_ids == single.outputs[0].token_ids
    assert len({tuple(o.token_ids) for o in result.outputs}) > 1


def test_chat_renders_with_the_checkpoints_encoding(llm: LLM):
    messages = [{"role": "user", "content": "Hi"}]
    [result] = llm.chat(messages, GREEDY, use_tqdm=False)
    rendered = encode_messages(messages, profile=llm.chat_profile)
    assert result.prompt == rendered
    assert result.prompt_token_ids == prompt_ids(
        llm.engine.tokenizer, rendered, llm.engine.model.cfg.bos_token_id
    )
    assert len(llm.chat([messages, messages], GREEDY, use_tqdm=False)) == 2


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"tensor_parallel_size": 3}, "tensor_parallel_size=3 does not divide num_attention_heads=4"),
     ({"tensor_parallel_size": 0}, "tensor_parallel_size=0"), ({"dtype": "float16"}, "dtype='float16'"),
     ({"device": "tpu"}, "device='tpu'"),
     ({"max_batch": 3}, "max_batch"), ({"quantization": "ascend"}, "quantization='ascend'.*unquantized"),
     ({"speculative_config": {"method": "eagle"}}, "speculative_config")],
)  # fmt: skip
def test_unsupported_engine_arguments_are_errors(kwargs: dict, named: str):
    with pytest.raises(ValueError, match=named):
        LLM(model=cached_tiny("v41"), **kwargs)


def test_quantization_w8a8_requantises_an_fp8_checkpoint(tmp_path):
    """vLLM's ``quantization`` argument: ``w8a8`` serves an FP8 checkpoint's linears as int8 W8A8."""
    fp8 = write_tiny(tmp_path / "fp8", arch="v41", fp8=True)
    llm = LLM(model=fp8, quantization="w8a8", max_model_len=256, kv_cache_memory=16 * 2**20)
    assert isinstance(llm.engine.model.layers[0].attn.wq_a, Int8Linear)
    [result] = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert result.outputs[0].token_ids == greedy(llm.engine.model, result.prompt_token_ids, 4)
    with pytest.raises(ValueError, match="quantization='ascend': the checkpoint is stored as fp8"):
        LLM(model=fp8, quantization="ascend")


def test_a_bf16_engine_run_agrees_with_the_model_alone():
    """The engine's paged bf16 path gives the greedy tokens of the bf16 model run by itself."""
    llm = LLM(model=cached_tiny("v41"), dtype="bfloat16", max_model_len=512, kv_cache_memory=32 * 2**20)
    engine = llm.engine
    assert engine.model.embed.weight.dtype == engine.runner.pools.buffer.dtype == torch.bfloat16
    [result] = llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    tokens = result.outputs[0].token_ids
    print(f"bf16 engine greedy: {tokens} {result.outputs[0].text!r}")
    assert tokens == greedy(engine.model, result.prompt_token_ids, 8)
