"""The offline API in vLLM's shape: LLM(model=...), generate with one prompt or many, n outputs, chat."""

from __future__ import annotations

import io
import sys
import time

import numpy as np
import pytest
import torch

from engine.llm import LLM
from engine.request import SamplingParams
from model.chat import encode_messages
from model.generate import greedy
from model.quant_linear import Int8Linear
from model.testing.tiny import cached_tiny, write_tiny
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


BAD_PROMPTS = {
    "None": (None, "prompts=None: must be"),
    "a number": (5, "prompts=5: must be"),
    "a dict of neither form": ({"text": "x"}, "'prompt' or 'prompt_token_ids', not \\['text'\\]"),
    "a dict with a number": ({"prompt": 5}, "prompt=5: must be"),
    "a bool token": ([1, True], "token id True"),
    "a token outside the vocabulary": (
        [1, 10**9],
        r"token id 1000000000 is outside the vocabulary \[0, 4096\)",
    ),
}


@pytest.mark.parametrize(("prompt", "named"), BAD_PROMPTS.values(), ids=BAD_PROMPTS.keys())
def test_a_bad_prompt_is_a_value_error_that_leaves_nothing_behind(llm: LLM, prompt: object, named: str):
    [before] = llm.generate("Hello", GREEDY, use_tqdm=False)
    batch = prompt if prompt is None or isinstance(prompt, int) else ["Hello", prompt]
    with pytest.raises(ValueError, match=named):
        llm.generate(batch, GREEDY, use_tqdm=False)
    # The good prompt queued before the bad one is not left to run with (or leak past) the next call.
    assert not llm.engine.has_work and not llm.engine.requests
    [after] = llm.generate("Hello", GREEDY, use_tqdm=False)
    assert after.outputs[0].token_ids == before.outputs[0].token_ids


def test_max_tokens_none_generates_to_the_end_of_the_context(llm: LLM):
    """vLLM's SamplingParams(max_tokens=None): as many tokens as the context has room for after the prompt."""
    prompt = [5] * (llm.engine.config.max_model_len - 20)
    unbounded = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    [result] = llm.generate([prompt], unbounded, use_tqdm=False)
    assert len(result.outputs[0].token_ids) == 20 and result.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len=512"):  # no room left at all: refused, naming it
        llm.generate([[5] * 512], unbounded, use_tqdm=False)


def test_the_progress_bar_is_written_once_where_stderr_is_no_terminal(llm: LLM, capsys):
    llm.generate(["Hello", "Hi there"], SamplingParams(max_tokens=24, ignore_eos=True))
    written = capsys.readouterr().err
    assert written.count("Processed prompts") == 1 and "2/2" in written, written


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_is_redrawn_at_most_four_times_a_second_on_a_terminal(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    started = time.monotonic()
    llm.generate(["Hello", "Hi there"], SamplingParams(max_tokens=64, ignore_eos=True))
    elapsed = time.monotonic() - started
    draws = terminal.getvalue().count("Processed prompts")
    assert "2/2" in terminal.getvalue() and draws <= 4 * elapsed + 3, (draws, elapsed)


def test_chat_template_kwargs_thinking_must_be_a_bool(llm: LLM):
    with pytest.raises(ValueError, match="thinking='yes' must be true or false"):
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY, chat_template_kwargs={"thinking": "yes"})


BAD_PARAMS = {
    "max_tokens 5.5": ({"max_tokens": 5.5}, "max_tokens=5.5 must be an integer"),
    "max_tokens True": ({"max_tokens": True}, "max_tokens=True must be an integer"),
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens=0 must be at least 1"),
    "min_tokens over max_tokens": ({"max_tokens": 2, "min_tokens": 3}, "min_tokens=3 must be in"),
    "n a string": ({"n": "2"}, "n='2' must be an integer"),
    "seed 1.5": ({"seed": 1.5}, "seed=1.5 must be an integer"),
    "logprobs True": ({"logprobs": True}, "logprobs=True must be an integer"),
    "temperature None": ({"temperature": None}, "temperature=None must be a number"),
    "top_p a string": ({"top_p": "1"}, "top_p='1' must be a number"),
    "top_p NaN": ({"top_p": float("nan")}, "top_p=nan must be in"),
    "stop token 1.0": ({"stop_token_ids": [1.0]}, "stop_token_ids=\\(1.0,\\) must be non-negative integers"),
}


@pytest.mark.parametrize(("kwargs", "named"), BAD_PARAMS.values(), ids=BAD_PARAMS.keys())
def test_bad_sampling_params_are_value_errors_naming_the_value(kwargs: dict, named: str):
    with pytest.raises(ValueError, match=named):
        SamplingParams(**kwargs)


def test_stop_takes_vllms_forms():
    """One string is one stop string, not a stop per character; lists and None are accepted too."""
    assert SamplingParams(stop="ab").stop == SamplingParams(stop=["ab"]).stop == ("ab",)
    assert SamplingParams(stop=None, stop_token_ids=None) == SamplingParams()
    assert SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.5)).max_tokens == 3


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
