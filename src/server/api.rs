//! The OpenAI wire format: request bodies as they are parsed and checked,
//! and the error shape (`{"error": {"message", "type", "param", "code"}}`).
//!
//! A field this server does not know, at the top level or inside an object
//! of the request (`messages[0].foo`, `tools[0].function.foo`), is refused
//! by name (400): a request field it cannot honour is never silently
//! dropped. Only fields that do not change the output are accepted and
//! ignored ([`IGNORED_FIELDS`]: `user`, `metadata`, `store`; a message's
//! `name`). Known fields this
//! server cannot honour with a non-default value (`echo`, `suffix`, ...)
//! are refused by name too.

use crate::generate::sampler::{Penalties, SamplerConfig};
use serde::Deserialize;

mod output;
pub use output::{compile_constraint, output_spec, JsonSchemaFormat, ResponseFormat};

/// An error as the client sees it: an HTTP status and OpenAI's error body.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    /// OpenAI's error `type`.
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header.
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 naming the field at fault.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.to_string()),
            ..ApiError::new(400, "invalid_request_error", message)
        }
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

/// Top-level request fields accepted and ignored: they do not change the
/// output (OpenAI's end-user id, stored-completion metadata and flag).
pub const IGNORED_FIELDS: &[&str] = &["user", "metadata", "store"];

/// Parses a JSON body into `T`; a syntax error, a field of the wrong type or
/// a top-level field `T` does not have (but for [`IGNORED_FIELDS`]) is a
/// 400 whose message (and `param`) names the field.
pub fn parse_body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| {
        ApiError::new(
            400,
            "invalid_request_error",
            format!("malformed JSON body: {e}"),
        )
    })?;
    if !value.is_object() {
        return Err(ApiError::new(
            400,
            "invalid_request_error",
            "the request body must be a JSON object",
        ));
    }
    let mut unknown: Vec<String> = Vec::new();
    let parsed: Result<T, _> = serde_path_to_error::deserialize(serde_ignored::Deserializer::new(
        value,
        &mut |path: serde_ignored::Path<'_>| unknown.push(field_name(&path)),
    ));
    if let Ok(v) = parsed {
        // Any key the request types do not have, at the top level or
        // inside (`messages[0].foo`, `stream_options.foo`,
        // `response_format.json_schema.foo`), but for the top-level
        // fields that do not change the output.
        let refused = unknown
            .iter()
            .find(|p| !IGNORED_FIELDS.contains(&p.as_str()));
        return match refused {
            Some(p) => Err(ApiError::invalid(
                p,
                format!("unsupported field `{p}`: this server cannot honour it (remove it from the request)"),
            )),
            None => Ok(v),
        };
    }
    parsed.map_err(|e| {
        let path = e.path().to_string();
        let text = e.into_inner().to_string();
        if path == "." {
            let missing = text
                .strip_prefix("missing field `")
                .and_then(|r| r.split('`').next());
            return match missing {
                Some(field) => ApiError::invalid(field, format!("invalid request: {text}")),
                None => ApiError::new(
                    400,
                    "invalid_request_error",
                    format!("invalid request: {text}"),
                ),
            };
        }
        ApiError::invalid(&path, format!("invalid `{path}`: {text}"))
    })
}

/// An ignored field's name as the client spells it: `messages[0].foo`
/// (serde_ignored's own text would be `messages.0.foo`, with `?` for each
/// step into an `Option`).
fn field_name(path: &serde_ignored::Path<'_>) -> String {
    use serde_ignored::Path;
    match path {
        Path::Root => String::new(),
        Path::Seq { parent, index } => format!("{}[{index}]", field_name(parent)),
        Path::Map { parent, key } => match field_name(parent) {
            p if p.is_empty() => key.clone(),
            p => format!("{p}.{key}"),
        },
        Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => field_name(parent),
    }
}

/// Checks that the object `v` at `at` has only the keys in `known`; the
/// first other key is a 400 naming it.
pub fn only_keys(v: &serde_json::Value, at: &str, known: &[&str]) -> Result<(), ApiError> {
    let Some(m) = v.as_object() else {
        return Err(ApiError::invalid(at, format!("`{at}` must be an object")));
    };
    match m.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(ApiError::invalid(
            &format!("{at}.{k}"),
            format!(
                "unsupported field `{at}.{k}`: this server cannot honour it (known here: {})",
                known.join(", ")
            ),
        )),
        None => Ok(()),
    }
}

