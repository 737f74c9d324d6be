"""Drives `llama-graph serve` with the official `openai` client for
tests/server_openai.rs. The Rust test starts the server, computes the
expected values with the library, runs this script and checks what it
prints: one JSON document on stdout. Nothing is asserted here.

Usage: client.py BASE_URL API_KEY COMMAND < spec.json
  basics  the endpoints, streaming, stop strings, seeds and errors
  load    many concurrent requests (spec: requests, concurrency)
  structured  response_format / json_schema / grammar requests (spec:
          schemas, each answer checked with the `jsonschema` package)
  tools   tool calls, streamed and not, and a follow-up with the results
"""

import asyncio
import json
import sys

import jsonschema
import openai


def chat_messages(spec):
    msgs = []
    if spec.get("system"):
        msgs.append({"role": "system", "content": spec["system"]})
    msgs.append({"role": "user", "content": spec["user"]})
    return msgs


def error_of(fn):
    """Status, error body and message of a call expected to fail."""
    try:
        fn()
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else None
        return {"status": e.status_code, "body": body, "kind": type(e).__name__,
                "retry_after": e.response.headers.get("retry-after")}
    return {"status": 200}


def basics(base, key, spec):
    c = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)
    out = {}
    msgs = chat_messages(spec["chat"])
    n = spec["chat"]["max_tokens"]

    r = c.chat.completions.create(model="any", messages=msgs, temperature=0, max_tokens=n)
    out["chat"] = {"content": r.choices[0].message.content, "role": r.choices[0].message.role,
                   "finish": r.choices[0].finish_reason, "usage": r.usage.model_dump(),
                   "object": r.object, "id": r.id, "model": r.model}

    pieces, finishes, usage, roles, n_chunks = [], [], None, [], 0
    stream = c.chat.completions.create(model="any", messages=msgs, temperature=0,
                                       max_completion_tokens=n, stream=True,
                                       stream_options={"include_usage": True})
    for ch in stream:
        n_chunks += 1
        if ch.usage is not None:
            usage = ch.usage.model_dump()
        for choice in ch.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    out["chat_stream"] = {"content": "".join(pieces), "finishes": finishes, "usage": usage,
                          "roles": roles, "chunks": n_chunks}

    r = c.chat.completions.create(model="any", messages=msgs, temperature=0, max_tokens=n,
                                  stop=spec["chat"]["stop"])
    out["chat_stop"] = {"content": r.choices[0].message.content,
                        "finish": r.choices[0].finish_reason, "usage": r.usage.model_dump()}
    pieces = []
    for ch in c.chat.completions.create(model="any", messages=msgs, temperature=0, max_tokens=n,
                                        stop=[spec["chat"]["stop"], "never-appears"], stream=True):
        for choice in ch.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                out["chat_stop_stream_finish"] = choice.finish_reason
    out["chat_stop_stream"] = "".join(pieces)

    t = spec["text"]
    r = c.completions.create(model="any", prompt=t["prompt"], temperature=0, max_tokens=t["max_tokens"])
    out["text"] = {"text": r.choices[0].text, "finish": r.choices[0].finish_reason,
                   "usage": r.usage.model_dump(), "object": r.object}
    pieces, finishes, usage = [], [], None
    for ch in c.completions.create(model="any", prompt=t["prompt"], temperature=0,
                                   max_tokens=t["max_tokens"], stream=True,
                                   stream_options={"include_usage": True}):
        if ch.usage is not None:
            usage = ch.usage.model_dump()
        for choice in ch.choices:
            pieces.append(choice.text)
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    out["text_stream"] = {"text": "".join(pieces), "finishes": finishes, "usage": usage}

    seeded = [c.chat.completions.create(model="any", messages=msgs, temperature=1.0, seed=42,
                                        max_tokens=n).choices[0].message.content for _ in range(2)]
    out["seeded"] = seeded

    out["models"] = [m.id for m in c.models.list().data]

    bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong-" + key, max_retries=0)
    out["wrong_key"] = error_of(lambda: bad.models.list())
    out["bad_type"] = error_of(lambda: c.chat.completions.create(
        model="any", messages=msgs, temperature="hot"))
    out["too_long"] = error_of(lambda: c.chat.completions.create(
        model="any", messages=msgs, max_tokens=spec["too_long_max_tokens"]))
    out["bad_message"] = error_of(lambda: c.chat.completions.create(
        model="any", messages=[{"role": "user", "content": 5}]))
    return out


