"""Expected Llama 3 chat prompts, from Meta's own ChatFormat.

Runs llama_models.llama3.chat_format.ChatFormat.encode_dialog_prompt
(llama-models==0.3.0) with Meta's tokenizer on a few dialogs and writes
tests/fixtures/chat/llama3.json. Re-run from the repository root:

    /work/pyenv/bin/python tests/reference/chat_fixtures.py
"""
import json
import os
from pathlib import Path

import llama_models
from llama_models.datatypes import RawMessage
from llama_models.llama3.chat_format import ChatFormat
from llama_models.llama3.tokenizer import Tokenizer

DIALOGS = [
    [("user", "What is the capital of France?")],
    [("system", "You are terse."), ("user", "Hi!\n\nHow are you?  ")],
    [
        ("user", "Name a color."),
        ("assistant", "Blue."),
        ("user", "Another one, with émojis 🎨 please"),
    ],
    [("user", "   leading spaces and <|eot_id|> typed as text")],
]


def main():
    tok = Tokenizer(Path(llama_models.__file__).parent / "llama3" / "tokenizer.model")
    fmt = ChatFormat(tok)
    cases = []
    for dialog in DIALOGS:
        msgs = []
        for role, content in dialog:
            kw = {"stop_reason": "end_of_turn"} if role == "assistant" else {}
            msgs.append(RawMessage(role=role, content=content, **kw))
        tokens = fmt.encode_dialog_prompt(msgs).tokens
        cases.append({"messages": [{"role": r, "content": c} for r, c in dialog], "tokens": tokens})
    out = {
        "source": "llama_models.llama3.chat_format.ChatFormat.encode_dialog_prompt",
        "llama_models_version": "0.3.0",
        "cases": cases,
    }
    path = os.path.join(os.path.dirname(__file__), "..", "fixtures", "chat", "llama3.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
