//! The built-in Llama 3 chat format equals Meta's
//! `ChatFormat.encode_dialog_prompt` token for token
//! (fixture: tests/reference/chat_fixtures.py).
mod common;

use llama_graph::fetch::{fetch_wheel_member, LLAMA3_TOKENIZER};
use llama_graph::generate::chat::{llama3_dialog_tokens, Message};
use llama_graph::tokenizer::Tokenizer;

#[test]
fn llama3_dialogs_match_meta() {
    let tok =
        Tokenizer::from_tiktoken_file(fetch_wheel_member(&LLAMA3_TOKENIZER).unwrap()).unwrap();
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::root().join("tests/fixtures/chat/llama3.json")).unwrap(),
    )
    .unwrap();
    for case in fixture["cases"].as_array().unwrap() {
        let messages: Vec<Message> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let want: Vec<u32> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let got = llama3_dialog_tokens(&tok, &messages, true).unwrap();
        assert_eq!(got, want, "{messages:?}");
        assert_eq!(
            got.iter().filter(|&&t| t == 128000).count(),
            1,
            "exactly one BOS"
        );
    }
}

/// The templates of the Qwen2/2.5/3, Phi-3/3.5, Mistral and Gemma families
/// render as transformers' `apply_chat_template` renders them
/// (fixture: tests/reference/family_chat_fixtures.py).
#[test]
fn family_templates_render_as_transformers() {
    use llama_graph::generate::chat::ChatTemplate;
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::root().join("tests/fixtures/chat/families.json")).unwrap(),
    )
    .unwrap();
    let mut n = 0;
    for fam in fixture["families"].as_array().unwrap() {
        let name = fam["family"].as_str().unwrap();
        let t = ChatTemplate::new(fam["template"].as_str().unwrap());
        for case in fam["cases"].as_array().unwrap() {
            let messages: Vec<Message> = case["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
                .collect();
            let got = t
                .render(
                    &messages,
                    case["add_generation_prompt"].as_bool().unwrap(),
                    fam["bos_token"].as_str().unwrap(),
                    fam["eos_token"].as_str().unwrap(),
                )
                .unwrap_or_else(|e| panic!("{name} {}: {e}", case["dialog"]));
            assert_eq!(
                got,
                case["rendered"].as_str().unwrap(),
                "{name} {} (add_generation_prompt {})",
                case["dialog"],
                case["add_generation_prompt"]
            );
            n += 1;
        }
    }
    assert!(n >= 50, "{n} cases");
    eprintln!("{n} renders equal to transformers'");
}

/// Llama 3.1's tool-calling template (it reads `tools`) renders a tool
/// conversation as the server builds it (an OpenAI request's `messages` and
/// `tools` through `messages_json` and `template_inputs`) exactly as
/// transformers' `apply_chat_template(tools=...)` renders it; the call the
/// template itself writes for an assistant's `tool_calls` is what the
/// server parses back into the same call, and what the grammar forcing a
/// call (`tool_choice: required` or the named function) accepts token by
/// token on the Llama 3 vocabulary (fixture:
/// tests/reference/llama31_tool_template.py). For Llama 3.1, 3.2 and 3.3;
/// the last two print today's date (`strftime_now`), rendered here and by
/// transformers at the fixture's fixed time, and `strftime_now` formats
/// times as Python's `strftime` does.
#[test]
fn llama3x_tools_render_as_transformers_and_calls_parse() {
    for fixture in [
        "llama31_tools.json",
        "llama32_tools.json",
        "llama33_tools.json",
    ] {
        llama3x_tools(fixture);
    }
}

