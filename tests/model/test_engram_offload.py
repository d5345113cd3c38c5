"""Engram host offload (``engram_offload``, vLLM's ``--engram-config '{"cpu_offload": true}'``): the V4.1
tables stay in host memory, each step gathers its rows there and copies only them to the device; the
logits are those of on-device tables and the memory plan keeps the tables' bytes off the device."""

from __future__ import annotations

import pytest
import torch

from engine.memory_plan import engram_table_bytes, plan_memory
from engine.server.args import parse_args
from model.checkpoint import load_model
from model.engram import Engram
from model.testing.tiny import cached_tiny

SHAPE = {"max_num_batched_tokens": 64, "max_model_len": 256, "block_size": 16, "kv_cache_memory": 2**24}


def _logits(model) -> torch.Tensor:
    device = model.embed.weight.device
    ids = torch.randint(3, model.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).to(device)
    state = model.new_state()
    with torch.no_grad():
        prefill = model(ids[:32], state)
        steps = [model(ids[t : t + 1], state) for t in range(32, 40)]
    return torch.cat([prefill, *steps]).cpu()


def _tables(model) -> list[torch.Tensor]:
    return [t for m in model.modules() if isinstance(m, Engram) for t in m.embed.state_dict().values()]


def test_offloaded_tables_give_the_logits_of_loaded_ones() -> None:
    path = cached_tiny("v41")
    offloaded = load_model(path, engram_offload=True)
    assert _tables(offloaded) and all(t.device.type == "cpu" for t in _tables(offloaded))
    assert torch.equal(_logits(offloaded), _logits(load_model(path)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host offload needs an accelerator to offload from")
def test_on_a_device_the_tables_stay_pinned_on_the_host() -> None:
    path = cached_tiny("v41")
    offloaded = load_model(path, torch.bfloat16, "cuda", engram_offload=True)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in _tables(offloaded))
    on_device = load_model(path, torch.bfloat16, "cuda")
    assert all(t.device.type == "cuda" for t in _tables(on_device))
    assert torch.equal(_logits(offloaded), _logits(on_device))


def test_the_plan_keeps_the_tables_off_the_device() -> None:
    path = cached_tiny("v41")
    plain = plan_memory(path, torch.float32, "auto", **SHAPE)
    offloaded = plan_memory(path, torch.float32, "auto", engram_offload=True, **SHAPE)
    tables = engram_table_bytes(load_model(path))
    print(plain.line(), offloaded.line(), sep="\n")
    assert tables > 0 and offloaded.host_bytes == tables and plain.host_bytes == 0
    assert offloaded.weight_bytes == plain.weight_bytes - tables  # the tables' device bytes: 0
    assert "Engram tables in host memory" in offloaded.line()


def test_vllm_engram_config_turns_offload_on(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(["--engram-config", '{"cpu_offload": true}']).engram_offload
    assert parse_args(["--engram-offload"]).engram_offload
    assert not parse_args(["--engram-config", '{"cpu_offload": false}']).engram_offload
    for config, message in (
        ('{"cpu_offload": true, "prefetch": 2}', 'only {"cpu_offload": true | false}'),
        ('{"cpu_offload": 1}', "cpu_offload=1 must be true or false"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["--engram-config", config])
        assert message in capsys.readouterr().err
