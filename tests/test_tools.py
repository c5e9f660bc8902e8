"""Tools (OpenAI's `tools` / `tool_choice`) on a tiny Qwen2 whose chat template takes tools
in the Hermes format (as Qwen2.5's does): the template renders them, `required` and a named
function are enforced by the grammar so the reply is a call whose arguments follow the
tool's schema, calls come back as `tool_calls` through the Python API and the official
OpenAI client (streamed and not), an earlier call and its result render into the next
turn; the demo target, whose template takes no tools, is a 400 that says so."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import gguf_files
import jsonschema
import openai
import pytest
from test_faults import Proc

from memspec import Runtime
from memspec.common.errors import MemspecError, RequestError
from memspec.common.toolcalls import call_schema, check_template, parse_calls, parse_tools
from memspec.launch.openai_api import ApiError, parse_chat, response
from memspec.zoo import target

HERMES = """{%- if tools %}<|im_start|>system
You may call these tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>
{"name": <name>, "arguments": <arguments>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "maximum": 999}, "b": {"type": "integer", "maximum": 999}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tools")
    gguf_files.write_tiny(root / "tiny.gguf", "qwen2", seed=3, template=HERMES)
    folder = target.convert_target(root / "tiny", gguf=root / "tiny.gguf", progress=False)
    toml = root / "pool.toml"
    toml.write_text(f'[pool]\ntarget = "{folder}"\npolicy = "lookup-only"\n'
                    'max_new_tokens = 96\n')
    return toml


def _args(schema: dict, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), schema["function"]["parameters"])


def test_required_and_named_calls_follow_the_schema_through_the_python_api(pool):
    with Runtime(pool=str(pool)) as rt:
        plain = rt.generate(ASK, max_new_tokens=8)
        none = rt.generate(ASK, max_new_tokens=8, tools=TOOLS, tool_choice="none")
        assert none.tool_calls is None and none.token_ids == plain.token_ids
        any_call = rt.generate(ASK, tools=TOOLS, tool_choice="required")
        assert any_call.finish_reason == "tool_calls" and len(any_call.tool_calls) == 1
        call = any_call.tool_calls[0]
        _args({"add": ADD, "get_weather": WEATHER}[call.name], call.arguments)
        # the tools were rendered into the prompt by the template
        assert any_call.stats.prompt_tokens > plain.stats.prompt_tokens + 40
        named = rt.generate(ASK, tools=TOOLS, tool_choice="get_weather")
        assert [c.name for c in named.tool_calls] == ["get_weather"]
        _args(WEATHER, named.tool_calls[0].arguments)
        again = rt.generate(ASK, tools=TOOLS, tool_choice="get_weather", policy="target-only")
        assert again.token_ids == named.token_ids  # the lookup changed no token
        # the call and its result, rendered into the next turn
        turns = [*ASK, {"role": "assistant", "content": "", "tool_calls": json.dumps([{
            "id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": named.tool_calls[0].arguments}}])},
                 {"role": "tool", "content": "18 degrees"}]
        follow = rt.generate(turns, tools=TOOLS, max_new_tokens=4)
        assert follow.stats.prompt_tokens > any_call.stats.prompt_tokens
        auto = rt.generate(ASK, tools=TOOLS, max_new_tokens=24)  # random weights: text
        assert auto.finish_reason in ("stop", "length", "tool_calls")
        with pytest.raises(RequestError):
            rt.generate(ASK, tools=TOOLS, tool_choice="fly")


def test_the_official_client_round_trips_tools_streamed_and_not(pool, tmp_path):
    up = Proc("up", "--pool", str(pool), "--endpoint", f"ipc://{tmp_path}/t.sock",
              "--no-stdin", "--http", "127.0.0.1:0")
    try:
        up.wait_for(lambda: b"ready on" in up.err and b"HTTP on" in up.err, 300, "no server")
        url = re.search(rb"HTTP on (http://\S+)/v1", up.err).group(1).decode()
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        kw = {"model": "tiny", "messages": ASK, "tools": TOOLS,
              "tool_choice": {"type": "function", "function": {"name": "add"}}}
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
        assert msg.tool_calls[0].function.name == "add" and msg.tool_calls[0].id
        _args(ADD, msg.tool_calls[0].function.arguments)
        chunks = list(client.chat.completions.create(**kw, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [t for d in deltas for t in (d.tool_calls or [])]
        assert [(t.function.name, t.function.arguments) for t in calls] == [
            ("add", msg.tool_calls[0].function.arguments)]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # the assistant's call and the tool's answer go back in, as a client sends them
        follow = client.chat.completions.create(
            model="tiny", max_tokens=8, tools=TOOLS, messages=[
                *ASK, msg.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "42"}])
        assert follow.usage.prompt_tokens > r.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                           tool_choice={"type": "function",
                                                        "function": {"name": "nope"}})
    finally:
        up.stopped_within(signal.SIGINT, 30)


def test_a_template_without_tools_is_one_clear_line():
    with pytest.raises(RequestError) as e:
        check_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert "takes no tools" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(RequestError) as e:
        check_template("{{ tools }}<function_call>")
    assert "format" in str(e.value)
    check_template(HERMES)


def test_calls_parse_back_and_schemas_name_the_tools():
    content, calls = parse_calls('Let me check. <tool_call>\n{"name": "add", "arguments": '
                                 '{"a": 1, "b": 2}}\n</tool_call> <tool_call>{bad}</tool_call>')
    assert content == "Let me check.  <tool_call>{bad}</tool_call>"
    assert [(n, json.loads(a)) for _, n, a in calls] == [("add", {"a": 1, "b": 2})]
    assert call_schema(TOOLS, "function:add")["properties"]["name"] == {"const": "add"}
    assert len(call_schema(TOOLS, "required")["anyOf"]) == 2
    with pytest.raises(RequestError):
        call_schema(TOOLS, "function:nope")
    for bad in ("{", "[]", json.dumps([{"type": "function", "function": {}}]),
                json.dumps([WEATHER, WEATHER])):
        with pytest.raises(RequestError):
            parse_tools(bad)


def test_openai_tool_fields_reach_the_submit_and_the_reply():
    from memspec.common.messages import Done, ToolCall
    from memspec.common.metrics import RunStats

    body = json.dumps({"model": "m", "messages": ASK, "tools": TOOLS,
                       "tool_choice": "required"}).encode()
    call = parse_chat(body)
    assert call.submit.tool_choice == "required" and json.loads(call.submit.tools) == TOOLS
    named = {"type": "function", "function": {"name": "add"}}
    assert parse_chat(json.dumps({"model": "m", "messages": ASK, "tools": TOOLS,
                                  "tool_choice": named}).encode()
                      ).submit.tool_choice == "function:add"
    for bad in ({"tool_choice": "required"}, {"tools": [{"type": "retrieval",
                                                         "function": {"name": "x"}}]}):
        with pytest.raises(ApiError):
            parse_chat(json.dumps({"model": "m", "messages": ASK, **bad}).encode())
    done = Done(req_id="r", text="", token_ids=[1], stats=RunStats().report(),
                finish_reason="tool_calls", tool_calls=[ToolCall("c", "add", '{"a": 1}')])
    msg = response(call, done)["choices"][0]["message"]
    assert msg["content"] is None and msg["tool_calls"] == [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    with pytest.raises(MemspecError):  # noqa: PT012 - the check is in the limits
        from memspec.common.limits import check_request
        from memspec.common.messages import ChatTurn, Submit
        check_request(Submit(req_id="r", prompt="", messages=[
            ChatTurn("user", "x", tool_calls="[1]")]))