fn llama3x_tools(fixture: &str) {
    use llama_graph::generate::chat::ChatTemplate;
    use llama_graph::generate::constraint::Grammars;
    use llama_graph::server::api::{parse_body, ChatRequest};
    use llama_graph::server::tools::{parse_tool_choice, parse_tools, ToolChoice, ToolFormat};
    use llama_graph::tokenizer::EncodeOptions;
    use serde_json::{json, Value};
    let fx: Value = serde_json::from_str(
        &std::fs::read_to_string(common::root().join("tests/fixtures/chat").join(fixture)).unwrap(),
    )
    .unwrap();
    let source = fx["template"].as_str().unwrap();
    let at = fx["now_unix"].as_i64();
    let dated = |t: ChatTemplate| match at {
        Some(secs) => t.at_time(secs),
        None => t,
    };
    let format = ToolFormat::of(Some(source));
    assert_eq!(
        format,
        ToolFormat::TemplateJson,
        "the template reads `tools`"
    );
    let template = dated(ChatTemplate::new(source));
    let tok =
        Tokenizer::from_tiktoken_file(fetch_wheel_member(&LLAMA3_TOKENIZER).unwrap()).unwrap();
    let mut calls_checked = 0;
    for case in fx["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let body = json!({"messages": case["messages"], "tools": fx["tools"]});
        let r: ChatRequest = parse_body(body.to_string().as_bytes()).unwrap();
        let tools_json = r.tools.as_deref().unwrap();
        let tools = parse_tools(tools_json).unwrap();
        let choice = parse_tool_choice(r.tool_choice.as_ref(), &tools).unwrap();
        assert_eq!(choice, ToolChoice::Auto);
        let (messages, listed) =
            format.template_inputs(&r.messages_json().unwrap(), tools_json, &tools);
        let got = template
            .render_json(
                &messages,
                listed.as_ref(),
                true,
                fx["bos_token"].as_str().unwrap(),
                fx["eos_token"].as_str().unwrap(),
            )
            .unwrap();
        assert_eq!(got, case["rendered"].as_str().unwrap(), "{fixture}: {name}");
        let Some(text) = case["call_text"].as_str() else {
            continue;
        };
        let (rest, calls) = format.parse(text).expect("the template's call parses");
        assert_eq!(rest.trim(), "", "{name}: no text beside the call");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, case["call"]["name"].as_str().unwrap());
        let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
        assert_eq!(args, case["call"]["arguments"], "{name}");
        let grammars = Grammars::new(&tok, tok.n_vocab()).unwrap();
        for forced in [
            ToolChoice::Required,
            ToolChoice::Named(calls[0].name.clone()),
        ] {
            let g = format.grammar(&tools, &forced, true).unwrap();
            let mut c = grammars.compile(&g).unwrap();
            let ids = tok.encode(
                text,
                EncodeOptions {
                    add_bos: false,
                    parse_special: true,
                },
            );
            for (i, &id) in ids.iter().enumerate() {
                assert!(
                    c.allowed().unwrap().is_allowed(id),
                    "{forced:?}: token {i} ({id}) of {text:?} refused"
                );
                c.commit(id).unwrap();
            }
            assert!(c.is_accepting(), "{forced:?}: the call is complete");
        }
        calls_checked += 1;
    }
    assert_eq!(calls_checked, 1);
    // transformers' `tojson` alone: separators, indent, ensure_ascii,
    // sort_keys, no HTML escaping.
    let probe = &fx["tojson"];
    let got = ChatTemplate::new(probe["template"].as_str().unwrap())
        .render_json(&probe["messages"], None, false, "", "")
        .unwrap();
    assert_eq!(got, probe["rendered"].as_str().unwrap());
    // `strftime_now` against Python's `strftime`, time by time.
    for case in fx["strftime"].as_array().into_iter().flatten() {
        let (unix, format) = (
            case["unix"].as_i64().unwrap(),
            case["format"].as_str().unwrap(),
        );
        let t = ChatTemplate::new(format!("{{{{ strftime_now({format:?}) }}}}")).at_time(unix);
        let got = t.render_json(&json!([]), None, false, "", "").unwrap();
        assert_eq!(got, case["text"].as_str().unwrap(), "{format} at {unix}");
    }
    if at.is_some() {
        assert_eq!(fx["strftime"].as_array().map_or(0, Vec::len), 40);
    }
}