/// A message's `content`: a string, or an array of parts of which only
/// text parts are understood.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a string or an array of content parts")]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
    /// Any other key (refused by name: inside an untagged `content` the
    /// unknown-field check of [`parse_body`] does not see them).
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

/// One entry of `messages`. Its other keys are refused by [`parse_body`];
/// `name` is accepted: the template is given it where it renders tool
/// calls, and otherwise it does not change the prompt.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant message's tool calls (OpenAI's shape).
    #[serde(default)]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A `tool` message: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    /// Fields of OpenAI's assistant messages that clients send back as
    /// they got them: accepted when null (or, `annotations`, empty),
    /// refused by name otherwise.
    #[serde(default)]
    pub refusal: Option<serde_json::Value>,
    #[serde(default)]
    pub audio: Option<serde_json::Value>,
    #[serde(default)]
    pub function_call: Option<serde_json::Value>,
    #[serde(default)]
    pub annotations: Option<serde_json::Value>,
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a string or an array of strings")]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Declares a request body with its own fields plus the fields both
/// endpoints share, and `common()` to read the shared ones as [`Common`].
/// (Not `#[serde(flatten)]`: through it a wrong type would no longer name
/// its field.)
macro_rules! request {
    ($(#[$meta:meta])* $name:ident { $($(#[$fmeta:meta])* $field:ident : $ty:ty,)* }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Deserialize)]
        pub struct $name {
            $($(#[$fmeta])* pub $field: $ty,)*
            #[serde(default)]
            pub model: Option<String>,
            #[serde(default)]
            pub max_tokens: Option<i64>,
            #[serde(default)]
            pub temperature: Option<f32>,
            #[serde(default)]
            pub top_p: Option<f32>,
            #[serde(default)]
            pub top_k: Option<i64>,
            #[serde(default)]
            pub min_p: Option<f32>,
            #[serde(default)]
            pub repeat_penalty: Option<f32>,
            #[serde(default)]
            pub seed: Option<i64>,
            #[serde(default)]
            pub stop: Option<Stop>,
            #[serde(default)]
            pub stream: Option<bool>,
            #[serde(default)]
            pub stream_options: Option<StreamOptions>,
            #[serde(default)]
            pub n: Option<i64>,
            #[serde(default)]
            pub ignore_eos: Option<bool>,
            #[serde(default)]
            pub logprobs: Option<serde_json::Value>,
            #[serde(default)]
            pub top_logprobs: Option<i64>,
            #[serde(default)]
            pub presence_penalty: Option<f32>,
            #[serde(default)]
            pub frequency_penalty: Option<f32>,
            #[serde(default)]
            pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
            #[serde(default)]
            pub speculative: Option<bool>,
        }

        impl $name {
            /// The fields both endpoints share.
            pub fn common(&self) -> Common {
                Common {
                    model: self.model.clone(),
                    max_tokens: self.max_tokens,
                    temperature: self.temperature,
                    top_p: self.top_p,
                    top_k: self.top_k,
                    min_p: self.min_p,
                    repeat_penalty: self.repeat_penalty,
                    seed: self.seed,
                    stop: self.stop.clone(),
                    stream: self.stream,
                    stream_options: self.stream_options.clone(),
                    n: self.n,
                    ignore_eos: self.ignore_eos,
                    logprobs: self.logprobs.clone(),
                    top_logprobs: self.top_logprobs,
                    presence_penalty: self.presence_penalty,
                    frequency_penalty: self.frequency_penalty,
                    logit_bias: self.logit_bias.clone(),
                    speculative: self.speculative,
                }
            }
        }
    };
}

/// The fields both endpoints share.
#[derive(Debug, Clone, Default)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// llama.cpp's extension; 0 or less = off.
    pub top_k: Option<i64>,
    /// llama.cpp's extension.
    pub min_p: Option<f32>,
    /// llama.cpp's extension; 1 = off.
    pub repeat_penalty: Option<f32>,
    /// Absent or -1: a fresh seed per request.
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    /// llama.cpp's extension: keep generating past end-of-sequence tokens.
    pub ignore_eos: Option<bool>,
    /// Chat: `true` (with `top_logprobs`); completions: the number of
    /// alternatives.
    pub logprobs: Option<serde_json::Value>,
    pub top_logprobs: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Token id (as a string) -> bias in [-100, 100].
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// This server's extension: `false` turns speculative decoding off for
    /// the request (it changes no token, only the speed); `true` is
    /// refused by a server started without a drafter.
    pub speculative: Option<bool>,
}

request! {
    /// `POST /v1/chat/completions`.
    ChatRequest {
        messages: Vec<ChatMessage>,
        #[serde(default)]
        max_completion_tokens: Option<i64>,
        #[serde(default)]
        tools: Option<Vec<serde_json::Value>>,
        #[serde(default)]
        tool_choice: Option<serde_json::Value>,
        #[serde(default)]
        parallel_tool_calls: Option<bool>,
        #[serde(default)]
        response_format: Option<ResponseFormat>,
        #[serde(default)]
        json_schema: Option<serde_json::Value>,
        #[serde(default)]
        grammar: Option<String>,
    }
}

/// `prompt`: a string, an array with one string, or token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, an array of one string, or an array of token ids"
)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

request! {
    /// `POST /v1/completions`.
    CompletionRequest {
        prompt: Prompt,
        #[serde(default)]
        echo: Option<bool>,
        #[serde(default)]
        suffix: Option<String>,
        #[serde(default)]
        response_format: Option<ResponseFormat>,
        #[serde(default)]
        json_schema: Option<serde_json::Value>,
        #[serde(default)]
        grammar: Option<String>,
    }
}

/// `input` of `POST /v1/embeddings`: a string, strings, token ids or lists
/// of token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, an array of strings, an array of token ids or an array of arrays of token ids"
)]
pub enum EmbeddingInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// `POST /v1/embeddings`.
#[derive(Debug, Clone, Deserialize)]
pub struct EmbeddingRequest {
    pub input: EmbeddingInput,
    #[serde(default)]
    pub model: Option<String>,
    /// `float` (default) or `base64` (little-endian f32).
    #[serde(default)]
    pub encoding_format: Option<String>,
    /// Accepted only when it is the model's width.
    #[serde(default)]
    pub dimensions: Option<i64>,
}

