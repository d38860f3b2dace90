"""The `ft` command line's settings, read from the environment (prefix FT_) each time it starts."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_URL = "http://127.0.0.1:8000"


class CliSettings(BaseSettings):
    # Inputs stay out of error messages: they hold the API key.
    model_config = SettingsConfigDict(env_prefix="FT_", extra="ignore", hide_input_in_errors=True)

    api_url: str = DEFAULT_URL  # the service's base URL
    api_key: str | None = None  # sent as the bearer token; unset: var/dev-key of `make up`, if there is one
    api_token: str | None = None  # the older name of api_key, read when api_key is unset or empty

    @property
    def key(self) -> str | None:
        return self.api_key or self.api_token
