"""The deterministic ``replay`` chat model.

Tests, demos and benchmarks need an agent that behaves like an LLM (answers,
calls tools, takes time) without a network or randomness. ``ReplayChatModel``
answers from a small script, and derives its position in that script only from
the messages it is given. Those messages come from checkpointed state, so a
turn that is interrupted and re-executed replays exactly the same replies, with
the same ids.

Script shape::

    {"rules": [{"match": "<regex>", "steps": [STEP, ...]}, ...],
     "default": [STEP, ...]}

    STEP = {"say": "<template>"} | {"call": [{"tool": "<name>", "args": {...}}]}
           plus an optional "delay_ms": N (before the answer), and for a "say"
           step "stream": true with "chunk_delay_ms": N (the text streams
           word by word, N ms apart)

Every string of a step is a Jinja2 template (see ``_Turn.variables``).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.sandbox import SandboxedEnvironment
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import (AIMessage, AIMessageChunk, BaseMessage, HumanMessage,
                                     ToolMessage)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import Field

__all__ = [
    "ReplayChatModel",
    "ReplayScriptError",
    "ReplayTemplateError",
    "validate_script",
]

_FALLBACK_STEP: dict[str, Any] = {"say": ""}
_STEP_KEYS = {"say", "call", "delay_ms", "stream", "chunk_delay_ms"}


class ReplayScriptError(ValueError):
    """The replay script is malformed; the message names the offending path."""


class ReplayTemplateError(ValueError):
    """A template of the replay script failed to parse or render."""


# --------------------------------------------------------------------------
# Script validation: fail at construction rather than in the middle of a turn.


def validate_script(script: Any) -> None:
    """Raise ``ReplayScriptError`` unless ``script`` has the documented shape."""
    if not isinstance(script, dict):
        raise ReplayScriptError(f"script: expected an object, got {_kind(script)}")
    _no_unknown_keys(script, {"rules", "default"}, "script")
    rules = script.get("rules", [])
    if not isinstance(rules, list):
        raise ReplayScriptError(f"rules: expected a list, got {_kind(rules)}")
    for i, rule in enumerate(rules):
        path = f"rules[{i}]"
        if not isinstance(rule, dict):
            raise ReplayScriptError(f"{path}: expected an object, got {_kind(rule)}")
        _no_unknown_keys(rule, {"match", "steps"}, path)
        pattern = rule.get("match")
        if not isinstance(pattern, str):
            raise ReplayScriptError(f"{path}.match: expected a string regex")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ReplayScriptError(f"{path}.match: invalid regex: {exc}") from exc
        _check_steps(rule.get("steps"), f"{path}.steps")
    if "default" in script:
        _check_steps(script["default"], "default")


def _check_steps(steps: Any, path: str) -> None:
    if not isinstance(steps, list) or not steps:
        raise ReplayScriptError(f"{path}: expected a non-empty list of steps")
    for i, step in enumerate(steps):
        _check_step(step, f"{path}[{i}]")


def _check_step(step: Any, path: str) -> None:
    if not isinstance(step, dict):
        raise ReplayScriptError(f"{path}: expected an object, got {_kind(step)}")
    _no_unknown_keys(step, _STEP_KEYS, path)
    if ("say" in step) == ("call" in step):
        raise ReplayScriptError(f"{path}: needs exactly one of 'say' or 'call'")
    for key in ("delay_ms", "chunk_delay_ms"):
        delay = step.get(key, 0)
        # bool is an int subclass, but `"delay_ms": true` is certainly a mistake.
        if not isinstance(delay, int) or isinstance(delay, bool) or delay < 0:
            raise ReplayScriptError(f"{path}.{key}: expected a non-negative integer")
    if not isinstance(step.get("stream", False), bool):
        raise ReplayScriptError(f"{path}.stream: expected true or false")
    if ("stream" in step or "chunk_delay_ms" in step) and "say" not in step:
        raise ReplayScriptError(f"{path}: only a 'say' step streams")
    if "say" in step:
        if not isinstance(step["say"], str):
            raise ReplayScriptError(f"{path}.say: expected a string")
        return
    calls = step["call"]
    if not isinstance(calls, list) or not calls:
        raise ReplayScriptError(f"{path}.call: expected a non-empty list of calls")
    for i, call in enumerate(calls):
        call_path = f"{path}.call[{i}]"
        if not isinstance(call, dict):
            raise ReplayScriptError(f"{call_path}: expected an object")
        _no_unknown_keys(call, {"tool", "args"}, call_path)
        if not isinstance(call.get("tool"), str) or not call["tool"]:
            raise ReplayScriptError(f"{call_path}.tool: expected a non-empty string")
        if not isinstance(call.get("args", {}), dict):
            raise ReplayScriptError(f"{call_path}.args: expected an object")


def _no_unknown_keys(obj: dict, allowed: set[str], path: str) -> None:
    # Sorted so the message is stable whatever the dict order.
    unknown = sorted(set(obj) - allowed, key=str)
    if unknown:
        raise ReplayScriptError(f"{path}: unknown key {unknown[0]!r}")


def _kind(value: Any) -> str:
    return type(value).__name__


# --------------------------------------------------------------------------
# Reading the turn out of the message list.


@dataclass(frozen=True)
class _Turn:
    """The current turn as seen in the messages: where it starts and what it holds."""

    messages: Sequence[BaseMessage]  # from the turn-start HumanMessage on
    key: str  # short hash naming the turn in message and tool call ids

    @classmethod
    def find(cls, messages: Sequence[BaseMessage]) -> _Turn:
        humans = [i for i, m in enumerate(messages) if isinstance(m, HumanMessage)]
        if not humans:
            raise ValueError("replay model: the messages contain no HumanMessage")
        marked = [i for i in humans if _is_turn_start(messages[i])]
        # The runtime marks the message opening each turn; unmarked input
        # (a plain conversation) is a single turn starting at the first one.
        start = marked[-1] if marked else humans[0]
        first = messages[start]
        seed = first.id if first.id else f"{first.text}\n{start}"
        key = hashlib.sha1(seed.encode()).hexdigest()[:10]
        return cls(messages=messages[start:], key=key)

    @property
    def step_index(self) -> int:
        """How many times the model already answered in this turn."""
        return sum(isinstance(m, AIMessage) for m in self.messages)

    @property
    def input(self) -> str:
        return str(self.messages[0].text)

    def variables(self, model: ReplayChatModel) -> dict[str, Any]:
        """What templates see: the turn's ``input`` (its first text), ``inputs``
        (every human text, steers included), tool ``results`` (JSON-decoded when
        possible) and the ``last`` of them, plus the ``session``, ``model`` and
        ``approval_mode`` the model was built with."""
        results = [
            _decode(str(m.text)) for m in self.messages if isinstance(m, ToolMessage)
        ]
        return {
            "input": self.input,
            "inputs": [
                str(m.text) for m in self.messages if isinstance(m, HumanMessage)
            ],
            "results": results,
            "last": results[-1] if results else None,
            "session": model.session,
            "model": model.model_name,
            "approval_mode": model.approval_mode,
        }


def _is_turn_start(message: BaseMessage) -> bool:
    return bool(message.additional_kwargs.get("yuxi", {}).get("turn_start"))


def _decode(text: str) -> Any:
    """Tool results are usually JSON; hand templates the data when they are."""
    try:
        return json.loads(text)
    except ValueError:
        return text


# --------------------------------------------------------------------------
# Template rendering.

# The sandbox keeps scripts (which may come from API users) away from Python
# internals; StrictUndefined turns typos into errors instead of empty text;
# keep_trailing_newline makes a template without markup render as itself.
_ENV = SandboxedEnvironment(
    undefined=jinja2.StrictUndefined, keep_trailing_newline=True
)


@functools.lru_cache(maxsize=1024)
def _compile(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


# A tool argument that is one whole expression, "{{ expr }}", keeps the
# expression's native value (a list of ids, a number), so scripts can pass
# earlier results on: {"input_ids": "{{ results|map(attribute='input_id')|list }}"}.
_WHOLE_EXPRESSION = re.compile(r"^\{\{(?P<expr>(?:(?!\}\}).)*)\}\}$", re.S)


@functools.lru_cache(maxsize=1024)
def _compile_expression(source: str):
    return _ENV.compile_expression(source, undefined_to_none=False)


def _render(value: Any, variables: dict[str, Any], path: str, native: bool = False) -> Any:
    """Render every string inside ``value`` (recursing into dicts and lists);
    with `native`, a whole-expression string keeps its value's type."""
    if isinstance(value, str):
        if "{" not in value:
            return value  # no markup: renders as itself (a fan-out's 128 names and tasks)
        try:
            if native and (whole := _WHOLE_EXPRESSION.match(value)):
                result = _compile_expression(whole["expr"])(**variables)
                if isinstance(result, jinja2.Undefined):
                    str(result)  # raises UndefinedError like rendering would
                return result
            return _compile(value).render(variables)
        # Any failure while rendering user-written templates (undefined names,
        # sandbox violations, a TypeError inside an expression...) is the
        # script's fault, and is reported the same way.
        except Exception as exc:
            raise ReplayTemplateError(
                f"{path}: template {value!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
    if isinstance(value, dict):
        return {k: _render(v, variables, f"{path}.{k}", native) for k, v in value.items()}
    if isinstance(value, list):
        return [_render(v, variables, f"{path}[{i}]", native) for i, v in enumerate(value)]
    return value


# --------------------------------------------------------------------------
# The model.


class ReplayChatModel(BaseChatModel):
    """A scripted, deterministic chat model (see the module docstring)."""

    script: dict = Field(default_factory=dict)
    model_name: str = "replay"
    approval_mode: str = "auto"
    session: dict = Field(default_factory=dict)

    def __init__(self, **data: Any) -> None:
        # Validated before pydantic runs so callers get ReplayScriptError
        # itself rather than a pydantic ValidationError wrapping it.
        validate_script(data.get("script", {}))
        super().__init__(**data)

    @property
    def _llm_type(self) -> str:
        return "replay"

    @functools.cached_property
    def _serialized(self) -> dict[str, Any]:
        # What LangChain hands its callbacks for this model at each call.
        # Its default, dumpd(self), writes the model out through repr, the
        # whole script included, at the first call of every model (a run
        # builds its own): a tenth of a one-step graph's own time.
        return {"lc": 1, "type": "not_implemented", "id": ["yuxi", "replay", "ReplayChatModel"],
                "repr": f"ReplayChatModel(model_name={self.model_name!r})"}

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "script": self.script}

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ReplayChatModel:
        """Return self: the script, not the tool list, decides what gets called."""
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> ChatResult:
        message, delay_ms = self._reply(messages)
        if delay_ms:
            time.sleep(delay_ms / 1000)
        return ChatResult(generations=[ChatGeneration(message=message)])

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> ChatResult:
        message, delay_ms = self._reply(messages)
        if delay_ms:
            await asyncio.sleep(delay_ms / 1000)
        return ChatResult(generations=[ChatGeneration(message=message)])

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ):
        """The answer as chunks: a streaming step's text word by word
        (`chunk_delay_ms` apart), any other step in one chunk."""
        # Through _agenerate (its delay included), so subclasses that hook
        # it (tests' gated model) see every call.
        result = await self._agenerate(messages, stop, run_manager, **kwargs)
        message = result.generations[0].message
        step = message.response_metadata.get("replay_stream")
        if step:
            pieces = re.findall(r"\S+\s*|\s+", str(message.content)) or [""]
            for i, piece in enumerate(pieces):
                if i and step["chunk_delay_ms"]:
                    await asyncio.sleep(step["chunk_delay_ms"] / 1000)
                yield ChatGenerationChunk(message=AIMessageChunk(
                    content=piece, id=message.id,
                    response_metadata=message.response_metadata if i == 0 else {}))
            return
        # A step that does not stream is one answer, with no deltas.
        yield ChatGenerationChunk(message=AIMessageChunk(
            content=message.content, id=message.id,
            response_metadata={**message.response_metadata, "no_delta": True},
            tool_call_chunks=[{"name": c["name"], "args": json.dumps(c["args"]),
                               "id": c["id"], "index": i, "type": "tool_call_chunk"}
                              for i, c in enumerate(message.tool_calls)]))

    def _reply(self, messages: Sequence[BaseMessage]) -> tuple[AIMessage, int]:
        """The answer for this point of the turn, and how long to wait before it."""
        turn = _Turn.find(messages)
        k = turn.step_index
        step, path = self._pick_step(turn.input, k)
        variables = turn.variables(self)
        content, tool_calls = "", []
        if "say" in step:
            content = _render(step["say"], variables, f"{path}.say")
        for i, call in enumerate(step.get("call", [])):
            call_path = f"{path}.call[{i}]"
            tool_calls.append({
                "name": _render(call["tool"], variables, f"{call_path}.tool"),
                "args": _render(call.get("args", {}), variables, f"{call_path}.args",
                                native=True),
                "id": f"call-{turn.key}-{k}-{i}",
                "type": "tool_call",
            })
        metadata: dict[str, Any] = {"model_name": self.model_name, "replay_step": k}
        if step.get("stream"):
            metadata["replay_stream"] = {"chunk_delay_ms": step.get("chunk_delay_ms", 0)}
        message = AIMessage(
            content=content,
            tool_calls=tool_calls,
            id=f"ai-{turn.key}-{k}",
            response_metadata=metadata,
        )
        return message, step.get("delay_ms", 0)

    def _pick_step(self, text: str, k: int) -> tuple[dict, str]:
        """Step ``k`` of the first rule matching ``text`` (else of the default),
        with its script path for error messages."""
        steps, path = self._steps_for(text)
        if k < len(steps):
            return steps[k], f"{path}[{k}]"
        # Past the script: keep repeating its final word so agent loops end.
        says = [i for i, step in enumerate(steps) if "say" in step]
        if not says:
            return _FALLBACK_STEP, "fallback"
        return steps[says[-1]], f"{path}[{says[-1]}]"

    def _steps_for(self, text: str) -> tuple[list[dict], str]:
        for i, rule in enumerate(self.script.get("rules", [])):
            if re.search(rule["match"], text):
                return rule["steps"], f"rules[{i}].steps"
        return self.script.get("default") or [_FALLBACK_STEP], "default"
