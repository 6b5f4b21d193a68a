"""The provider registry accepts replay names and builds replay models."""

import pytest
from langchain_core.messages import HumanMessage

from yuxi.runtime.models import (
    PROVIDERS,
    UnknownModelError,
    build_chat_model,
    check_model_name,
    validate_agent_config,
)
from yuxi.runtime.replay import ReplayChatModel, ReplayScriptError


@pytest.mark.parametrize(
    ("name", "normalized"),
    [
        ("replay", "replay"),
        ("replay/fast", "replay/fast"),
        ("replay/Model-1.2_b", "replay/Model-1.2_b"),
        ("  replay/x  ", "replay/x"),
    ],
)
def test_accepted_names(name, normalized):
    assert check_model_name(name) == normalized


@pytest.mark.parametrize(
    "name",
    ["", "   ", "replay/", "replay/a b", "replay/a/b", "replayx", "gpt-4o",
     "openai/gpt-4o", "/replay", None, 3],
)
def test_refused_names(name):
    accepted = "accepted are 'replay' or 'replay/<name>'"
    with pytest.raises(UnknownModelError, match=accepted):
        check_model_name(name)


def test_only_replay_is_registered():
    assert set(PROVIDERS) == {"replay"}


async def test_build_replay_model_from_config():
    session = {"id": "s", "name": "n", "path": "/n", "parent_id": None, "tree_id": "t"}
    template = "{{ model }} {{ approval_mode }} {{ session.path }}"
    config = {"replay": {"default": [{"say": template}]}}
    m = build_chat_model("replay/a", config, approval_mode="manual", session=session)
    assert isinstance(m, ReplayChatModel)
    reply = await m.ainvoke([HumanMessage("hi")])
    assert reply.content == "replay/a manual /n"


def test_build_without_script_says_nothing():
    m = build_chat_model("replay", {}, approval_mode="auto", session={})
    assert m.invoke([HumanMessage("hi")]).content == ""


def test_build_refuses_unknown_model():
    with pytest.raises(UnknownModelError):
        build_chat_model("gpt-4o", {}, approval_mode="auto", session={})


def test_validate_agent_config():
    validate_agent_config({})
    validate_agent_config({"model": "replay", "replay": {"default": [{"say": "x"}]}})
    with pytest.raises(ReplayScriptError, match="default: expected a non-empty"):
        validate_agent_config({"replay": {"default": []}})
    with pytest.raises(UnknownModelError):
        validate_agent_config({"model": "nope"})
