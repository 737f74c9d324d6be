//! Tool calling: OpenAI's `tools` / `tool_choice` rendered into the
//! model's chat format, the model's answer parsed back into `tool_calls`.
//!
//! Two formats, chosen by the model's chat template:
//!
//! * **The template's own** ([`ToolFormat::TemplateJson`]): a template that
//!   reads a `tools` variable (Llama 3.1 / 3.2) renders the tools, the
//!   assistant's earlier `tool_calls` and the `tool` messages itself. The
//!   model answers a call with one JSON object `{"name": ..., "parameters":
//!   {...}}` (Meta's JSON tool-calling format; `"arguments"` is read too).
//! * **SmolLM2's documented format** ([`ToolFormat::SmolLm2`]) for templates
//!   without `tools` (SmolLM2's GGUF template only knows roles and content):
//!   a system message listing the tools in `<tools>...</tools>` and asking
//!   for `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`
//!   (several calls in one list), earlier calls rendered the same way, tool
//!   results as a user turn in `<tool_response>...</tool_response>`; the
//!   turns themselves go through the model's template.
//!
//! `tool_choice`: `auto` (the default) lets the model answer in text or
//! with calls (text may not start like a call); `required` and a named
//! function force calls, by a grammar (see
//! [`crate::generate::constraint`]) whose arguments follow each function's
//! `parameters` schema; `none` renders no tools and parses nothing.

use super::api::{only_keys, ApiError};
use crate::generate::constraint::GrammarSpec;
use serde_json::{json, Value};

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema for the arguments (an object schema).
    pub parameters: Value,
}

/// OpenAI's `tool_choice`.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    Named(String),
}

/// How calls are asked for and written (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    TemplateJson,
    SmolLm2,
}

/// A call the model made: the function and its arguments as JSON text.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// Reads `tools`; a malformed entry is a 400 naming it.
pub fn parse_tools(tools: &[Value]) -> Result<Vec<Tool>, ApiError> {
    let mut out: Vec<Tool> = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let at = |f: &str| format!("tools[{i}]{f}");
        only_keys(t, &at(""), &["type", "function"])?;
        let kind = t.get("type").and_then(Value::as_str).unwrap_or("function");
        if kind != "function" {
            return Err(ApiError::invalid(
                &at(".type"),
                format!("only `function` tools are supported, got `{kind}`"),
            ));
        }
        let f = t.get("function").ok_or_else(|| {
            ApiError::invalid(
                &at(".function"),
                format!("`{}` is missing", at(".function")),
            )
        })?;
        // `strict` asks that arguments follow `parameters` exactly: they
        // always do here (the call grammar enforces the schema).
        only_keys(
            f,
            &at(".function"),
            &["name", "description", "parameters", "strict"],
        )?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                ApiError::invalid(
                    &at(".function.name"),
                    format!("`{}` must be a non-empty string", at(".function.name")),
                )
            })?;
        if out.iter().any(|o| o.name == name) {
            return Err(ApiError::invalid(
                &at(".function.name"),
                format!("two tools are named `{name}`"),
            ));
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p) if p.is_object() => p.clone(),
            Some(_) => {
                return Err(ApiError::invalid(
                    &at(".function.parameters"),
                    format!(
                        "`{}` must be a JSON schema object",
                        at(".function.parameters")
                    ),
                ))
            }
        };
        out.push(Tool {
            name: name.to_string(),
            description: f
                .get("description")
                .and_then(Value::as_str)
                .map(String::from),
            parameters,
        });
    }
    Ok(out)
}

/// Reads `tool_choice` against the tools given; an unknown function name
/// is a 400 naming `tool_choice`.
pub fn parse_tool_choice(choice: Option<&Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let c = match choice {
        None | Some(Value::Null) => return Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "`tool_choice` must be `auto`, `none`, `required` or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got `{other}`"
                    ),
                ))
            }
        },
        Some(v) => {
            only_keys(v, "tool_choice", &["type", "function"])?;
            if let Some(f) = v.get("function") {
                only_keys(f, "tool_choice.function", &["name"])?;
            }
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "`tool_choice` names a function as {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            ToolChoice::Named(name.to_string())
        }
    };
    match &c {
        ToolChoice::Required | ToolChoice::Named(_) if tools.is_empty() => Err(ApiError::invalid(
            "tool_choice",
            "`tool_choice` asks for a tool call but `tools` is empty",
        )),
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => Err(ApiError::invalid(
            "tool_choice",
            format!("`tool_choice` names the function `{n}`, which is not in `tools`"),
        )),
        _ => Ok(c),
    }
}

impl ToolFormat {
    /// The format for a chat template (its source text).
    pub fn of(template: Option<&str>) -> ToolFormat {
        match template {
            Some(t) if t.contains("tools") => ToolFormat::TemplateJson,
            _ => ToolFormat::SmolLm2,
        }
    }

