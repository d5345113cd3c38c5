"""The server's command line: vLLM's `serve` flags for what the project supports, with vLLM's names,
meanings and defaults, so a vLLM launch line works unchanged; the project's own flags beside them.

Flags for what the project does not do yet (several devices, float16, an fp8 KV cache) are accepted with
their neutral value and refused, naming the flag, with any other; flags that change nothing here
(`--trust-remote-code`, `--enforce-eager`) are accepted, those of ``IGNORED`` with a logged note why;
`--chat-template` is refused (the chat encoding is built in). `--config FILE` reads flags from YAML (keys are
the long flag names); the command line wins over the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from engine.config import EngineConfig, read_speculative_config
from engine.server.flag_values import int_in, parse_count, parse_count_or_auto, parse_size, port, seconds
from model.chat_profile import PROFILES

# vLLM's names for the DeepSeek V4 tokenizer, tool-call and reasoning parsers: all built in here.
DEEPSEEK_PARSERS = ("deepseek_v4", "deepseek_v41")
API_KEY_VARIABLES = ("DSV4_API_KEY", "VLLM_API_KEY")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m engine.serve",
        description="OpenAI-compatible server for DeepSeek V4 / V4.1 (vLLM's serve flags; docs/serving.md)",
    )
    p.add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="the checkpoint folder (as `vllm serve MODEL`)"
    )
    p.add_argument("--model", help="the checkpoint folder (default: the tiny V4.1)")
    p.add_argument("--config", help="a YAML file of flags, keys as the long flag names")

    where = p.add_argument_group("where")
    where.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")
    where.add_argument("--port", type=port, default=8000, help="0: any free port (default: 8000)")
    where.add_argument("--served-model-name", nargs="+", help="names clients use (default: the folder name)")
    where.add_argument(
        "--api-key",
        action="append",
        help=f"required Bearer key; repeatable; else {', '.join(API_KEY_VARIABLES)}",
    )

    model = p.add_argument_group("model")
    model.add_argument("--tokenizer-mode", default="auto", choices=["auto", *DEEPSEEK_PARSERS])
    model.add_argument(
        "--trust-remote-code", action="store_true", help="accepted: the model code is built in"
    )
    model.add_argument("--dtype", default="auto",
                       choices=["auto", "bfloat16", "float32", "float", "float16", "half"],
                       help="compute dtype; auto: bfloat16 on npu / cuda, float32 on cpu")  # fmt: skip
    model.add_argument("--device", choices=["npu", "cuda", "cpu"],
                       help="where the model runs (default: the accelerator present, else cpu)")  # fmt: skip
    model.add_argument("--quantization", "-q",
                       help="the checkpoint's own format (fp8; ascend: msModelSlim W8A8), kept packed; or "
                       "w8a8: requantise an fp8 checkpoint to int8 W8A8 at load (Ascend A2/A3)")  # fmt: skip
    model.add_argument("--generation-config", default="auto",
                       help="auto: sampling defaults from the model's generation_config.json; vllm: none; "
                       "or a folder holding one")  # fmt: skip
    model.add_argument("--chat-encoding", choices=PROFILES, help="override the checkpoint's chat encoding")
    model.add_argument(
        "--chat-template", help="refused: the DeepSeek chat encoding is built in (--chat-encoding)"
    )
    model.add_argument("--tool-call-parser", choices=DEEPSEEK_PARSERS, help="accepted: built in")
    model.add_argument("--reasoning-parser", choices=DEEPSEEK_PARSERS, help="accepted: built in")
    model.add_argument(
        "--enable-auto-tool-choice", action="store_true", help="accepted: tool_choice=auto works"
    )

    _engine_flags(p.add_argument_group("engine (EngineConfig's fields)"))
    cache = p.add_argument_group("cache")
    cache.add_argument("--gpu-memory-utilization", type=float,
                       help="the share of the device's memory for weights and the KV cache (instead of "
                       "--kv-cache-memory)")  # fmt: skip
    cache.add_argument(
        "--enforce-eager", action="store_true", help="capture no decode graphs (CUDA / NPU): every step eager"
    )

    parallel = p.add_argument_group("parallelism (tensor parallel with the experts split inside the group, "
                                    "or data parallel with expert parallel)")  # fmt: skip
    for name, short in (("tensor", "tp"), ("data", "dp"), ("pipeline", "pp")):
        parallel.add_argument(f"--{name}-parallel-size", f"-{short}", type=int, default=1)
    parallel.add_argument("--nnodes", type=int_in(1), default=1,
                          help="machines the tensor-parallel ranks span (torchrun: its nodes)")  # fmt: skip
    parallel.add_argument("--node-rank", type=int_in(0), default=0, help="this machine's place: 0 serves, "
                          "the others only run their ranks (torchrun: GROUP_RANK)")  # fmt: skip
    parallel.add_argument("--master-addr", default="127.0.0.1",
                          help="node 0's address, where the ranks meet (torchrun: MASTER_ADDR)")  # fmt: skip
    parallel.add_argument("--master-port", type=port, default=0, help="the port the ranks meet on (needed "
                          "with --nnodes > 1; torchrun: MASTER_PORT)")  # fmt: skip
    p.set_defaults(launcher_store="")
    parallel.add_argument("--enable-expert-parallel", action="store_true",
                          help="split the routed experts over the data-parallel ranks (under tensor "
                          "parallelism they are always split)")  # fmt: skip

    model.add_argument("--engram-config", type=json.loads,
                       help='JSON, vLLM\'s form of --engram-offload: {"cpu_offload": true}')  # fmt: skip

    spec = p.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative-config",
        type=json.loads,
        help='JSON, e.g. {"method": "mtp", "num_speculative_tokens": 1}',
    )

    server = p.add_argument_group("server")
    server.add_argument("--max-request-bytes", type=parse_size,
                        help="larger request bodies get 413 (default: 4MiB)")  # fmt: skip
    server.add_argument("--max-waiting-requests", type=int_in(0), default=256,
                        help="sequences waiting beyond --max-num-seqs; more get 503")  # fmt: skip
    server.add_argument("--shutdown-timeout", type=seconds, default=30.0,
                        help="seconds SIGTERM lets the requests in flight finish (default: 30)")  # fmt: skip
    server.add_argument("--enable-log-requests", action="store_true", help="log each request as it arrives")
    server.add_argument("--disable-log-requests", action="store_true",
                        help="accepted: requests are logged only with --enable-log-requests")  # fmt: skip
    server.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput line")
    server.add_argument("--disable-uvicorn-access-log", action="store_true", help="no line per HTTP request")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])  # fmt: skip
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="the server's own logging (default: info)")  # fmt: skip
    server.add_argument("--torch-threads", type=int_in(1), help="torch CPU threads (default: torch's choice)")
    ignored = p.add_argument_group("vLLM flags with nothing to switch here (accepted, with a note)")
    ignored.add_argument("--swap-space", type=float, help="GiB of CPU swap space per device")
    ignored.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    ignored.add_argument("--distributed-executor-backend", choices=["mp", "ray", "uni", "external_launcher"])
    return p


# Why each of these vLLM flags changes nothing here; a launch line that sets one gets this as a note.
IGNORED = {
    "swap_space": "no CPU swap space: a preempted request recomputes its KV cache",
    "enable_chunked_prefill": "prefills are always chunked to --max-num-batched-tokens",
    "distributed_executor_backend": "every rank is a process of its own",
}


def ignored_notes(args: argparse.Namespace) -> list[str]:
    """A note for each flag of ``IGNORED`` the launch line set."""
    return [
        f"--{name.replace('_', '-')}={getattr(args, name)}: ignored ({why})"
        for name, why in IGNORED.items()
        if getattr(args, name) is not None
    ]


_UNITS = {"tokens": parse_count, "tokens or auto": parse_count_or_auto, "bytes": parse_size}
_TYPES = {"int": int, "float": float, "str": str}


def _engine_flags(group: argparse._ArgumentGroup) -> None:
    """One flag per ``EngineConfig`` field, as its metadata says (``engine.config._flag``)."""
    for f in dataclasses.fields(EngineConfig):
        meta, flag = f.metadata, "--" + f.name.replace("_", "-")
        if meta.get("cli") is False:
            continue
        default = None if meta.get("unset") else f.default
        shown = f"{meta['help']} (default: {f.default})" if f.default is not None else meta["help"]
        if f.type.startswith("bool"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=shown)
            continue
        parse = _UNITS[meta["unit"]] if "unit" in meta else _TYPES[f.type.split(" ")[0]]
        group.add_argument(flag, type=parse, default=default, choices=meta.get("choices"), help=shown)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's configuration from the flags (an unset flag leaves the field's default)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in given.items() if v is not None})


def _yaml_flags(path: str) -> list[str]:
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: must hold a mapping of flag names to values")
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def torchrun_defaults(env: Mapping[str, str]) -> dict[str, Any]:
    """The multi-node flags' defaults from torchrun's variables (none outside torchrun). It runs one
    server per machine (``--nproc-per-node 1``: the server starts the machine's ranks itself), so its
    WORLD_SIZE / LOCAL_WORLD_SIZE is the node count. Its agent already serves a store at MASTER_ADDR:
    MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE); the ranks then join that one (``launcher_store``: the
    prefix of their keys there, one per restart) instead of rank 0 serving its own."""
    if "GROUP_RANK" not in env:
        return {}
    local, world = int(env["LOCAL_WORLD_SIZE"]), int(env["WORLD_SIZE"])
    if local != 1:
        raise ValueError(
            f"torchrun started LOCAL_WORLD_SIZE={local} servers per machine: run it with --nproc-per-node 1 "
            "(the server starts the machine's ranks itself)"
        )
    defaults = {"nnodes": world // local, "node_rank": int(env["GROUP_RANK"]),
                "master_addr": env["MASTER_ADDR"], "master_port": int(env["MASTER_PORT"])}  # fmt: skip
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        defaults["launcher_store"] = f"deepseek-ascend/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return defaults


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked; errors exit through argparse naming the flag. `args.model` is resolved (None:
    the tiny V4.1), `args.api_keys` holds every accepted key, the speculative flags are merged; under
    torchrun the multi-node flags default to its variables (``torchrun_defaults``)."""
    parser = build_parser()
    try:
        torchrun = torchrun_defaults(os.environ)
    except ValueError as err:
        parser.error(str(err))
    parser.set_defaults(**torchrun)
    argv = list(sys.argv[1:] if argv is None else argv)
    early, _ = build_parser().parse_known_args(argv)
    if early.config:
        try:
            argv = _yaml_flags(early.config) + argv
        except (OSError, ValueError, yaml.YAMLError) as err:
            parser.error(f"--config {early.config}: {err}")
    args = parser.parse_args(argv)
    if (args.master_addr, args.master_port) != (torchrun.get("master_addr"), torchrun.get("master_port")):
        args.launcher_store = ""  # the ranks meet elsewhere than torchrun's store: rank 0 serves theirs
    try:
        _check(args)
    except ValueError as err:
        parser.error(str(err))
    return args


