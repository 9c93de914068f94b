"""An agent framework that speaks OpenAI, unchanged, against ``logitproc serve``: LangChain's ``ChatOpenAI`` with
``bind_tools`` runs a two-tool task (find a city, then its weather, then answer) on the tiny random model with
Qwen3's chat template. The grammar makes every call valid; LangChain's own tool schemas (pydantic) check the
arguments again before the tools run. ``langchain-openai`` is in the ``oracle`` extra (skipped without it).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterator

import material
import pytest
from server_process import KEY, ServerProcess

langchain_openai = pytest.importorskip("langchain_openai")
from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402


class CityArgs(BaseModel):
    country: str = Field(max_length=10, description="the country")


class WeatherArgs(BaseModel):
    city: str = Field(max_length=8, description="the city")
    days: int = Field(ge=1, le=7, description="how many days ahead")


@tool(args_schema=CityArgs)
def capital(country: str) -> str:
    """The capital of a country."""
    return "Paris"


@tool(args_schema=WeatherArgs)
def weather(city: str, days: int) -> str:
    """The weather forecast of a city."""
    return f"sunny in {city} for {days} days"


TOOLS = {"capital": capital, "weather": weather}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    template = material.llama_cpp_models() / "templates" / "Qwen-Qwen3-0.6B.jinja"
    proc = ServerProcess("--model", "tiny", "--chat-template", str(template))
    yield proc
    assert proc.stop() == 0


def test_langchain_runs_a_two_tool_task(server) -> None:
    llm = langchain_openai.ChatOpenAI(model="tiny-llama-s0-l2-h64", base_url=server.url + "/v1", api_key=KEY,
                                      temperature=1.0, max_tokens=120, seed=3, max_retries=0, timeout=300)
    messages = [HumanMessage("What is the weather in the capital of France?")]
    for step, name in enumerate(("capital", "weather")):
        bound = llm.bind_tools(list(TOOLS.values()), tool_choice=name)
        if step == 0:
            answer = bound.invoke(messages)
        else:  # streamed: LangChain joins the tool-call chunks itself
            answer = functools.reduce(operator.add, bound.stream(messages))
        assert [call["name"] for call in answer.tool_calls] == [name], answer
        assert answer.response_metadata.get("finish_reason") == "tool_calls"
        messages.append(answer)
        for call in answer.tool_calls:
            result = TOOLS[call["name"]].invoke(call)  # LangChain validates the arguments with its schema
            assert isinstance(result, ToolMessage) and result.status == "success", result
            messages.append(result)
    final = llm.bind_tools(list(TOOLS.values()), tool_choice="none").invoke(messages)
    assert final.tool_calls == [] and isinstance(final.content, str) and final.content
    assert final.response_metadata.get("finish_reason") in ("stop", "length")
