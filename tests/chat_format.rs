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