    /// Whether the template itself is given `tools`.
    pub fn template_renders_tools(self) -> bool {
        self == ToolFormat::TemplateJson
    }

    /// What every answer that is a call starts with.
    pub fn marker(self) -> &'static str {
        match self {
            ToolFormat::TemplateJson => "{",
            ToolFormat::SmolLm2 => "<tool_call>",
        }
    }

    /// What the chat template is given when tools are in play: the
    /// messages (as [`super::api::ChatRequest::messages_json`] gives them)
    /// in this format, and the request's `tools` list (`tools_json`) when
    /// the template renders it itself and some are offered.
    pub fn template_inputs(
        self,
        messages: &[Value],
        tools_json: &[Value],
        offered: &[Tool],
    ) -> (Value, Option<Value>) {
        let listed = (self.template_renders_tools() && !offered.is_empty())
            .then(|| Value::Array(tools_json.to_vec()));
        (Value::Array(self.messages(messages, offered)), listed)
    }

    /// The messages as the chat template reads them: tool calls and tool
    /// results in this format, and (SmolLM2's) the system message listing
    /// `tools` when there are any to offer.
    pub fn messages(self, messages: &[Value], tools: &[Tool]) -> Vec<Value> {
        match self {
            ToolFormat::TemplateJson => messages.to_vec(),
            ToolFormat::SmolLm2 => {
                let mut out = Vec::with_capacity(messages.len() + 1);
                let mut rest = messages;
                if !tools.is_empty() {
                    let mut system = smol_system_prompt(tools);
                    if let Some(first) = messages.first().filter(|m| m["role"] == "system") {
                        let own = first["content"].as_str().unwrap_or("");
                        if !own.is_empty() {
                            system.push_str("\n\n");
                            system.push_str(own);
                        }
                        rest = &messages[1..];
                    }
                    out.push(json!({"role": "system", "content": system}));
                }
                for m in rest {
                    let role = m["role"].as_str().unwrap_or("");
                    let content = m["content"].as_str().unwrap_or("");
                    match (role, m.get("tool_calls").and_then(Value::as_array)) {
                        ("assistant", Some(calls)) if !calls.is_empty() => {
                            let items: Vec<String> = calls
                                .iter()
                                .map(|c| {
                                    let f = &c["function"];
                                    format!(
                                        "{{\"name\": {}, \"arguments\": {}}}",
                                        f["name"], f["arguments"]
                                    )
                                })
                                .collect();
                            let mut text = content.to_string();
                            text.push_str(&format!(
                                "<tool_call>[\n{}\n]</tool_call>",
                                items.join(",\n")
                            ));
                            out.push(json!({"role": "assistant", "content": text}));
                        }
                        ("tool", _) => out.push(json!({
                            "role": "user",
                            "content": format!("<tool_response>\n{content}\n</tool_response>"),
                        })),
                        _ => out.push(json!({"role": role, "content": content})),
                    }
                }
                out
            }
        }
    }

    /// The grammar forcing calls (`required`, a named function) or keeping
    /// calls well formed while allowing text (`auto`); `None` for `none`.
    pub fn grammar(
        self,
        tools: &[Tool],
        choice: &ToolChoice,
        parallel: bool,
    ) -> Option<GrammarSpec> {
        let offered: Vec<&Tool> = match choice {
            ToolChoice::None => return None,
            ToolChoice::Named(n) => tools.iter().filter(|t| &t.name == n).collect(),
            ToolChoice::Auto | ToolChoice::Required => tools.iter().collect(),
        };
        if offered.is_empty() {
            return None;
        }
        let args_key = match self {
            ToolFormat::TemplateJson => "parameters",
            ToolFormat::SmolLm2 => "arguments",
        };
        let call_schemas: Vec<Value> = offered
            .iter()
            .map(|t| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name}, args_key: t.parameters},
                    "required": ["name", args_key],
                    "additionalProperties": false,
                })
            })
            .collect();
        let call = json!({
            "anyOf": call_schemas,
            "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "},
        });
        let forced = !matches!(choice, ToolChoice::Auto);
        let one = !parallel || matches!(choice, ToolChoice::Named(_));
        let mut g = String::from("%llguidance {}\n");
        match self {
            ToolFormat::TemplateJson => {
                g.push_str(if forced {
                    "start: call\n"
                } else {
                    "start: call | TEXT\n"
                });
            }
            ToolFormat::SmolLm2 => {
                let calls = match (forced, one) {
                    (_, true) => "\"\\n\" call \"\\n\"",
                    (true, false) => "\"\\n\" call (\",\\n\" call)* \"\\n\"",
                    (false, false) => "(\"\\n\" call (\",\\n\" call)* \"\\n\")?",
                };
                g.push_str(&format!(
                    "start: calls{}\ncalls: \"<tool_call>[\" {calls} \"]</tool_call>\"\n",
                    if forced { "" } else { " | TEXT" }
                ));
            }
        }
        g.push_str(&format!("call: %json {call}\n"));
        if !forced {
            // Text that does not start like a call (so a call, once begun,
            // is always complete and valid).
            let marker = regex_escape(self.marker());
            g.push_str(&format!("TEXT: /(?s:.+)/ & ~/(?s:\\s*{marker}.*)/\n"));
        }
        Some(GrammarSpec::Lark(g))
    }

    /// The calls in a whole answer, and the text besides them; `None` when
    /// the answer is not a call.
    pub fn parse(self, text: &str) -> Option<(String, Vec<ToolCall>)> {
        let t = text.trim_start();
        let call_of = |v: &Value| -> Option<ToolCall> {
            let name = v.get("name")?.as_str()?.to_string();
            let args = v.get("arguments").or_else(|| v.get("parameters"))?;
            let arguments = match args {
                // Already JSON text (some models write it so).
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            Some(ToolCall { name, arguments })
        };
        match self {
            ToolFormat::TemplateJson => {
                let t = t.strip_prefix("<|python_tag|>").unwrap_or(t);
                let v: Value = serde_json::from_str(t.trim()).ok()?;
                let calls = match &v {
                    Value::Array(items) => items.iter().map(call_of).collect::<Option<Vec<_>>>()?,
                    v => vec![call_of(v)?],
                };
                Some((String::new(), calls))
            }
            ToolFormat::SmolLm2 => {
                let start = text.find("<tool_call>")?;
                let body = &text[start + "<tool_call>".len()..];
                let end = body.find("</tool_call>")?;
                let v: Value = serde_json::from_str(body[..end].trim()).ok()?;
                let calls = match &v {
                    Value::Array(items) => items.iter().map(call_of).collect::<Option<Vec<_>>>()?,
                    v => vec![call_of(v)?],
                };
                let mut rest = text[..start].to_string();
                rest.push_str(&body[end + "</tool_call>".len()..]);
                Some((rest.trim().to_string(), calls))
            }
        }
    }
}