async def load(base, key, spec):
    c = openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=600)
    sem = asyncio.Semaphore(spec["concurrency"])

    async def one(i, req):
        async with sem:
            res = {"i": i}
            try:
                if req["endpoint"] == "chat":
                    kw = dict(model="any", messages=chat_messages(req), temperature=0,
                              max_tokens=req["max_tokens"])
                    if req["stream"]:
                        pieces, fin, usage = [], None, None
                        s = await c.chat.completions.create(
                            stream=True, stream_options={"include_usage": True}, **kw)
                        async for ch in s:
                            if ch.usage is not None:
                                usage = ch.usage
                            for choice in ch.choices:
                                if choice.delta.content:
                                    pieces.append(choice.delta.content)
                                if choice.finish_reason:
                                    fin = choice.finish_reason
                        text = "".join(pieces)
                    else:
                        r = await c.chat.completions.create(**kw)
                        text, fin, usage = r.choices[0].message.content, r.choices[0].finish_reason, r.usage
                else:
                    kw = dict(model="any", prompt=req["prompt"], temperature=0,
                              max_tokens=req["max_tokens"])
                    if req["stream"]:
                        pieces, fin, usage = [], None, None
                        s = await c.completions.create(
                            stream=True, stream_options={"include_usage": True}, **kw)
                        async for ch in s:
                            if ch.usage is not None:
                                usage = ch.usage
                            for choice in ch.choices:
                                pieces.append(choice.text)
                                if choice.finish_reason:
                                    fin = choice.finish_reason
                        text = "".join(pieces)
                    else:
                        r = await c.completions.create(**kw)
                        text, fin, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
                res.update(text=text, finish=fin,
                           prompt_tokens=usage.prompt_tokens if usage else None,
                           completion_tokens=usage.completion_tokens if usage else None)
            except Exception as e:  # reported, and the Rust test fails on it
                res["error"] = f"{type(e).__name__}: {e}"
            return res

    results = await asyncio.gather(*(one(i, r) for i, r in enumerate(spec["requests"])))
    await c.close()
    return results


def check(instance_text, schema):
    """Parses and validates an answer; what went wrong, or None."""
    try:
        value = json.loads(instance_text)
    except (TypeError, ValueError) as e:
        return {"parse_error": str(e)}
    errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(value)]
    return {"value": value, "errors": errors}


