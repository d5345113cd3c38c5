"""The model configuration: ``ModelConfig`` (``schema``), read by ``parse`` and checked by ``validate``;
its nested sections in ``sections``. Importing it loads no kernel."""

from model.config.schema import ModelConfig
from model.config.sections import DSparkConfig, EngramConfig, Yarn

__all__ = ["DSparkConfig", "EngramConfig", "ModelConfig", "Yarn"]