/// Most inputs per embeddings request (OpenAI's limit).
pub const MAX_EMBEDDING_INPUTS: usize = 2048;

/// `POST /tokenize` (llama-server's).
#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeRequest {
    pub content: String,
    /// Add the BOS token where the model wants one (default false).
    #[serde(default)]
    pub add_special: Option<bool>,
    /// Special tokens' text becomes their ids (default true).
    #[serde(default)]
    pub parse_special: Option<bool>,
    /// Give each id with its piece of text.
    #[serde(default)]
    pub with_pieces: Option<bool>,
}

/// `POST /detokenize` (llama-server's).
#[derive(Debug, Clone, Deserialize)]
pub struct DetokenizeRequest {
    pub tokens: Vec<u32>,
}

/// Most stop strings a request may give.
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 512;
/// Most choices (`n`) per request.
pub const MAX_CHOICES: usize = 16;
/// Most alternatives per token (`top_logprobs`, completions' `logprobs`),
/// OpenAI's limit.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// What the checked common fields ask for.
#[derive(Debug, Clone)]
pub struct Checked {
    /// `None`: until the context is full.
    pub max_tokens: Option<usize>,
    pub sampling: SamplerConfig,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
    /// Choices to generate, each seeded `seed + i`.
    pub n: usize,
    /// Report logprobs with this many alternatives per token.
    pub logprobs: Option<usize>,
    /// Logit bias and presence/frequency penalties.
    pub penalties: Penalties,
    /// `speculative`, as asked.
    pub speculative: Option<bool>,
}

