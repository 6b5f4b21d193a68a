"""YUXI_PROVIDERS parsing, model ids of configured providers, the models
list, replay streaming, NOTIFY payload limits of deltas, error
classification of model calls."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import HumanMessage

from yuxi.runtime import models
from yuxi.runtime.calls import classify
from yuxi.runtime.live import delta_payloads
from yuxi.runtime.providers import ProviderConfigError, load_providers, reload_providers
from yuxi.runtime.replay import ReplayChatModel, ReplayScriptError

CONFIG = {"vllm": {"base_url": "http://127.0.0.1:8001/v1", "api_key_env": "VLLM_KEY",
                   "models": ["Qwen/Qwen2.5-7B-Instruct"], "params": {"temperature": 0}},
          "deepseek": {"base_url": "https://api.deepseek.com", "api_key_env": "DS_KEY",
                       "models": ["deepseek-chat"]}}


@pytest.fixture
def configured(monkeypatch):
    monkeypatch.setenv("YUXI_PROVIDERS", json.dumps(CONFIG))
    reload_providers()
    yield
    monkeypatch.delenv("YUXI_PROVIDERS")
    reload_providers()


def test_load_from_text_and_file(tmp_path):
    assert set(load_providers(json.dumps(CONFIG))) == {"vllm", "deepseek"}
    path = tmp_path / "providers.json"
    path.write_text(json.dumps(CONFIG))
    loaded = load_providers(f"@{path}")
    assert loaded["vllm"].models == ("Qwen/Qwen2.5-7B-Instruct",)
    assert loaded["vllm"].params == {"temperature": 0}
    assert load_providers(None) == {} and load_providers("  ") == {}


@pytest.mark.parametrize(("text", "message"), [
    ("{", "invalid JSON"),
    ("[]", "expected an object"),
    ('{"replay": {"base_url": "x", "api_key_env": "K", "models": ["m"]}}', "invalid provider"),
    ('{"a/b": {"base_url": "x", "api_key_env": "K", "models": ["m"]}}', "invalid provider"),
    ('{"p": {"api_key_env": "K", "models": ["m"]}}', "base_url"),
    ('{"p": {"base_url": "x", "models": ["m"]}}', "api_key_env"),
    ('{"p": {"base_url": "x", "api_key_env": "K", "models": []}}', "models"),
    ('{"p": {"base_url": "x", "api_key_env": "K", "models": ["m"], "key": "sk"}}',
     "unknown key 'key'"),
    ("@/nonexistent/providers.json", "cannot read"),
])
def test_bad_config_is_refused(text, message):
    with pytest.raises(ProviderConfigError, match=message):
        load_providers(text)


def test_model_ids_split_at_the_first_slash(configured):
    assert models.check_model_name("vllm/Qwen/Qwen2.5-7B-Instruct") == \
        "vllm/Qwen/Qwen2.5-7B-Instruct"
    assert models.check_model_name(" deepseek/deepseek-chat ") == "deepseek/deepseek-chat"
    for bad in ("vllm/Qwen", "vllm", "deepseek/other", "openai/gpt-4o", "Qwen/Qwen2.5-7B-Instruct"):
        with pytest.raises(models.UnknownModelError, match="deepseek/deepseek-chat"):
            models.check_model_name(bad)


def test_without_providers_only_replay(monkeypatch):
    monkeypatch.delenv("YUXI_PROVIDERS", raising=False)
    reload_providers()
    assert models.list_models() == [{"id": "replay", "provider": "replay"}]
    with pytest.raises(models.UnknownModelError):
        models.check_model_name("vllm/Qwen/Qwen2.5-7B-Instruct")


def test_models_list(configured):
    assert models.list_models() == [
        {"id": "replay", "provider": "replay"},
        {"id": "vllm/Qwen/Qwen2.5-7B-Instruct", "provider": "vllm"},
        {"id": "deepseek/deepseek-chat", "provider": "deepseek"}]


def test_key_is_read_at_build_time_and_never_shown(configured, monkeypatch):
    monkeypatch.delenv("DS_KEY", raising=False)
    from yuxi.runtime.calls import ProviderError
    with pytest.raises(ProviderError, match="DS_KEY is not set"):
        models.build_chat_model("deepseek/deepseek-chat", {}, approval_mode="auto", session={})
    monkeypatch.setenv("DS_KEY", "sk-very-secret")
    chat = models.build_chat_model("deepseek/deepseek-chat", {}, approval_mode="auto",
                                   session={}, timeout=5)
    assert chat.model_name == "deepseek-chat" and chat.streaming and chat.max_retries == 0
    assert "sk-very-secret" not in repr(chat) and "sk-very-secret" not in str(chat.model_dump())


def test_a_process_builds_one_client_model_per_key(configured, monkeypatch):
    """Runs share a built ChatOpenAI (~1.4 ms each to build); a rotated key
    or another timeout gets its own, never the old key's."""
    def build(timeout=5):
        return models.build_chat_model("vllm/Qwen/Qwen2.5-7B-Instruct", {},
                                       approval_mode="auto", session={}, timeout=timeout)

    monkeypatch.setenv("VLLM_KEY", "sk-one")
    first = build()
    assert build() is first and first.temperature == 0
    assert build(timeout=9) is not first and build(timeout=9).request_timeout == 9
    monkeypatch.setenv("VLLM_KEY", "sk-two")
    rotated = build()
    assert rotated is not first
    assert rotated.openai_api_key.get_secret_value() == "sk-two"
    assert first.openai_api_key.get_secret_value() == "sk-one"


