"""OpenAI-compatible providers (`YUXI_PROVIDERS`) and their model calls.

`YUXI_PROVIDERS` is JSON text, or `@/path/to/file.json`::

    {"<provider>": {"base_url": "...", "api_key_env": "<ENV VAR NAME>",
                    "models": ["<model>", ...], "params": {...}}}

Model ids are `<provider>/<model>`, split at the first `/`. The API process
reads the names only (validation, `GET /api/models`); the worker reads the
key from the named environment variable when it builds the model for a run.
A key is never stored, logged or put into an error text.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import msgspec

__all__ = ["Provider", "ProviderConfigError", "load_providers", "configured_providers",
           "check_configured", "reload_providers"]

_RESERVED = {"replay"}


class ProviderConfigError(ValueError):
    """YUXI_PROVIDERS is malformed; the message names the offending part."""


class Provider(msgspec.Struct, frozen=True):
    name: str
    base_url: str
    api_key_env: str
    models: tuple[str, ...]
    params: dict[str, Any] = {}

    def api_key(self) -> str:
        """The key, read now from the worker's environment."""
        key = os.environ.get(self.api_key_env)
        if not key:
            # Names the variable, never a value.
            from yuxi.runtime.calls import ProviderError
            raise ProviderError(self.name, None,
                                f"the environment variable {self.api_key_env} is not set")
        return key


def load_providers(text: str | None) -> dict[str, Provider]:
    """Parse YUXI_PROVIDERS (JSON text or `@file`)."""
    if not text or not text.strip():
        return {}
    text = text.strip()
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ProviderConfigError(f"YUXI_PROVIDERS: cannot read {text[1:]}: {exc}") from None
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ProviderConfigError(f"YUXI_PROVIDERS: invalid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ProviderConfigError("YUXI_PROVIDERS: expected an object of providers")
    out: dict[str, Provider] = {}
    for name, spec in raw.items():
        where = f"YUXI_PROVIDERS.{name}"
        if not name or "/" in name or name in _RESERVED:
            raise ProviderConfigError(f"{where}: invalid provider name")
        if not isinstance(spec, dict):
            raise ProviderConfigError(f"{where}: expected an object")
        unknown = set(spec) - {"base_url", "api_key_env", "models", "params"}
        if unknown:
            raise ProviderConfigError(f"{where}: unknown key {sorted(unknown)[0]!r}")
        for key in ("base_url", "api_key_env"):
            if not isinstance(spec.get(key), str) or not spec[key]:
                raise ProviderConfigError(f"{where}.{key}: expected a non-empty string")
        models = spec.get("models")
        if not isinstance(models, list) or not models or \
                not all(isinstance(m, str) and m.strip() == m and m for m in models):
            raise ProviderConfigError(f"{where}.models: expected a non-empty list of names")
        params = spec.get("params", {})
        if not isinstance(params, dict):
            raise ProviderConfigError(f"{where}.params: expected an object")
        out[name] = Provider(name=name, base_url=spec["base_url"],
                             api_key_env=spec["api_key_env"], models=tuple(models),
                             params=params)
    return out


@functools.lru_cache(maxsize=1)
def configured_providers() -> dict[str, Provider]:
    """The providers of this process (read once from YUXI_PROVIDERS)."""
    return load_providers(os.environ.get("YUXI_PROVIDERS"))


def check_configured() -> dict[str, Provider]:
    """The providers of this process, or SystemExit naming what is wrong
    (called at process start: a bad YUXI_PROVIDERS stops the process)."""
    try:
        return configured_providers()
    except ProviderConfigError as exc:
        raise SystemExit(f"yuxi: invalid setting: {exc}") from None


def reload_providers() -> dict[str, Provider]:
    configured_providers.cache_clear()
    return configured_providers()
