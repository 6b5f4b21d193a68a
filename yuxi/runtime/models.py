"""Which chat models a session may use, and how to build them.

Model names are ``<provider>`` or ``<provider>/<name>``. A provider is a
factory registered in ``PROVIDERS`` under its prefix; only the deterministic
``replay`` provider exists today, and an OpenAI-compatible one can be added by
registering another factory, without touching callers.
"""

from __future__ import annotations

import re
from typing import Protocol

from langchain_core.language_models.chat_models import BaseChatModel

from yuxi.runtime.replay import ReplayChatModel, validate_script

__all__ = [
    "PROVIDERS",
    "ProviderFactory",
    "UnknownModelError",
    "build_chat_model",
    "check_model_name",
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
    ``UnknownModelError`` if no registered provider serves it."""
    # Config values arrive unchecked from JSON, so a non-string is refused too.
    normalized = name.strip() if isinstance(name, str) else ""
    provider, slash, rest = normalized.partition("/")
    if provider in PROVIDERS and (not slash or _NAME_RE.fullmatch(rest)):
        return normalized
    accepted = ", ".join(f"'{p}' or '{p}/<name>'" for p in sorted(PROVIDERS))
    raise UnknownModelError(
        f"unknown model {name!r}: accepted are {accepted}, "
        "where <name> is made of letters, digits, '.', '_' and '-'"
    )


def build_chat_model(
    name: str, config: dict, *, approval_mode: str, session: dict
) -> BaseChatModel:
    """Build the chat model ``name`` for a session.

    ``config`` is the session/agent config; providers read their own keys from
    it (``replay`` reads its script from ``config["replay"]``).
    """
    name = check_model_name(name)
    factory = PROVIDERS[name.partition("/")[0]]
    return factory(name, config, approval_mode=approval_mode, session=session)


def validate_agent_config(config: dict) -> None:
    """Reject a bad model name or replay script when a config is submitted,
    rather than when a turn first runs."""
    if config.get("replay") is not None:
        validate_script(config["replay"])
    if "model" in config:
        check_model_name(config["model"])
