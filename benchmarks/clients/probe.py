"""Drives one third-party client library against a running server, case by case; prints
one JSON line per case: {"lib", "version", "case", "result", "error"}.

Run it with the python of a venv that holds that library alone (setup_venvs.sh makes
them; run_probe.py runs every venv):
    VENV/bin/python benchmarks/clients/probe.py --lib openai --base-url URL --model NAME

A case is judged on the protocol, not on the model: "pass" (the request was taken and the
library read the answer), "model" (the library read the answer but rejected its content:
a 135M model's weak JSON, an agent that ran out of turns), "fail" (an HTTP error, or an
answer the library could not read).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any, Literal

import pydantic

Case = Callable[[str, str], None]
CASES: dict[str, dict[str, Case]] = {}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = "What is the weather in Paris?"
# NOTE: errors a library raises about the content of a well-formed answer
MODEL_ERRORS = (
    "UsageLimitExceeded",
    "UnexpectedModelBehavior",
    "InstructorRetryException",
    "MaxTurnsExceeded",
    "ValidationError",
    "OutputParserException",
    "IncompleteOutputException",
    "ModelBehaviorError",
    "OutOfTokens",
)


class OutOfTokens(Exception):
    """A well-formed answer the model cut short at max_tokens."""


class City(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]
    days: int = pydantic.Field(ge=1, le=7)


def case(lib: str) -> Callable[[Case], Case]:
    def register(fn: Case) -> Case:
        CASES.setdefault(lib, {})[fn.__name__] = fn
        return fn

    return register


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}, 24 C"


# --- openai -----------------------------------------------------------------------------


def _openai(base: str) -> Any:
    import openai

    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)


@case("openai")
def chat(base: str, model: str) -> None:
    out = _openai(base).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=16
    )
    assert out.choices[0].message.content is not None


@case("openai")
def chat_stream_usage(base: str, model: str) -> None:
    chunks = list(
        _openai(base).chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


@case("openai")
def chat_logprobs(base: str, model: str) -> None:
    out = _openai(base).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
    )
    assert len(out.choices[0].logprobs.content[0].top_logprobs) == 3


def _tool_loop(base: str, model: str, dump: bool) -> None:
    client = _openai(base)
    messages: list[Any] = [{"role": "user", "content": ASK}]
    first = client.chat.completions.create(
        model=model, messages=messages, tools=[TOOL], tool_choice="required", max_tokens=48
    )
    message = first.choices[0].message
    assert message.tool_calls, message
    messages.append(message.model_dump() if dump else message)
    for call in message.tool_calls:
        args = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": get_weather(**args)})
    client.chat.completions.create(model=model, messages=messages, tools=[TOOL], max_tokens=24)


@case("openai")
def tool_loop_message(base: str, model: str) -> None:
    _tool_loop(base, model, dump=False)


@case("openai")
def tool_loop_model_dump(base: str, model: str) -> None:
    _tool_loop(base, model, dump=True)


@case("openai")
def named_tool_choice_stop(base: str, model: str) -> None:
    out = _openai(base).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": ASK}],
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=48,
    )
    assert out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop", out.choices[0].finish_reason


@case("openai")
def parse_pydantic(base: str, model: str) -> None:
    client = _openai(base)
    completions = client.chat.completions
    parse = getattr(completions, "parse", None) or client.beta.chat.completions.parse
    out = parse(
        model=model,
        messages=[{"role": "user", "content": "Weather trip?"}],
        response_format=City,
        max_tokens=48,
    )
    assert isinstance(out.choices[0].message.parsed, City)


@case("openai")
def standard_fields(base: str, model: str) -> None:
    # NOTE: in extra_body, so that an SDK that predates a field sends it all the same
    fields = {
        "metadata": {"app": "probe"},
        "store": False,
        "user": "u-1",
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "verbosity": "low",
        "reasoning_effort": "low",
        "modalities": ["text"],
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    }
    stream = _openai(base).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        stream=True,
        extra_body=fields,
    )
    assert list(stream)


@case("openai")
def completions_echo_logprobs(base: str, model: str) -> None:
    out = _openai(base).completions.create(
        model=model, prompt="The capital of France is", max_tokens=0, echo=True, logprobs=1
    )
    assert out.choices[0].logprobs.token_logprobs[0] is None


@case("openai")
def responses_create(base: str, model: str) -> None:
    out = _openai(base).responses.create(model=model, input="Hi", max_output_tokens=16)
    assert out.output_text is not None and out.usage.output_tokens > 0


@case("openai")
def responses_stream(base: str, model: str) -> None:
    client = _openai(base)
    events = list(
        client.responses.create(model=model, input="Hi", max_output_tokens=16, stream=True)
    )
    assert events[-1].type in ("response.completed", "response.incomplete")
    with client.responses.stream(model=model, input="Hi", max_output_tokens=16) as stream:
        for _ in stream:
            pass


@case("openai")
def responses_tools(base: str, model: str) -> None:
    client = _openai(base)
    tool = {"type": "function", **TOOL["function"]}
    first = client.responses.create(
        model=model,
        input=ASK,
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=48,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls
    outputs = [
        {
            "type": "function_call_output",
            "call_id": c.call_id,
            "output": get_weather(**json.loads(c.arguments)),
        }
        for c in calls
    ]
    client.responses.create(
        model=model,
        previous_response_id=first.id,
        input=outputs,
        tools=[tool],
        max_output_tokens=24,
    )


# --- instructor ---------------------------------------------------------------------------


def _instructor(base: str, mode_name: str) -> Any:
    import instructor

    return instructor.from_openai(_openai(base), mode=getattr(instructor.Mode, mode_name))


def _instructed(base: str, model: str, mode: str) -> None:
    out = _instructor(base, mode).chat.completions.create(
        model=model,
        response_model=City,
        messages=[{"role": "user", "content": "Plan a weather trip."}],
        max_tokens=64,
        max_retries=1,
    )
    assert isinstance(out, City)


@case("instructor")
def instructor_tools(base: str, model: str) -> None:
    _instructed(base, model, "TOOLS")


@case("instructor")
def instructor_json(base: str, model: str) -> None:
    _instructed(base, model, "JSON")


@case("instructor")
def instructor_json_schema(base: str, model: str) -> None:
    _instructed(base, model, "JSON_SCHEMA")


@case("instructor")
def instructor_responses_tools(base: str, model: str) -> None:
    import instructor

    client = instructor.from_openai(_openai(base), mode=instructor.Mode.RESPONSES_TOOLS)
    out = client.responses.create(
        model=model,
        response_model=City,
        input="Plan a weather trip.",
        max_output_tokens=64,
        max_retries=1,
    )
    assert isinstance(out, City)


# --- langchain-openai ---------------------------------------------------------------------


def _chat_model(base: str, model: str, **kwargs: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=model, base_url=base, api_key="unused", max_tokens=48, max_retries=0, **kwargs
    )


@case("langchain-openai")
def langchain_invoke(base: str, model: str) -> None:
    assert isinstance(_chat_model(base, model).invoke("Hi").content, str)


@case("langchain-openai")
def langchain_stream(base: str, model: str) -> None:
    assert list(_chat_model(base, model).stream("Hi"))


@case("langchain-openai")
def langchain_tool_loop(base: str, model: str) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = _chat_model(base, model).bind_tools([TOOL], tool_choice="required")
    messages: list[Any] = [HumanMessage(ASK)]
    ai = llm.invoke(messages)
    assert ai.tool_calls, ai
    messages.append(ai)
    for call in ai.tool_calls:
        messages.append(ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"]))
    _chat_model(base, model).bind_tools([TOOL]).invoke(messages)


@case("langchain-openai")
def langchain_structured_json_schema(base: str, model: str) -> None:
    out = _chat_model(base, model).with_structured_output(City, method="json_schema")
    assert isinstance(out.invoke("Plan a weather trip."), City)


@case("langchain-openai")
def langchain_structured_function_calling(base: str, model: str) -> None:
    chain = _chat_model(base, model).with_structured_output(
        City, method="function_calling", include_raw=True
    )
    out = chain.invoke("Plan a weather trip.")
    if out["parsed"] is None and out["raw"].response_metadata.get("finish_reason") == "length":
        raise OutOfTokens("the forced call's arguments (extra keys allowed) ran past max_tokens")
    assert isinstance(out["parsed"], City), out


@case("langchain-openai")
def langchain_responses_api(base: str, model: str) -> None:
    out = _chat_model(base, model, use_responses_api=True).invoke("Hi")
    assert out.content is not None


# --- pydantic-ai ---------------------------------------------------------------------------


def _agent(base: str, model: str, responses: bool, **kwargs: Any) -> Any:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=base, api_key="unused")
    kind = OpenAIResponsesModel if responses else OpenAIChatModel
    settings = {"max_tokens": 48, "temperature": 0.0}
    return Agent(kind(model, provider=provider), model_settings=settings, **kwargs)


def _run(agent: Any, prompt: str) -> Any:
    from pydantic_ai.usage import UsageLimits

    return agent.run_sync(prompt, usage_limits=UsageLimits(request_limit=4)).output


@case("pydantic-ai")
def pydantic_ai_chat(base: str, model: str) -> None:
    assert isinstance(_run(_agent(base, model, False), "Hi"), str)


@case("pydantic-ai")
def pydantic_ai_output_type(base: str, model: str) -> None:
    assert isinstance(_run(_agent(base, model, False, output_type=City), "Plan a trip."), City)


@case("pydantic-ai")
def pydantic_ai_tool(base: str, model: str) -> None:
    agent = _agent(base, model, False, tools=[get_weather])
    assert isinstance(_run(agent, ASK), str)


@case("pydantic-ai")
def pydantic_ai_responses(base: str, model: str) -> None:
    assert isinstance(_run(_agent(base, model, True), "Hi"), str)


# --- openai-agents ------------------------------------------------------------------------


def _agents_run(base: str, model: str, responses: bool, tools: bool) -> None:
    import openai
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)
    kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    agent = Agent(
        name="probe",
        instructions="Answer briefly.",
        model=kind(model=model, openai_client=client),
        model_settings=ModelSettings(max_tokens=48, temperature=0.0),
        tools=[function_tool(get_weather)] if tools else [],
    )
    result = Runner.run_sync(agent, ASK if tools else "Hi", max_turns=4)
    assert result.final_output is not None


@case("openai-agents")
def agents_responses(base: str, model: str) -> None:
    _agents_run(base, model, responses=True, tools=False)


@case("openai-agents")
def agents_responses_tool(base: str, model: str) -> None:
    _agents_run(base, model, responses=True, tools=True)


@case("openai-agents")
def agents_chat_completions(base: str, model: str) -> None:
    _agents_run(base, model, responses=False, tools=False)


@case("openai-agents")
def agents_chat_completions_tool(base: str, model: str) -> None:
    _agents_run(base, model, responses=False, tools=True)


# --- litellm ----------------------------------------------------------------------------------


def _litellm_args(base: str, model: str) -> dict[str, Any]:
    return {"model": f"openai/{model}", "api_base": base, "api_key": "unused"}


@case("litellm")
def litellm_completion(base: str, model: str) -> None:
    import litellm

    out = litellm.completion(
        messages=[{"role": "user", "content": "Hi"}], max_tokens=16, **_litellm_args(base, model)
    )
    assert out.choices[0].message.content is not None


@case("litellm")
def litellm_stream(base: str, model: str) -> None:
    import litellm

    chunks = litellm.completion(
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=16,
        stream=True,
        **_litellm_args(base, model),
    )
    assert list(chunks)


@case("litellm")
def litellm_tools(base: str, model: str) -> None:
    import litellm

    out = litellm.completion(
        messages=[{"role": "user", "content": ASK}],
        tools=[TOOL],
        tool_choice="required",
        max_tokens=48,
        **_litellm_args(base, model),
    )
    assert out.choices[0].message.tool_calls


@case("litellm")
def litellm_responses(base: str, model: str) -> None:
    import litellm

    out = litellm.responses(input="Hi", max_output_tokens=16, **_litellm_args(base, model))
    assert out.output


# --- inspect-ai ---------------------------------------------------------------------------


def _inspect(base: str, model: str, tools: bool) -> None:
    import os

    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.scorer import includes
    from inspect_ai.solver import generate, use_tools
    from inspect_ai.tool import tool

    @tool
    def weather() -> Any:
        async def execute(city: str) -> str:
            """The weather in a city.

            Args:
                city: The city.
            """
            return get_weather(city)

        return execute

    os.environ["PROBE_API_KEY"] = "unused"
    os.environ["PROBE_BASE_URL"] = base
    solver = [use_tools(weather()), generate()] if tools else [generate()]
    task = Task(dataset=[Sample(input=ASK, target="sunny")], solver=solver, scorer=includes())
    (log,) = eval(
        task,
        model=f"openai-api/probe/{model}",
        max_tokens=48,
        display="none",
        log_dir="/tmp/probe-inspect-logs",
        message_limit=6,
    )
    assert log.status == "success", log.error


@case("inspect-ai")
def inspect_generate(base: str, model: str) -> None:
    _inspect(base, model, tools=False)


@case("inspect-ai")
def inspect_tools(base: str, model: str) -> None:
    _inspect(base, model, tools=True)


LIBRARIES = {
    "openai": "openai",
    "instructor": "instructor",
    "langchain-openai": "langchain-openai",
    "pydantic-ai": "pydantic-ai-slim",
    "openai-agents": "openai-agents",
    "litellm": "litellm",
    "inspect-ai": "inspect-ai",
}


def _verdict(error: BaseException) -> str:
    names = {type(e).__name__ for e in (error, error.__cause__, error.__context__) if e}
    return "model" if names & set(MODEL_ERRORS) else "fail"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", required=True, choices=sorted(CASES))
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--only", nargs="*", help="these cases only")
    parser.add_argument("--skip", nargs="*", default=[], help="not these cases")
    args = parser.parse_args()
    version = importlib.metadata.version(LIBRARIES[args.lib])
    for name, fn in CASES[args.lib].items():
        if (args.only and name not in args.only) or name in args.skip:
            continue
        row = {"lib": args.lib, "version": version, "case": name, "result": "pass", "error": ""}
        try:
            fn(args.base_url, args.model)
        except BaseException as e:  # noqa: BLE001 (a case's failure is its result)
            if isinstance(e, KeyboardInterrupt):
                raise
            row["result"] = _verdict(e)
            last = traceback.format_exception_only(type(e), e)[-1].strip()
            row["error"] = last[:300]
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
