"""Where the project keeps downloaded jars, models and broker data (LLM_WORKER_HOME)."""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


DEFAULT_HOME = Path.home() / ".cache" / "kafka-llm-worker"


class PathSettings(BaseSettings):
    """Where the project keeps downloaded jars, models and broker data."""

    model_config = SettingsConfigDict(env_prefix="LLM_WORKER_", extra="ignore", use_attribute_docstrings=True)

    home: Path = DEFAULT_HOME
    """Cache folder for Kafka jars, provisioned models and the local broker's data."""

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def kafka_dir(self) -> Path:
        return self.home / "kafka"
