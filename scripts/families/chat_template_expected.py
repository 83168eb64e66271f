"""Renders real chat templates with Hugging Face transformers' own renderer (what
`apply_chat_template` calls) for a fixed set of conversations, and writes the results to
llama/tests/chat_templates/expected.json, which llama's chat template tests compare against.

usage: python3 chat_template_expected.py INPUTS_DIR   (INPUTS_DIR: what fetch_inputs.py fetched)
Needs `transformers` (no torch needed); run here, commit the JSON.
"""
import json
import sys
from pathlib import Path

from transformers.utils.chat_template_utils import render_jinja_template

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "llama/tests/chat_templates/expected.json"
# Templates committed beside the tests (not in llama.cpp's source tree).
LOCAL = ROOT / "llama/tests/chat_templates"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}

CHAT = [
    {"role": "system", "content": "You are a terse assistant. Answer in one line."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "  And 3 × 3 — in Chinese?  "},
]
TOOLS = [
    {"role": "system", "content": "You can look up the weather."},
    {"role": "user", "content": "How warm is it in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
            }
        ],
    },
    {"role": "tool", "name": "get_weather", "content": "{\"temperature\": 21, \"sky\": \"clear\"}"},
    {"role": "assistant", "content": "It is 21 °C and clear in Paris."},
    {"role": "user", "content": "Thanks!"},
]
THINK = [
    {"role": "user", "content": "Is 17 prime?"},
    {"role": "assistant", "content": "<think>\n17 has no divisor between 2 and 4.\n</think>\n\nYes, 17 is prime."},
    {"role": "user", "content": "And 21?"},
]
GEMMA_PARTS = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {"role": "user", "content": [{"type": "text", "text": " Describe a cat. "}]},
]

# (template file, bos, eos, extra variables, cases: (name, messages, tools, add_generation_prompt))
TEMPLATES = [
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", {},
     [("chat", CHAT, None, True), ("think", THINK, None, True), ("tools", TOOLS, [WEATHER_TOOL], True)]),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", None, "<|im_end|>", {},
     [("chat", CHAT, None, True), ("tools", TOOLS, [WEATHER_TOOL], True), ("no-system", THINK[:1], None, False)]),
    ("Qwen-Qwen3-0.6B.jinja", None, "<|im_end|>", {},
     [("chat", CHAT, None, True), ("tools", TOOLS, [WEATHER_TOOL], True), ("think", THINK, None, True)]),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", {"date_string": "24 Nov 2026"},
     [("chat", CHAT, None, True), ("tools", TOOLS, [WEATHER_TOOL], True)]),
    ("microsoft-Phi-3.5-mini-instruct.jinja", "<s>", "<|endoftext|>", {},
     [("chat", CHAT, None, True), ("no-prompt", CHAT[:3], None, False)]),
    ("google-gemma-3-it.jinja", "<bos>", "<eos>", {},
     [("chat", CHAT, None, True), ("parts", GEMMA_PARTS, None, True)]),
]


def main() -> None:
    inputs = Path(sys.argv[1])
    cases = []
    for file, bos, eos, extra, runs in TEMPLATES:
        path = LOCAL / file if (LOCAL / file).is_file() else inputs / "templates" / file
        template = path.read_text()
        for name, messages, tools, add_generation_prompt in runs:
            variables = dict(extra)
            if bos is not None:
                variables["bos_token"] = bos
            variables["eos_token"] = eos
            rendered, _ = render_jinja_template(
                conversations=[messages],
                tools=tools,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
            cases.append({
                "template": file,
                "case": name,
                "messages": messages,
                "tools": tools,
                "add_generation_prompt": add_generation_prompt,
                "variables": variables,
                "expected": rendered[0],
            })
            print(file, name, len(rendered[0]))
    OUT.write_text(json.dumps({"generator": "scripts/families/chat_template_expected.py",
                               "cases": cases}, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main()