def _check(args: argparse.Namespace) -> None:
    if args.model_tag and args.model and Path(args.model_tag) != Path(args.model):
        raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
    args.model = args.model or args.model_tag
    if args.pipeline_parallel_size != 1:
        raise ValueError(f"--pipeline-parallel-size={args.pipeline_parallel_size}: not supported (1)")
    if args.dtype in ("float16", "half"):
        raise ValueError(f"--dtype={args.dtype}: the model computes in bfloat16 or float32 (or auto)")
    if args.chat_template is not None:
        raise ValueError(
            f"--chat-template {args.chat_template}: the DeepSeek chat encoding is built in (choose another "
            f"with --chat-encoding, one of {', '.join(PROFILES)})"
        )
    if args.gpu_memory_utilization is not None:
        if not 0 < args.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization={args.gpu_memory_utilization} must be in (0, 1]")
        if args.kv_cache_memory is not None:
            raise ValueError("give --gpu-memory-utilization or --kv-cache-memory, not both")
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes={args.max_request_bytes} must be at least 1")
    if any(not name.strip() for name in args.served_model_name or []):
        raise ValueError(f"--served-model-name {args.served_model_name}: a name must not be empty")
    # An empty variable counts as unset (as in vLLM); an empty flag, or a key read from a file with its
    # newline, is a mistake: no Authorization header carries it, so no client could ever be let in.
    keys = [("--api-key", k) for k in args.api_key or []] or [
        (v, k) for v in API_KEY_VARIABLES if (k := os.environ.get(v))
    ]
    for source, key in keys:
        if not key or key != key.strip():
            raise ValueError(
                f"{source} {key!r}: empty or edged with spaces, no Authorization header can carry it "
                "(leave it out for a server without keys)"
            )
    args.api_keys = [key for _, key in keys]
    _merge_speculative(args)
    _merge_engram(args)
    try:
        engine_config(args)  # EngineConfig's checks, before the port opens
    except ValueError as err:
        raise ValueError(_as_flags(str(err))) from None


