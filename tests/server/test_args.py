"""The command line reads vLLM's serve flags: the same names and meanings, and clear errors for values
the project does not support."""

from __future__ import annotations

import shlex

import pytest

from engine.config import EngineConfig
from engine.server.args import engine_config, ignored_notes, parse_args, parse_count


def test_vllm_forms_of_the_flags():
    line = (
        """/ckpt/V4 --speculative-config '{"method": "deepseek_mtp", "num_speculative_tokens": 1}' """
        "--tokenizer-mode deepseek_v4 --tool-call-parser deepseek_v4 --reasoning-parser deepseek_v4 "
        "--enable-auto-tool-choice --trust-remote-code -tp 1 --enable-expert-parallel --max-model-len 64k "
        "--no-enable-prefix-caching --api-key a --api-key b"
    )
    args = parse_args(shlex.split(line))
    assert args.model == "/ckpt/V4" and args.max_model_len == 64_000
    assert (args.speculative_method, args.num_speculative_tokens) == ("mtp", 1)
    assert args.api_keys == ["a", "b"]


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("4096", 4096), ("64k", 64_000), ("64K", 65_536), ("1m", 10**6), ("1M", 2**20), ("25.6k", 25_600),
        ("1t", 10**12), ("2T", 2**41),
    ],
)  # fmt: skip
def test_token_counts_as_vllm_writes_them(text: str, count: int):
    assert parse_count(text) == count


@pytest.mark.parametrize("text", ["auto", "-1"])
def test_max_model_len_auto_is_left_to_the_memory_plan(text: str):
    args = parse_args(["--max-model-len", text])
    assert args.max_model_len is None and engine_config(args) == EngineConfig()


def test_api_keys_come_from_the_environment_when_no_flag_names_one(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert parse_args([]).api_keys == ["from-env"]
    assert parse_args(["--api-key", "flag"]).api_keys == ["flag"]


def test_an_api_key_variable_with_its_newline_is_refused_naming_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_API_KEY", "from-file\n")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "VLLM_API_KEY 'from-file\\n': empty or edged with spaces" in capsys.readouterr().err


def test_a_yaml_config_under_the_command_line(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("max_model_len: 2048\nport: 9000\nenforce-eager: true\nserved-model-name: [a, b]\n")
    args = parse_args(["--config", str(config), "--port", "9001"])
    assert (args.max_model_len, args.port, args.enforce_eager) == (2048, 9001, True)
    assert args.served_model_name == ["a", "b"]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size=0"),
        (["--data-parallel-size", "2"], "--data-parallel-size=2"),
        (["--dtype", "float16"], "--dtype=float16"),
        (["--device", "tpu"], "invalid choice: 'tpu'"),
        (["--kv-cache-dtype", "int4"], "invalid choice: 'int4'"),
        (["--num-speculative-tokens", "2"], "--num-speculative-tokens needs a method"),
        (["--speculative-config", '{"method": "eagle"}'], "method='eagle'"),
        (["--speculative-config", '{"method": "mtp", "model": "x"}'], "model not supported"),
        (["--speculative-config", '{"method": "mtp"}', "--speculative-method", "dspark"], "disagrees"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization=1.5"),
        (["--gpu-memory-utilization", "0.5", "--kv-cache-memory", "1GiB"], "not both"),
        (["a", "--model", "b"], "given twice"),
        (["--tool-call-parser", "hermes"], "invalid choice: 'hermes'"),
        (["--max-model-len", "0"], "--max-model-len=0 must be at least 1"),
        (["--max-num-seqs", "-1"], "--max-num-seqs=-1 must be at least 1"),
        (["--max-model-len", "0.5"], "'0.5' is not a whole number of tokens"),
        (["--max-model-len", "1.5K"], "a binary unit (K) takes a whole number"),
        (["--port", "70000"], "argument --port: 70000 must be in [0, 65535]"),
        (["--master-port", "-1"], "argument --master-port: -1 must be in [0, 65535]"),
        (["--torch-threads", "0"], "argument --torch-threads: 0 must be at least 1"),
        (["--max-waiting-requests", "-1"], "argument --max-waiting-requests: -1 must be at least 0"),
        (["--shutdown-timeout", "nan"], "nan seconds must be finite and at least 0"),
        (["--api-key", ""], "--api-key '': empty or edged with spaces"),
        (["--api-key", "k", "--api-key", "k "], "--api-key 'k ': empty or edged with spaces"),
        (["--max-request-bytes", "0"], "--max-request-bytes=0 must be at least 1"),
        (["--served-model-name", "a", ""], "--served-model-name ['a', '']: a name must not be empty"),
        (["--chat-template", "t.jinja"], "--chat-template t.jinja: the DeepSeek chat encoding is built in"),
    ],
)
def test_unsupported_values_are_errors_naming_the_flag(argv: list[str], named: str, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert named in capsys.readouterr().err


def test_every_engine_field_is_a_flag_with_the_field_default():
    """The flags are generated from ``EngineConfig``: none missing, the same defaults, parsed in the units
    the field declares."""
    assert engine_config(parse_args([])) == EngineConfig()
    line = (
        "--max-num-seqs 3 --max-num-batched-tokens 2k --kv-cache-memory 1MiB --no-enable-prefix-caching "
        "--speculative-method mtp --num-speculative-tokens 2 --dspark-min-confidence 0.5"
    )
    assert engine_config(parse_args(shlex.split(line))) == EngineConfig(
        max_num_seqs=3,
        max_num_batched_tokens=2000,
        kv_cache_memory=2**20,
        enable_prefix_caching=False,
        speculative_method="mtp",
        num_speculative_tokens=2,
        dspark_min_confidence=0.5,
    )


@pytest.mark.parametrize(
    ("line", "note"),
    [
        ("--swap-space 4", "--swap-space=4.0: ignored (no CPU swap space"),
        (
            "--no-enable-chunked-prefill",
            "--enable-chunked-prefill=False: ignored (prefills are always chunked",
        ),
        ("--distributed-executor-backend mp", "--distributed-executor-backend=mp: ignored"),
    ],
)
def test_vllm_flags_that_change_nothing_here_are_accepted_with_a_note(line: str, note: str):
    notes = ignored_notes(parse_args(shlex.split(line)))
    assert len(notes) == 1 and notes[0].startswith(note)
    assert ignored_notes(parse_args(["--disable-log-requests", "--disable-uvicorn-access-log"])) == []