fn regex_escape(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if "\\.+*?()|[]{}^$/".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// SmolLM2's function-calling system prompt (its documented format).
fn smol_system_prompt(tools: &[Tool]) -> String {
    let list: Vec<Value> = tools
        .iter()
        .map(|t| {
            let mut f = json!({"name": t.name});
            if let Some(d) = &t.description {
                f["description"] = json!(d);
            }
            f["parameters"] = t.parameters.clone();
            f
        })
        .collect();
    format!(
        "You are an expert in composing functions. You are given a question and a set of possible functions.\n\
Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n\
If none of the functions can be used, point it out and refuse to answer.\n\
If the given question lacks the parameters required by the function, also point it out.\n\
You have access to the following tools:\n\
<tools>{}</tools>\n\
The output MUST strictly adhere to the following format, and NO other text MUST be included.\n\
The example format is as follows. Please make sure the parameter type is correct. If no function call is needed, please make the tool calls an empty list '[]'.\n\
<tool_call>[\n\
{{\"name\": \"func_name1\", \"arguments\": {{\"argument1\": \"value1\", \"argument2\": \"value2\"}}}},\n\
... (more tool calls as required)\n\
]</tool_call>",
        Value::Array(list)
    )
}

/// Holds back streamed text until it is clear whether the answer is a
/// call: text that cannot begin with the format's marker flows through at
/// once; a call is kept whole for [`ToolFormat::parse`] at the end.
#[derive(Debug)]
pub struct CallDetector {
    format: ToolFormat,
    held: String,
    state: Detect,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Detect {
    Undecided,
    Text,
    Call,
}

impl CallDetector {
    pub fn new(format: ToolFormat) -> CallDetector {
        CallDetector {
            format,
            held: String::new(),
            state: Detect::Undecided,
        }
    }

    /// Adds a piece of text; returns what may be sent as content now.
    pub fn push(&mut self, piece: &str) -> String {
        match self.state {
            Detect::Text => return piece.to_string(),
            Detect::Call => {
                self.held.push_str(piece);
                return String::new();
            }
            Detect::Undecided => self.held.push_str(piece),
        }
        let t = self.held.trim_start();
        let marker = self.format.marker();
        if t.is_empty() || marker.starts_with(t) {
            String::new()
        } else if t.starts_with(marker) {
            self.state = Detect::Call;
            String::new()
        } else {
            self.state = Detect::Text;
            std::mem::take(&mut self.held)
        }
    }

    /// At the end: the calls (and any text besides them) if the answer was
    /// a call, else the content still held.
    pub fn finish(&mut self) -> Result<(String, Vec<ToolCall>), String> {
        let held = std::mem::take(&mut self.held);
        match self.state {
            Detect::Call => match self.format.parse(&held) {
                Some(r) => Ok(r),
                None => Err(held),
            },
            _ => Err(held),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Tool> {
        parse_tools(&[json!({"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})]).unwrap()
    }

    #[test]
    fn unknown_keys_in_tools_and_tool_choice_are_refused_by_name() {
        let f = json!({"name": "f", "parameters": {"type": "object"}});
        for (tools, want) in [
            (
                json!([{"type": "function", "function": f, "cache": true}]),
                "tools[0].cache",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "examples": []}}]),
                "tools[0].function.examples",
            ),
            (json!(["f"]), "tools[0]"),
        ] {
            let e = parse_tools(tools.as_array().unwrap()).unwrap_err();
            assert_eq!((e.status, e.param.as_deref()), (400, Some(want)), "{tools}");
        }
        let tools = parse_tools(&[json!({"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}, "strict": true}})]).unwrap();
        for (choice, want) in [
            (
                json!({"type": "function", "function": {"name": "f"}, "why": 1}),
                "tool_choice.why",
            ),
            (
                json!({"type": "function", "function": {"name": "f", "arguments": {}}}),
                "tool_choice.function.arguments",
            ),
        ] {
            let e = parse_tool_choice(Some(&choice), &tools).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(want), "{choice}");
        }
    }

    #[test]
    fn choices_are_checked_against_the_tools() {
        let t = tools();
        assert_eq!(parse_tool_choice(None, &t).unwrap(), ToolChoice::Auto);
        assert_eq!(
            parse_tool_choice(Some(&json!("required")), &t).unwrap(),
            ToolChoice::Required
        );
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        assert_eq!(
            parse_tool_choice(Some(&named), &t).unwrap(),
            ToolChoice::Named("get_weather".into())
        );
        let unknown = json!({"type": "function", "function": {"name": "nope"}});
        let e = parse_tool_choice(Some(&unknown), &t).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        assert!(e.message.contains("`nope`"), "{}", e.message);
        let e = parse_tool_choice(Some(&json!("sometimes")), &t).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let e = parse_tools(&[json!({"type": "function", "function": {"parameters": {}}})])
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].function.name"));
    }

    #[test]
    fn smollm2_calls_render_and_parse() {
        let f = ToolFormat::of(Some(
            "{% for message in messages %}{{ message['content'] }}{% endfor %}",
        ));
        assert_eq!(f, ToolFormat::SmolLm2);
        let msgs = f.messages(
            &[
                json!({"role": "user", "content": "Weather in Paris?"}),
                json!({"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}),
                json!({"role": "tool", "tool_call_id": "c1", "content": "sunny"}),
            ],
            &tools(),
        );
        assert_eq!(msgs.len(), 4);
        let system = msgs[0]["content"].as_str().unwrap();
        assert!(
            system.contains(
                "<tools>[{\"name\":\"get_weather\",\"description\":\"Weather in a city\",\"parameters\":{"
            ),
            "{system}"
        );
        assert_eq!(
            msgs[2]["content"],
            "<tool_call>[\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n]</tool_call>"
        );
        assert_eq!(
            msgs[3]["content"],
            "<tool_response>\nsunny\n</tool_response>"
        );
        let (rest, calls) = f
            .parse("<tool_call>[\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}},\n{\"name\": \"x\", \"arguments\": {}}\n]</tool_call>")
            .unwrap();
        assert_eq!(rest, "");
        assert_eq!(
            calls,
            vec![
                ToolCall {
                    name: "get_weather".into(),
                    arguments: "{\"city\":\"Paris\"}".into()
                },
                ToolCall {
                    name: "x".into(),
                    arguments: "{}".into()
                },
            ]
        );
        assert!(f.parse("It is sunny.").is_none());
    }

    #[test]
    fn the_detector_passes_text_and_holds_calls() {
        let mut d = CallDetector::new(ToolFormat::SmolLm2);
        assert_eq!(d.push(" <tool"), "");
        assert_eq!(
            d.push("_call>[\n{\"name\": \"x\", \"arguments\": {}}\n]"),
            ""
        );
        assert_eq!(d.push("</tool_call>"), "");
        let (_, calls) = d.finish().unwrap();
        assert_eq!(calls[0].name, "x");
        let mut d = CallDetector::new(ToolFormat::SmolLm2);
        assert_eq!(d.push("<to"), "");
        assert_eq!(d.push("p hat"), "<top hat");
        assert_eq!(d.push(" on"), " on");
        assert_eq!(d.finish().unwrap_err(), "");
    }
}