_FIELD = re.compile(r"\b(" + "|".join(f.name for f in dataclasses.fields(EngineConfig)) + r")=")


def _as_flags(message: str) -> str:
    """EngineConfig's message with its field names written as their flags: `--max-num-seqs=0 ...`."""
    return _FIELD.sub(lambda m: "--" + m[1].replace("_", "-") + "=", message)


def _merge_speculative(args: argparse.Namespace) -> None:
    """--speculative-config (vLLM's form) folded into --speculative-method / --num-speculative-tokens."""
    config: Any = args.speculative_config
    if config is not None:
        method, tokens = read_speculative_config(config, "--speculative-config")
        for name, value in (("method", method), ("num_speculative_tokens", tokens)):
            given = getattr(args, "speculative_method" if name == "method" else name)
            if value is not None and given is not None and given != value:
                raise ValueError(f"--speculative-config {name}={value!r} disagrees with the flag ({given!r})")
        args.speculative_method = method
        args.num_speculative_tokens = args.num_speculative_tokens or tokens
    if args.num_speculative_tokens is not None and args.speculative_method is None:
        raise ValueError(
            "--num-speculative-tokens needs a method: --speculative-method or --speculative-config"
        )


def _merge_engram(args: argparse.Namespace) -> None:
    """--engram-config (vLLM's form) folded into --engram-offload."""
    config: Any = args.engram_config
    if config is None:
        return
    if not isinstance(config, dict) or set(config) - {"cpu_offload"}:
        raise ValueError(f'--engram-config {json.dumps(config)}: only {{"cpu_offload": true | false}}')
    if not isinstance(offload := config.get("cpu_offload", False), bool):
        raise ValueError(f"--engram-config cpu_offload={offload!r} must be true or false")
    args.engram_offload = args.engram_offload or offload


def non_default(args: argparse.Namespace) -> dict[str, Any]:
    """The flags a launch line changed, for the start-up log."""
    defaults = vars(build_parser().parse_args([]))
    hidden = {"api_key", "api_keys", "model_tag", "config", "speculative_config", "engram_config"}
    return {k: v for k, v in vars(args).items() if k not in hidden and defaults.get(k, v) != v}
