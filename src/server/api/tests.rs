use super::*;

fn chat(body: &str) -> Result<ChatRequest, ApiError> {
    parse_body(body.as_bytes())
}

#[test]
fn wrong_types_name_the_field() {
    let e = chat(r#"{"messages": [], "temperature": "hot"}"#).unwrap_err();
    assert_eq!((e.status, e.param.as_deref()), (400, Some("temperature")));
    assert!(e.message.contains("temperature"), "{}", e.message);
    let e = chat(r#"{"messages": [{"role": "user", "content": 5}]}"#).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("messages[0].content"));
    assert!(e.message.contains("a string or an array"), "{}", e.message);
    let e = chat(r#"{"messages": [{"role": "user"}], "stop": [1]}"#).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("stop"));
    let e = chat(r#"{"temperature": 1}"#).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("messages"));
    assert!(
        e.message.contains("missing field `messages`"),
        "{}",
        e.message
    );
    let e = chat("[1, 2]").unwrap_err();
    assert_eq!((e.status, e.param.as_deref()), (400, None));
}

#[test]
fn unknown_fields_are_refused_by_name_but_user_metadata_store() {
    let e = chat(r#"{"messages": [], "best_of": 2}"#).unwrap_err();
    assert_eq!((e.status, e.param.as_deref()), (400, Some("best_of")));
    assert!(e.message.contains("best_of"), "{}", e.message);
    let e =
        chat(r#"{"messages": [], "stream_options": {"include_obfuscation": true}}"#).unwrap_err();
    assert_eq!(
        e.param.as_deref(),
        Some("stream_options.include_obfuscation")
    );
    chat(r#"{"messages": [], "user": "u1", "metadata": {"a": "b"}, "store": false}"#).unwrap();
    // A wrong type is still named as such.
    let e = chat(r#"{"messages": [], "n": "two", "bogus": 1}"#).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("n"));
}

#[test]
fn unknown_keys_inside_messages_and_options_are_refused_by_name() {
    let param = |body: &str| -> Option<String> {
        match chat(body) {
            Err(e) => {
                assert_eq!(e.status, 400, "{body}");
                assert!(e.message.contains(e.param.as_deref().unwrap_or("")));
                e.param
            }
            Ok(r) => r
                .messages()
                .and(r.messages_json())
                .err()
                .and_then(|e| e.param),
        }
    };
    for (body, want) in [
        (
            r#"{"messages": [{"role": "user", "content": "hi", "cache_control": {}}]}"#,
            "messages[0].cache_control",
        ),
        (
            r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x", "weight": 2}]}"#,
            "messages[1].weight",
        ),
        (
            r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]}]}"#,
            "messages[0].content[0].cache_control",
        ),
        (
            r#"{"messages": [{"role": "assistant", "content": "no", "refusal": "I won't"}]}"#,
            "messages[0].refusal",
        ),
        (
            r#"{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}, "index": 0}]}]}"#,
            "messages[0].tool_calls[0].index",
        ),
        (
            r#"{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}", "extra": 1}}]}]}"#,
            "messages[0].tool_calls[0].function.extra",
        ),
        (
            r#"{"messages": [{"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}]}"#,
            "messages[0].tool_calls[0].type",
        ),
        (
            r#"{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {"schema": {}, "description": "d"}}}"#,
            "response_format.json_schema.description",
        ),
    ] {
        assert_eq!(param(body).as_deref(), Some(want), "{body}");
    }
    // What clients send back from an assistant message, a message's
    // `name`, and content parts of text alone are accepted.
    let r = chat(
        r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"}, {"role": "assistant", "content": "yes", "refusal": null, "audio": null, "function_call": null, "annotations": [], "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}"#,
    )
    .unwrap();
    assert_eq!(r.messages().unwrap().len(), 2);
    r.messages_json().unwrap();
}

#[test]
fn malformed_json_is_400_without_a_field() {
    for body in ["{", "{\"messages\": [}", "", "[] x", "{} {}", "\u{0}\u{1}"] {
        let e = chat(body).unwrap_err();
        assert_eq!(e.status, 400, "{body}");
        assert!(
            e.message.starts_with("malformed JSON"),
            "{body}: {}",
            e.message
        );
    }
}

#[test]
fn values_are_checked_and_named() {
    let r = chat(r#"{"messages": [{"role": "user", "content": "hi"}], "top_p": 0}"#).unwrap();
    let e = r.common().check(None, || 0).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("top_p"));
    let r = chat(r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}"#).unwrap();
    let e = r.common().check(r.max_tokens(), || 0).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("max_tokens"));
    let r = chat(
        r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "max_completion_tokens": 3, "seed": 5, "stop": "x", "top_k": -1}"#,
    )
    .unwrap();
    let c = r.common().check(r.max_tokens(), || 0).unwrap();
    assert_eq!(c.max_tokens, Some(3));
    assert_eq!((c.sampling.seed, c.sampling.top_k), (5, 0));
    assert_eq!(c.stop, vec!["x".to_string()]);
    let refused = |body: &str| {
        let r = chat(body).unwrap();
        r.common().check(None, || 0).unwrap_err().param
    };
    let hi = r#""messages": [{"role": "user", "content": "hi"}]"#;
    for (extra, param) in [
        (r#""n": 0"#, "n"),
        (r#""n": 17"#, "n"),
        (r#""logprobs": true, "top_logprobs": 50"#, "top_logprobs"),
        (r#""top_logprobs": 2"#, "top_logprobs"),
        (r#""logprobs": "yes""#, "logprobs"),
        (r#""logprobs": 21"#, "logprobs"),
        (r#""presence_penalty": 2.5"#, "presence_penalty"),
        (r#""frequency_penalty": -3"#, "frequency_penalty"),
        (r#""logit_bias": {"x": 1}"#, "logit_bias"),
        (r#""logit_bias": {"5": -101}"#, "logit_bias"),
    ] {
        let got = refused(&format!("{{{hi}, {extra}}}"));
        assert_eq!(got.as_deref(), Some(param), "{extra}");
    }
    let r = chat(&format!(
        r#"{{{hi}, "n": 3, "logprobs": true, "top_logprobs": 5, "logit_bias": {{"7": -100}}, "presence_penalty": 0.5}}"#
    ))
    .unwrap();
    let c = r.common().check(None, || 0).unwrap();
    assert_eq!((c.n, c.logprobs), (3, Some(5)));
    assert_eq!(c.penalties.logit_bias, vec![(7, -100.0)]);
    assert_eq!(c.penalties.presence, 0.5);
}

#[test]
fn content_parts_join_and_other_parts_are_refused() {
    let r = chat(
        r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}"#,
    )
    .unwrap();
    assert_eq!(r.messages().unwrap()[0].content, "ab");
    let r = chat(
        r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}"#,
    )
    .unwrap();
    assert_eq!(
        r.messages().unwrap_err().param.as_deref(),
        Some("messages[0].content[0]")
    );
}
