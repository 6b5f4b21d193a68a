"""Which chat models a session may use, and how to build them.

Model names are ``<provider>`` or ``<provider>/<name>``, split at the first
``/``. ``replay`` (deterministic, scripted) is always there; OpenAI-compatible
providers come from ``YUXI_PROVIDERS`` (yuxi.runtime.providers) and serve the
models listed for them, e.g. ``vllm/Qwen/Qwen2.5-7B-Instruct``.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Protocol

from langchain_core.language_models.chat_models import BaseChatModel

from yuxi.runtime.providers import Provider, configured_providers
from yuxi.runtime.replay import ReplayChatModel, validate_script

__all__ = [
    "PROVIDERS",
    "ProviderFactory",
    "UnknownModelError",
    "build_chat_model",
    "check_model_name",
    "list_models",
    "validate_agent_config",
]

# The part after "<provider>/": a plain identifier, never another path segment.
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")


class UnknownModelError(ValueError):
    """The model name is not served by any registered provider."""


class ProviderFactory(Protocol):
    def __call__(
        self, name: str, config: dict, *, approval_mode: str, session: dict
    ) -> BaseChatModel: ...


def _build_replay(
    name: str, config: dict, *, approval_mode: str, session: dict
) -> BaseChatModel:
    return ReplayChatModel(
        script=config.get("replay") or {},
        model_name=name,
        approval_mode=approval_mode,
        session=session,
    )


PROVIDERS: dict[str, ProviderFactory] = {"replay": _build_replay}


def check_model_name(name: str) -> str:
    """Return ``name`` normalized (surrounding whitespace stripped), or raise
    ``UnknownModelError`` if no registered or configured provider serves it."""
    # Config values arrive unchecked from JSON, so a non-string is refused too.
    normalized = name.strip() if isinstance(name, str) else ""
    provider, slash, rest = normalized.partition("/")
    if provider in PROVIDERS and (not slash or _NAME_RE.fullmatch(rest)):
        return normalized
    configured = configured_providers()
    if provider in configured and slash and rest in configured[provider].models:
        return normalized
    accepted = ", ".join(f"'{p}' or '{p}/<name>'" for p in sorted(PROVIDERS))
    served = "".join(f", '{m['id']}'" for m in list_models() if m["provider"] not in PROVIDERS)
    raise UnknownModelError(
        f"unknown model {name!r}: accepted are {accepted}{served}, "
        "where <name> is made of letters, digits, '.', '_' and '-'"
    )


def list_models() -> list[dict[str, str]]:
    """The models a caller can choose: replay, then each configured model."""
    items = [{"id": p, "provider": p} for p in sorted(PROVIDERS)]
    for provider in configured_providers().values():
        items += [{"id": f"{provider.name}/{m}", "provider": provider.name}
                  for m in provider.models]
    return items


def build_openai_model(provider: Provider, model: str, *, timeout: float | None = None
                       ) -> BaseChatModel:
    """A streaming ``ChatOpenAI`` for one configured model; the key is read
    from the worker's environment now. Retries are ours (yuxi.runtime.calls),
    so the client's own are off.

    One instance per address, model, key, timeout and params in a process,
    shared by its runs: building one costs ~1.4 ms (its pydantic validation
    and its OpenAI clients), and a call keeps nothing on it. A changed key
    (or params) is another instance."""
    return _openai_model(provider.base_url, model, provider.api_key(), timeout,
                         json.dumps(provider.params, sort_keys=True))


@functools.lru_cache(maxsize=64)
def _openai_model(base_url: str, model: str, api_key: str, timeout: float | None,
                  params: str) -> BaseChatModel:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=model, base_url=base_url, api_key=api_key,
                      streaming=True, stream_usage=True, max_retries=0, timeout=timeout,
                      **json.loads(params))


def build_chat_model(
    name: str, config: dict, *, approval_mode: str, session: dict,
    timeout: float | None = None,
) -> BaseChatModel:
    """Build the chat model ``name`` for a session.

    ``config`` is the session/agent config; providers read their own keys from
    it (``replay`` reads its script from ``config["replay"]``).
    """
    name = check_model_name(name)
    provider, _, model = name.partition("/")
    if provider not in PROVIDERS:
        return build_openai_model(configured_providers()[provider], model,
                                  timeout=timeout)
    factory = PROVIDERS[provider]
    return factory(name, config, approval_mode=approval_mode, session=session)


def validate_agent_config(config: dict) -> None:
    """Reject a bad model name or replay script when a config is submitted,
    rather than when a turn first runs."""
    if config.get("replay") is not None:
        validate_script(config["replay"])
    if "model" in config:
        check_model_name(config["model"])
