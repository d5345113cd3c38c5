"""transformers' ``DeepseekV4ForCausalLM`` loaded with the weights of one of our checkpoints."""

from __future__ import annotations

import torch

from model.hf_names import to_transformers


def transformers_model(raw_config: dict, official: dict[str, torch.Tensor]):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(**{k: v for k, v in raw_config.items() if k != "quantization_config"})
    config._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(config).float()
    model.load_state_dict(to_transformers(official), strict=True)
    return model.eval()
