#!/usr/bin/env python3
"""Checks tool calling through the official `openai` Python package against `gdsllm serve`.

The model (SmolLM2 in CI) is served from a copy of its directory (hard links), with the chat template replaced by a tools-capable ChatML template in the Hermes
`<tool_call>` format (written below; SmolLM2's own template takes no tools). Through
`openai.OpenAI(base_url=...)`:
- a named `tool_choice` and `required` (the grammar forces the call): `finish_reason`
  `tool_calls`, the called name one of the offered, its arguments valid against the function's
  JSON schema (the `jsonschema` package);
- the same request streamed: `delta.tool_calls[i]` with `index`, `id` and `function.name`,
  then `function.arguments` fragments, joined as the SDK's users join them, equal to the
  whole reply's call;
- the round trip: the assistant's call and a `role: tool` result (with its `tool_call_id`)
  sent back, rendered into the prompt (more prompt tokens), and answered;
- `tool_choice: auto` answers with content or well-formed calls; a forced call combined with
  `response_format` and a `tool_choice` naming an unknown function are 400s naming
  `tool_choice`.
Stops the server with SIGTERM. Exits non-zero on the first failure.

Usage: scripts/openai_tools_check.py --gdsllm target/release/gdsllm --model DIR
       (DIR defaults to $GDSLLM_TEST_MODEL; --venv as scripts/openai_client_check.py)
"""

import json
import os
import shutil
import tempfile

from openai_client_check import KEY, check, check_args, serve_and_check

# ChatML with tools in the Hermes format: the offered functions as JSON in the system turn,
# calls as <tool_call> blocks, results as <tool_response> blocks in a user turn.
TOOLS_TEMPLATE = """\
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You can call functions. Each function is described by a JSON object in <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, answer with its name and arguments as a JSON object in <tool_call></tool_call>:
<tool_call>
{"name": "function name", "arguments": {"argument": "value"}}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' and message.tool_calls %}
<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{% for call in message.tool_calls %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}
<|im_end|>
{% elif message.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 40},
                           "hours24": {"type": "boolean"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def tools_model_dir(model, into):
    """`into` holding every file of `model` (hard links where the filesystem allows, copies
    otherwise: a model refuses symlinks out of its directory) and the tools template."""
    for name in os.listdir(model):
        if name != "chat_template.jinja":
            source, target = os.path.join(model, name), os.path.join(into, name)
            try:
                os.link(source, target)
            except OSError:
                shutil.copyfile(source, target)
    with open(os.path.join(into, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(TOOLS_TEMPLATE)
    return into


def schema_of(name):
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def check_call(call, names):
    """The call's name is offered and its arguments validate against that function's schema;
    returns the arguments."""
    import jsonschema

    check(call.type == "function" and call.id, f"call id {call.id!r}")
    check(call.function.name in names, f"called {call.function.name!r} (one of {names})")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema_of(call.function.name))
    check(True, f"arguments {call.function.arguments} valid against the schema")
    return arguments


def streamed_calls(client, **request):
    """Joins a streamed reply's tool-call deltas by index, as OpenAI's documentation does."""
    calls, finish, content = {}, None, ""
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.index not in calls:
                    check(tc.id and tc.function and tc.function.name,
                          f"call {tc.index} opens with its id and name")
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                if tc.function and tc.function.arguments:
                    calls[tc.index]["arguments"] += tc.function.arguments
            if choice.finish_reason:
                finish = choice.finish_reason
    return [calls[i] for i in sorted(calls)], finish, content


def run_checks(base):
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    request = dict(model="gpt-4o-mini", messages=QUESTION, tools=TOOLS, temperature=0,
                   max_tokens=100)

    named = client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, **request)
    choice = named.choices[0]
    check(choice.finish_reason == "tool_calls", f"named choice -> finish {choice.finish_reason}")
    check(len(choice.message.tool_calls) == 1, "one call")
    call = choice.message.tool_calls[0]
    check_call(call, ["get_weather"])

    required = client.chat.completions.create(tool_choice="required", **request)
    check(required.choices[0].finish_reason == "tool_calls", "required -> finish tool_calls")
    for c in required.choices[0].message.tool_calls:
        check_call(c, ["get_weather", "get_time"])

    calls, finish, content = streamed_calls(
        client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, **request)
    check(finish == "tool_calls" and content == "", f"streamed finish {finish}, content {content!r}")
    check([(c["name"], c["arguments"]) for c in calls]
          == [(call.function.name, call.function.arguments)],
          f"streamed call equals the whole reply's: {calls}")

    # The round trip: the call and its result go back; the reply reads the result.
    result = json.dumps({"city": json.loads(call.function.arguments)["city"],
                         "temperature": 21, "sky": "sunny"})
    follow = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    answer = client.chat.completions.create(
        model="gpt-4o-mini", messages=follow, tools=TOOLS, temperature=0, max_tokens=40)
    text = answer.choices[0].message.content
    check(answer.usage.prompt_tokens > named.usage.prompt_tokens + 10,
          f"the call and its result are in the prompt ({named.usage.prompt_tokens} -> "
          f"{answer.usage.prompt_tokens} prompt tokens)")
    check(answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
          and (text or answer.choices[0].message.tool_calls),
          f"follow-up answered: {text!r}")

    auto = client.chat.completions.create(tool_choice="auto", **request)
    message = auto.choices[0].message
    if message.tool_calls:
        check(auto.choices[0].finish_reason == "tool_calls", "auto made calls -> tool_calls")
        for c in message.tool_calls:
            check(c.function.name and json.loads(c.function.arguments) is not None,
                  f"auto call {c.function.name} {c.function.arguments}")
    else:
        check(isinstance(message.content, str), f"auto answered in text: {message.content!r}")

    for bad, what in [
        (dict(tool_choice="required", response_format={"type": "json_object"}),
         "a forced call with response_format"),
        (dict(tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice naming an unknown function"),
    ]:
        try:
            client.chat.completions.create(**request, **bad)
            check(False, f"{what} raises")
        except openai.BadRequestError as e:
            check("tool_choice" in str(e), f"{what} -> openai.BadRequestError ({e})")


def main():
    args = check_args()
    with tempfile.TemporaryDirectory(prefix="gdsllm-tools-") as tmp:
        serve_and_check(args.gdsllm, tools_model_dir(args.model, tmp), run_checks)
    print("all openai tool checks passed")


if __name__ == "__main__":
    main()