def structured(base, key, spec):
    c = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=300)
    out = {"chat": [], "completions": [], "errors": {}}
    n = spec["max_tokens"]
    for case in spec["schemas"]:
        msgs = [{"role": "user", "content": case["prompt"]}]
        rf = {"type": "json_schema",
              "json_schema": {"name": case["name"], "schema": case["schema"], "strict": True}}
        r = c.chat.completions.create(model="any", messages=msgs, temperature=0, max_tokens=n,
                                      response_format=rf)
        text = r.choices[0].message.content
        out["chat"].append({"name": case["name"], "text": text,
                            "finish": r.choices[0].finish_reason,
                            **check(text, case["schema"])})
    # json_object: any object.
    r = c.chat.completions.create(model="any", temperature=0, max_tokens=n,
                                  messages=[{"role": "user", "content": "Describe a cat in JSON with its name and age."}],
                                  response_format={"type": "json_object"})
    text = r.choices[0].message.content
    out["json_object"] = {"text": text, "finish": r.choices[0].finish_reason,
                          **check(text, {"type": "object"})}
    # Streamed: the pieces join into the same valid answer.
    case = spec["schemas"][0]
    rf = {"type": "json_schema", "json_schema": {"name": case["name"], "schema": case["schema"]}}
    pieces, finish = [], None
    for ch in c.chat.completions.create(model="any", temperature=0, max_tokens=n, stream=True,
                                        messages=[{"role": "user", "content": case["prompt"]}],
                                        response_format=rf):
        for choice in ch.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    out["chat_stream"] = {"text": "".join(pieces), "finish": finish}
    # /v1/completions: response_format, llama-server's json_schema and grammar.
    for case in spec["completion_schemas"]:
        extra = {case["field"]: case["value"]}
        r = c.completions.create(model="any", prompt=case["prompt"], temperature=0, max_tokens=n,
                                 extra_body=extra)
        text = r.choices[0].text
        res = {"field": case["field"], "text": text, "finish": r.choices[0].finish_reason}
        if "schema" in case:
            res.update(check(text, case["schema"]))
        out["completions"].append(res)
    for name, req in spec["bad"].items():
        kw = dict(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        kw.update(req)
        rf = kw.pop("extra_body", None)
        out["errors"][name] = error_of(lambda: c.chat.completions.create(extra_body=rf, **kw))
    return out


def tools(base, key, spec):
    c = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=300)
    out = {}
    n = spec["max_tokens"]
    msgs = [{"role": "user", "content": spec["question"]}]

    def calls_of(message):
        return [{"id": t.id, "type": t.type, "name": t.function.name,
                 "arguments": t.function.arguments} for t in (message.tool_calls or [])]

    for label, choice in [("required", "required"), ("named", spec["named"]), ("auto", "auto")]:
        r = c.chat.completions.create(model="any", messages=msgs, temperature=0, max_tokens=n,
                                      tools=spec["tools"], tool_choice=choice)
        m = r.choices[0].message
        out[label] = {"finish": r.choices[0].finish_reason, "content": m.content,
                      "calls": calls_of(m), "usage": r.usage.model_dump()}

    # Streamed: the client assembles delta.tool_calls into the same calls.
    acc, finish, content, chunks = {}, None, [], 0
    for ch in c.chat.completions.create(model="any", messages=msgs, temperature=0, max_tokens=n,
                                        tools=spec["tools"], tool_choice="required", stream=True):
        for choice in ch.choices:
            d = choice.delta
            if d.content:
                content.append(d.content)
            for tc in d.tool_calls or []:
                chunks += 1
                slot = acc.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    slot["id"] = tc.id
                if tc.function and tc.function.name:
                    slot["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
            if choice.finish_reason:
                finish = choice.finish_reason
    out["stream"] = {"finish": finish, "content": "".join(content), "chunks": chunks,
                     "calls": [acc[i] for i in sorted(acc)]}

    # The follow-up: the assistant's calls and the tool's results.
    first = out["required"]["calls"]
    follow = msgs + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": t["id"], "type": "function",
                         "function": {"name": t["name"], "arguments": t["arguments"]}}
                        for t in first]},
    ] + [{"role": "tool", "tool_call_id": t["id"], "content": spec["result"]} for t in first]
    for label, stream in [("follow_up", False), ("follow_up_stream", True)]:
        kw = dict(model="any", messages=follow, temperature=0, max_tokens=n,
                  tools=spec["tools"], tool_choice="none")
        if stream:
            pieces, finish = [], None
            for ch in c.chat.completions.create(stream=True, **kw):
                for choice in ch.choices:
                    if choice.delta.content:
                        pieces.append(choice.delta.content)
                    if choice.finish_reason:
                        finish = choice.finish_reason
            out[label] = {"finish": finish, "content": "".join(pieces)}
        else:
            r = c.chat.completions.create(**kw)
            out[label] = {"finish": r.choices[0].finish_reason,
                          "content": r.choices[0].message.content,
                          "usage": r.usage.model_dump()}

    out["errors"] = {
        "unknown_tool": error_of(lambda: c.chat.completions.create(
            model="any", messages=msgs, tools=spec["tools"], max_tokens=4,
            tool_choice={"type": "function", "function": {"name": "no_such_tool"}})),
        "bad_tool": error_of(lambda: c.chat.completions.create(
            model="any", messages=msgs, max_tokens=4,
            tools=[{"type": "function", "function": {"description": "no name"}}])),
        "bad_arguments": error_of(lambda: c.chat.completions.create(
            model="any", max_tokens=4, tools=spec["tools"],
            messages=msgs + [{"role": "assistant", "tool_calls": [
                {"id": "x", "type": "function",
                 "function": {"name": spec["tools"][0]["function"]["name"], "arguments": "{oops"}}]}])),
    }
    return out


def main():
    base, key, cmd = sys.argv[1], sys.argv[2], sys.argv[3]
    spec = json.load(sys.stdin)
    if cmd == "basics":
        out = basics(base, key, spec)
    elif cmd == "structured":
        out = structured(base, key, spec)
    elif cmd == "tools":
        out = tools(base, key, spec)
    elif cmd == "load":
        out = asyncio.run(load(base, key, spec))
    else:
        sys.exit(f"unknown command {cmd}")
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