impl Common {
    /// Checks every field and names the one at fault. `fresh_seed` gives
    /// the seed when the request has none (or -1).
    pub fn check(
        &self,
        max_tokens: Option<(i64, &str)>,
        fresh_seed: impl FnOnce() -> u64,
    ) -> Result<Checked, ApiError> {
        let n = match self.n {
            None => 1,
            Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => n as usize,
            Some(n) => {
                return Err(ApiError::invalid(
                    "n",
                    format!("`n` must be from 1 to {MAX_CHOICES}, got {n}"),
                ))
            }
        };
        let top_range = |field: &str, k: i64| {
            if (0..=MAX_TOP_LOGPROBS as i64).contains(&k) {
                Ok(k as usize)
            } else {
                Err(ApiError::invalid(
                    field,
                    format!("`{field}` must be from 0 to {MAX_TOP_LOGPROBS}, got {k}"),
                ))
            }
        };
        let logprobs = match &self.logprobs {
            None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(false)) => {
                if self.top_logprobs.is_some() {
                    return Err(ApiError::invalid(
                        "top_logprobs",
                        "`top_logprobs` needs `logprobs: true`",
                    ));
                }
                None
            }
            Some(serde_json::Value::Bool(true)) => {
                Some(top_range("top_logprobs", self.top_logprobs.unwrap_or(0))?)
            }
            Some(v) => match v.as_i64() {
                Some(k) => Some(top_range("logprobs", k)?),
                None => {
                    return Err(ApiError::invalid(
                        "logprobs",
                        format!("`logprobs` must be a boolean (chat) or a number of alternatives (completions), got {v}"),
                    ))
                }
            },
        };
        let penalty = |field: &str, v: Option<f32>| match v {
            None => Ok(0.0),
            Some(p) if (-2.0..=2.0).contains(&p) => Ok(p),
            Some(p) => Err(ApiError::invalid(
                field,
                format!("`{field}` must be from -2 to 2, got {p}"),
            )),
        };
        let mut logit_bias = Vec::new();
        for (k, &b) in self.logit_bias.iter().flatten() {
            let Ok(id) = k.trim().parse::<u32>() else {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!("`logit_bias` keys are token ids, got {k:?}"),
                ));
            };
            if !(-100.0..=100.0).contains(&b) {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!(
                        "a `logit_bias` value must be from -100 to 100, got {b} for token {id}"
                    ),
                ));
            }
            logit_bias.push((id, b));
        }
        let penalties = Penalties {
            logit_bias,
            presence: penalty("presence_penalty", self.presence_penalty)?,
            frequency: penalty("frequency_penalty", self.frequency_penalty)?,
        };
        let max_tokens = match max_tokens {
            None => None,
            Some((n, field)) if n < 1 => {
                return Err(ApiError::invalid(
                    field,
                    format!("`{field}` must be at least 1, got {n}"),
                ))
            }
            Some((n, _)) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        };
        let d = SamplerConfig::default();
        let temperature = self.temperature.unwrap_or(d.temperature);
        if !(temperature >= 0.0 && temperature.is_finite()) {
            return Err(ApiError::invalid(
                "temperature",
                format!("`temperature` must be 0 (greedy) or positive, got {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(d.top_p);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("`top_p` must be in (0, 1], got {top_p}"),
            ));
        }
        let min_p = self.min_p.unwrap_or(d.min_p);
        if !(0.0..=1.0).contains(&min_p) {
            return Err(ApiError::invalid(
                "min_p",
                format!("`min_p` must be in [0, 1], got {min_p}"),
            ));
        }
        let repeat_penalty = self.repeat_penalty.unwrap_or(d.repeat_penalty);
        if !(repeat_penalty > 0.0 && repeat_penalty.is_finite()) {
            return Err(ApiError::invalid(
                "repeat_penalty",
                format!("`repeat_penalty` must be positive, got {repeat_penalty}"),
            ));
        }
        let top_k = match self.top_k {
            None => d.top_k,
            Some(k) if k <= 0 => 0,
            Some(k) => usize::try_from(k).unwrap_or(usize::MAX),
        };
        let seed = match self.seed {
            None | Some(-1) => fresh_seed(),
            Some(s) => s as u64,
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOP_STRINGS {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "at most {MAX_STOP_STRINGS} stop strings, got {}",
                    stop.len()
                ),
            ));
        }
        if let Some(s) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "a stop string is at most {MAX_STOP_BYTES} bytes, got {}",
                    s.len()
                ),
            ));
        }
        let stream = self.stream.unwrap_or(false);
        Ok(Checked {
            max_tokens,
            sampling: SamplerConfig {
                temperature,
                top_k,
                top_p,
                min_p,
                repeat_penalty,
                repeat_last_n: d.repeat_last_n,
                seed,
            },
            stop,
            stream,
            include_usage: stream
                && self
                    .stream_options
                    .as_ref()
                    .and_then(|o| o.include_usage)
                    .unwrap_or(false),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            n,
            logprobs,
            penalties,
            speculative: self.speculative,
        })
    }
}

impl ChatRequest {
    /// `max_completion_tokens` wins over the older `max_tokens`.
    pub fn max_tokens(&self) -> Option<(i64, &'static str)> {
        match (self.max_completion_tokens, self.max_tokens) {
            (Some(n), _) => Some((n, "max_completion_tokens")),
            (None, Some(n)) => Some((n, "max_tokens")),
            (None, None) => None,
        }
    }

