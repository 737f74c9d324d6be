"""Drives `llama-graph serve` with the official `openai` client for
tests/server_api.rs: logprobs, n choices, penalties and logit_bias,
embeddings, models.retrieve and the malformed variants of each. The Rust
test starts the server, computes the expected values with the library and
`llama-graph run`, runs this script and checks what it prints: one JSON
document on stdout. Nothing is asserted here.

Usage: api_client.py BASE_URL API_KEY COMMAND < spec.json
  api    every call below (spec: see the Rust test)
"""

import asyncio
import json
import sys

import openai


def error_of(fn):
    """Status and error body of a call expected to fail."""
    try:
        fn()
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else None
        return {"status": e.status_code, "body": body}
    return {"status": 200}


def chat_lp(content):
    """A chat choice's `logprobs.content` as plain JSON."""
    return [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes,
             "top": [{"token": a.token, "logprob": a.logprob, "bytes": a.bytes}
                     for a in t.top_logprobs]}
            for t in content]


def api(base, key, spec):
    c = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=300)
    out = {}
    msgs = [{"role": "user", "content": spec["chat"]["user"]}]
    n = spec["chat"]["max_tokens"]
    top = spec["top"]

    # logprobs: chat, whole and streamed; completions.
    r = c.chat.completions.create(model="any", messages=msgs, temperature=0, max_tokens=n,
                                  logprobs=True, top_logprobs=top)
    out["chat_lp"] = {"content": r.choices[0].message.content,
                      "logprobs": chat_lp(r.choices[0].logprobs.content)}
    lps, pieces = [], []
    for ch in c.chat.completions.create(model="any", messages=msgs, temperature=0,
                                        max_tokens=n, logprobs=True, top_logprobs=top,
                                        stream=True):
        for choice in ch.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.logprobs and choice.logprobs.content:
                lps.extend(chat_lp(choice.logprobs.content))
    out["chat_lp_stream"] = {"content": "".join(pieces), "logprobs": lps}
    t = spec["text"]
    r = c.completions.create(model="any", prompt=t["prompt"], temperature=0,
                             max_tokens=t["max_tokens"], logprobs=top)
    lp = r.choices[0].logprobs
    out["text_lp"] = {"text": r.choices[0].text, "tokens": lp.tokens,
                      "token_logprobs": lp.token_logprobs, "top_logprobs": lp.top_logprobs,
                      "text_offset": lp.text_offset}

    # n choices, seeded seed + i; whole and streamed.
    k = spec["n"]
    r = c.chat.completions.create(model="any", messages=msgs, temperature=1.0, seed=42,
                                  max_tokens=n, n=k)
    out["n"] = {"contents": [ch.message.content for ch in sorted(r.choices, key=lambda x: x.index)],
                "finishes": [ch.finish_reason for ch in sorted(r.choices, key=lambda x: x.index)],
                "usage": r.usage.model_dump()}
    texts = [""] * k
    finishes = [None] * k
    for ch in c.chat.completions.create(model="any", messages=msgs, temperature=1.0, seed=42,
                                        max_tokens=n, n=k, stream=True):
        for choice in ch.choices:
            if choice.delta.content:
                texts[choice.index] += choice.delta.content
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    out["n_stream"] = {"contents": texts, "finishes": finishes}

    # logit_bias -100 bans a token; presence and frequency penalties.
    b = spec["bias"]
    r = c.completions.create(model="any", prompt=b["prompt"], temperature=0,
                             max_tokens=b["max_tokens"], logit_bias={str(b["ban"]): -100})
    out["ban"] = {"text": r.choices[0].text, "usage": r.usage.model_dump()}
    r = c.completions.create(model="any", prompt=b["prompt"], temperature=0,
                             max_tokens=b["max_tokens"], presence_penalty=b["presence"],
                             frequency_penalty=b["frequency"])
    out["penalties"] = {"text": r.choices[0].text, "usage": r.usage.model_dump()}

    # Fields that change nothing are accepted.
    out["accepted"] = error_of(lambda: c.chat.completions.create(
        model="any", messages=msgs, max_tokens=2, user="user-1", metadata={"k": "v"}, store=False))

    # The malformed variant of each point: 400 naming the field.
    out["bad"] = {
        "top_logprobs": error_of(lambda: c.chat.completions.create(
            model="any", messages=msgs, max_tokens=2, logprobs=True, top_logprobs=50)),
        "n": error_of(lambda: c.chat.completions.create(
            model="any", messages=msgs, max_tokens=2, n=0)),
        "logprobs": error_of(lambda: c.completions.create(
            model="any", prompt="x", max_tokens=2, logprobs=50)),
        "presence_penalty": error_of(lambda: c.chat.completions.create(
            model="any", messages=msgs, max_tokens=2, presence_penalty=3)),
        "logit_bias": error_of(lambda: c.chat.completions.create(
            model="any", messages=msgs, max_tokens=2, logit_bias={"hello": 5})),
        "best_of": error_of(lambda: c.completions.create(
            model="any", prompt="x", max_tokens=2, best_of=2)),
        "unknown": error_of(lambda: c.chat.completions.create(
            model="any", messages=msgs, max_tokens=2, extra_body={"mirostat": 2})),
        "encoding_format": error_of(lambda: c.embeddings.create(
            model="any", input="x", encoding_format="int8")),
        "dimensions": error_of(lambda: c.embeddings.create(
            model="any", input="x", dimensions=7)),
        "input": error_of(lambda: c.embeddings.create(model="any", input=[])),
    }

    # Models.
    out["model"] = c.models.retrieve(spec["model"]).model_dump()
    out["model_unknown"] = error_of(lambda: c.models.retrieve("no-such-model"))

    # Embeddings: base64 (the client's default), float, one input, token ids.
    e = spec["embed"]
    r = c.embeddings.create(model="any", input=e["inputs"])
    out["emb_b64"] = {"data": [d.embedding for d in sorted(r.data, key=lambda x: x.index)],
                      "usage": r.usage.model_dump()}
    r = c.embeddings.create(model="any", input=e["inputs"], encoding_format="float")
    out["emb_float"] = [d.embedding for d in sorted(r.data, key=lambda x: x.index)]
    r = c.embeddings.create(model="any", input=e["inputs"][0], encoding_format="float")
    out["emb_one"] = r.data[0].embedding
    r = c.embeddings.create(model="any", input=e["ids"], encoding_format="float")
    out["emb_ids"] = r.data[0].embedding
    out["emb_busy"] = asyncio.run(embed_while_busy(base, key, e["inputs"][0], msgs))
    return out


async def embed_while_busy(base, key, text, msgs):
    """The embedding of `text` while chat requests are being generated."""
    c = openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=300)

    async def chat():
        await c.chat.completions.create(model="any", messages=msgs, temperature=0, max_tokens=24)

    async def embed():
        await asyncio.sleep(0.2)
        r = await c.embeddings.create(model="any", input=[text, text + " and more"],
                                      encoding_format="float")
        return r.data[0].embedding

    res = await asyncio.gather(chat(), chat(), embed())
    await c.close()
    return res[2]


def main():
    base, key, cmd = sys.argv[1], sys.argv[2], sys.argv[3]
    spec = json.load(sys.stdin)
    if cmd == "api":
        out = api(base, key, spec)
    else:
        sys.exit(f"unknown command {cmd}")
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