async def test_replay_stream_step_yields_chunks():
    model = ReplayChatModel(script={"default": [
        {"say": "one two three", "stream": True, "chunk_delay_ms": 1}]})
    chunks = [c async for c in model.astream([HumanMessage("hi")])]
    assert [c.content for c in chunks if c.content] == ["one ", "two ", "three"]
    assert len({c.id for c in chunks if c.content}) == 1
    # A step that does not stream is one chunk (no deltas).
    model = ReplayChatModel(script={"default": [{"say": "whole"}]})
    chunks = [c async for c in model.astream([HumanMessage("hi")])]
    assert [c.content for c in chunks if c.content] == ["whole"]
    assert chunks[0].response_metadata["no_delta"] is True


def test_replay_stream_validation():
    with pytest.raises(ReplayScriptError, match="stream: expected true or false"):
        ReplayChatModel(script={"default": [{"say": "x", "stream": "yes"}]})
    with pytest.raises(ReplayScriptError, match="only a 'say' step streams"):
        ReplayChatModel(script={"default": [{"call": [{"tool": "echo"}], "stream": True}]})
    with pytest.raises(ReplayScriptError, match="chunk_delay_ms"):
        ReplayChatModel(script={"default": [{"say": "x", "stream": True,
                                             "chunk_delay_ms": -1}]})


def test_delta_payloads_stay_under_8000_bytes():
    ids = {"tree_id": "t" * 36, "session_id": "s" * 36, "turn_id": "u" * 36, "run_id": "r" * 36}
    for text in ("\u0001" * 5000, "字" * 5000, "a" * 20000):
        payloads = delta_payloads(ids, "m" * 60, text)
        assert all(len(p.encode()) < 8000 for p in payloads)
        assert "".join(json.loads(p)["delta"] for p in payloads) == text


class _Status(Exception):
    def __init__(self, status):
        self.status_code = status


@pytest.mark.parametrize(("status", "transient"), [
    (429, True), (500, True), (502, True), (503, True), (408, True),
    (400, False), (401, False), (403, False), (404, False), (422, False)])
def test_classification(status, transient):
    assert classify(_Status(status)) == (transient, status)
    assert classify(TimeoutError()) == (True, None)
    assert classify(ValueError("a bug of ours")) == (False, None)


def test_every_offered_tool_has_a_precise_schema():
    from yuxi.runtime import cooperation, questions, sandbox_tools  # noqa: F401
    from yuxi.runtime.tools import BUILTIN_TOOLS, tool_spec

    expected = {"echo", "add_note", "search_notes", "ask_user", "read_file", "write_file",
                "list_files", "run_command", *cooperation.COOPERATION_TOOLS}
    assert set(BUILTIN_TOOLS) == expected and len(cooperation.COOPERATION_TOOLS) == 8
    for name, tool in BUILTIN_TOOLS.items():
        spec = tool_spec(name, tool)["function"]
        assert spec["name"] == name and spec["description"] and spec["description"] != name
        params = spec["parameters"]
        assert params["type"] == "object" and params["additionalProperties"] is False
        assert set(params.get("required", [])) <= set(params["properties"]), name
        if name not in ("list_sessions", "get_result", "list_files"):
            assert params.get("required"), name  # every tool with arguments names them


def test_a_bad_setting_stops_the_process(monkeypatch):
    from yuxi.runtime.providers import check_configured

    monkeypatch.setenv("YUXI_PROVIDERS", '{"p": {"base_url": "x"}}')
    from yuxi.runtime import providers
    providers.configured_providers.cache_clear()
    with pytest.raises(SystemExit, match="invalid setting: YUXI_PROVIDERS.p.api_key_env"):
        check_configured()
    monkeypatch.delenv("YUXI_PROVIDERS")
    providers.configured_providers.cache_clear()
    assert check_configured() == {}