    /// The messages as the chat template sees them.
    pub fn messages(&self) -> Result<Vec<crate::generate::chat::Message>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid("messages", "`messages` is empty"));
        }
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                for (field, v) in [
                    ("refusal", &m.refusal),
                    ("audio", &m.audio),
                    ("function_call", &m.function_call),
                    ("annotations", &m.annotations),
                ] {
                    let empty = match v {
                        None | Some(serde_json::Value::Null) => true,
                        Some(serde_json::Value::Array(a)) => field == "annotations" && a.is_empty(),
                        Some(_) => false,
                    };
                    if !empty {
                        let at = format!("messages[{i}].{field}");
                        return Err(ApiError::invalid(
                            &at,
                            format!("`{at}` is not supported (send it as null or leave it out)"),
                        ));
                    }
                }
                let content = match &m.content {
                    None => String::new(),
                    Some(Content::Text(s)) => s.clone(),
                    Some(Content::Parts(parts)) => {
                        let mut s = String::new();
                        for (j, p) in parts.iter().enumerate() {
                            match (p.kind.as_str(), &p.text) {
                                ("text", Some(t)) => {
                                    if let Some(k) = p.other.keys().next() {
                                        let at = format!("messages[{i}].content[{j}].{k}");
                                        return Err(ApiError::invalid(
                                            &at,
                                            format!("unsupported field `{at}`: a text part has `type` and `text`"),
                                        ));
                                    }
                                    s.push_str(t)
                                }
                                _ => {
                                    return Err(ApiError::invalid(
                                        &format!("messages[{i}].content[{j}]"),
                                        format!(
                                            "only text content parts are supported, got type `{}`",
                                            p.kind
                                        ),
                                    ))
                                }
                            }
                        }
                        s
                    }
                };
                Ok(crate::generate::chat::Message {
                    role: m.role.clone(),
                    content,
                })
            })
            .collect()
    }
}

impl ChatRequest {
    /// The messages as JSON for a template that reads tool calls: text
    /// content, and each call's `arguments` (JSON text on the wire) as the
    /// JSON value it spells.
    pub fn messages_json(&self) -> Result<Vec<serde_json::Value>, ApiError> {
        let texts = self.messages()?;
        let mut out = Vec::with_capacity(texts.len());
        for (i, (m, t)) in self.messages.iter().zip(texts).enumerate() {
            let mut v = serde_json::json!({"role": t.role, "content": t.content});
            if let Some(calls) = &m.tool_calls {
                let mut parsed = Vec::with_capacity(calls.len());
                for (j, c) in calls.iter().enumerate() {
                    let call = format!("messages[{i}].tool_calls[{j}]");
                    only_keys(c, &call, &["id", "type", "function"])?;
                    match c.get("type") {
                        None | Some(serde_json::Value::Null) => {}
                        Some(t) if t == "function" => {}
                        Some(t) => {
                            return Err(ApiError::invalid(
                                &format!("{call}.type"),
                                format!("`{call}.type` must be `function`, got {t}"),
                            ))
                        }
                    }
                    let at = format!("{call}.function");
                    let f = c
                        .get("function")
                        .ok_or_else(|| ApiError::invalid(&at, format!("`{at}` is missing")))?;
                    only_keys(f, &at, &["name", "arguments"])?;
                    let name = f.get("name").and_then(|n| n.as_str()).ok_or_else(|| {
                        ApiError::invalid(
                            &format!("{at}.name"),
                            format!("`{at}.name` must be a string"),
                        )
                    })?;
                    let args = match f.get("arguments") {
                        None | Some(serde_json::Value::Null) => serde_json::json!({}),
                        Some(serde_json::Value::String(s)) => {
                            serde_json::from_str(s).map_err(|e| {
                                ApiError::invalid(
                                    &format!("{at}.arguments"),
                                    format!("`{at}.arguments` is not JSON: {e}"),
                                )
                            })?
                        }
                        Some(other) => other.clone(),
                    };
                    parsed.push(serde_json::json!({
                        "id": c.get("id").cloned().unwrap_or(serde_json::Value::Null),
                        "type": "function",
                        "function": {"name": name, "arguments": args},
                    }));
                }
                v["tool_calls"] = serde_json::Value::Array(parsed);
            }
            if let Some(id) = &m.tool_call_id {
                v["tool_call_id"] = serde_json::json!(id);
            }
            if let Some(n) = &m.name {
                v["name"] = serde_json::json!(n);
            }
            out.push(v);
        }
        Ok(out)
    }
}

impl CompletionRequest {
    pub fn check_extras(&self) -> Result<(), ApiError> {
        if self.echo == Some(true) {
            return Err(ApiError::invalid("echo", "echo is not supported"));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid("suffix", "suffix is not supported"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
