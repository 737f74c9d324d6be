//! Chat prompts.
//!
//! * Llama 3 (Meta checkpoints): built in, token for token as Meta's
//!   `ChatFormat.encode_dialog_prompt` (`llama_models/llama3/chat_format.py`):
//!   `<|begin_of_text|>`, then per message a header
//!   (`<|start_header_id|>role<|end_header_id|>` + encoded `"\n\n"`), the
//!   content encoded on its own, `<|eot_id|>`; finally the assistant header.
//! * GGUF models and Hugging Face directories: the Jinja template in
//!   `tokenizer.chat_template` (or `chat_template.jinja` /
//!   `tokenizer_config.json`), rendered with minijinja as transformers'
//!   `apply_chat_template` renders it (trim_blocks, lstrip_blocks,
//!   Python-compatible string methods, `raise_exception`), with bounded
//!   fuel. Checked on the templates of the Qwen2/2.5/3, Phi-3/3.5, Mistral
//!   and Gemma families (tests/chat_format.rs).

use crate::session::{Model, ModelFormat};
use crate::tokenizer::{EncodeOptions, Tokenizer};
use serde::Serialize;
use thiserror::Error;

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    /// `system`, `user`, `assistant` (or `tool`, as the template knows it).
    pub role: String,
    /// The message's text.
    pub content: String,
}

impl Message {
    /// A message from `role` saying `content`.
    pub fn new(role: &str, content: &str) -> Self {
        Message {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

/// Why a conversation could not be put into the model's chat format.
#[derive(Debug, Error)]
pub enum ChatError {
    /// The Llama 3 format needs this special token and the vocabulary
    /// lacks it.
    #[error("the tokenizer has no `{0}` token, which the Llama 3 chat format needs")]
    MissingSpecial(&'static str),
    /// The Jinja template failed to render (or ran out of its fuel).
    #[error("chat template: {0}")]
    Template(String),
    /// The model (named) has no tokenizer.
    #[error("{0} has no tokenizer, which a chat needs")]
    NoTokenizer(String),
    /// The model has no chat template and is not a Meta checkpoint.
    #[error("this model has no chat template (GGUF tokenizer.chat_template, or tokenizer_config.json's chat_template); run without --chat")]
    NoTemplate,
}

/// A conversation in the model's own chat format, ending with the
/// assistant's header, as tokens with exactly one BOS: the GGUF's Jinja
/// template when it has one, Meta's Llama 3 format for Meta checkpoints.
pub fn conversation_tokens(model: &Model, messages: &[Message]) -> Result<Vec<u32>, ChatError> {
    let tok = model
        .tokenizer
        .as_ref()
        .ok_or_else(|| ChatError::NoTokenizer(model.path.display().to_string()))?;
    ChatFormat::of(model).tokens(tok, messages)
}

/// A model's chat format, detached from the model (for a server that
/// keeps the tokenizer and the format while the engine owns the weights).
#[derive(Debug, Clone)]
pub struct ChatFormat {
    template: Option<ChatTemplate>,
    format: ModelFormat,
}

impl ChatFormat {
    /// The format `model` uses: its Jinja template, else Llama 3's for a
    /// Meta checkpoint.
    pub fn of(model: &Model) -> ChatFormat {
        ChatFormat {
            template: model.chat_template.clone().map(ChatTemplate::new),
            format: model.format,
        }
    }

    /// Whether there is a format at all (a GGUF file without a template
    /// has none).
    pub fn available(&self) -> bool {
        self.template.is_some() || self.format == ModelFormat::MetaDir
    }

    /// The Jinja template's source, if the format is one.
    pub fn template_source(&self) -> Option<&str> {
        self.template.as_ref().map(|t| t.source.as_str())
    }

    /// The conversation as tokens through the Jinja template, messages as
    /// JSON (OpenAI's shape: `tool_calls`, `tool` messages) and `tools`
    /// given to the template when it reads them.
    pub fn tokens_json(
        &self,
        tok: &Tokenizer,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
    ) -> Result<Vec<u32>, ChatError> {
        let Some(t) = &self.template else {
            return Err(ChatError::NoTemplate);
        };
        let piece = |id: Option<u32>| {
            id.and_then(|i| tok.token_bytes(i))
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default()
        };
        let rendered = t.render_json(
            messages,
            tools,
            true,
            &piece(tok.bos_id()),
            &piece(tok.eos_id()),
        )?;
        Ok(tok.encode(
            &rendered,
            EncodeOptions {
                add_bos: false,
                parse_special: true,
            },
        ))
    }

    /// The conversation as tokens, ending with the assistant's header.
    pub fn tokens(&self, tok: &Tokenizer, messages: &[Message]) -> Result<Vec<u32>, ChatError> {
        match (&self.template, self.format) {
            (Some(t), _) => {
                let piece = |id: Option<u32>| {
                    id.and_then(|i| tok.token_bytes(i))
                        .map(|b| String::from_utf8_lossy(b).into_owned())
                        .unwrap_or_default()
                };
                let rendered =
                    t.render(messages, true, &piece(tok.bos_id()), &piece(tok.eos_id()))?;
                // The template spells out any BOS it wants; never add another.
                Ok(tok.encode(
                    &rendered,
                    EncodeOptions {
                        add_bos: false,
                        parse_special: true,
                    },
                ))
            }
            (None, ModelFormat::MetaDir) => llama3_dialog_tokens(tok, messages, true),
            (None, ModelFormat::Gguf | ModelFormat::HfDir) => Err(ChatError::NoTemplate),
        }
    }
}

/// What a conversation that outgrows the context does (llama.cpp's
/// `--context-shift` / `--no-context-shift`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ContextPolicy {
    /// Drop the oldest turns after the system prompt and feed the rest
    /// again.
    #[default]
    Shift,
    /// Refuse the turn, saying how many tokens it needs.
    Refuse,
}

impl ContextPolicy {
    /// The policy's flag value (`shift`, `refuse`).
    pub fn name(self) -> &'static str {
        match self {
            ContextPolicy::Shift => "shift",
            ContextPolicy::Refuse => "refuse",
        }
    }
}

impl std::str::FromStr for ContextPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "shift" => Ok(ContextPolicy::Shift),
            "refuse" => Ok(ContextPolicy::Refuse),
            _ => Err(format!(
                "unknown context policy `{s}`: use `shift` or `refuse`"
            )),
        }
    }
}

/// Why a conversation could not be fitted into the context.
#[derive(Debug, Error)]
pub enum FitError {
    /// The chat template failed.
    #[error(transparent)]
    Chat(#[from] ChatError),
    /// The `refuse` policy and a conversation that leaves too little room.
    #[error("the conversation takes {tokens} tokens; with {reserve} for the reply it exceeds the context of {context} tokens (the context policy is `refuse`: start over, use a larger context, or the `shift` policy)")]
    Refused {
        /// The conversation's tokens.
        tokens: usize,
        /// Tokens kept for the reply.
        reserve: usize,
        /// The context's size.
        context: usize,
    },
    /// Even with every droppable turn dropped, the rest does not fit.
    #[error("the system prompt and the last message alone take {tokens} tokens; with {reserve} for the reply they exceed the context of {context} tokens (shorten the message or use a larger context)")]
    TooLong {
        /// The system prompt's and the last message's tokens.
        tokens: usize,
        /// Tokens kept for the reply.
        reserve: usize,
        /// The context's size.
        context: usize,
    },
}

/// A conversation fitted into the context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fitted {
    /// The conversation's tokens, ending with the assistant's header.
    pub tokens: Vec<u32>,
    /// How many messages after the leading system messages were dropped
    /// (the oldest ones): `messages[s..s + dropped]` where `s` counts the
    /// leading system messages.
    pub dropped: usize,
    /// Where the kept messages start (the number of leading system
    /// messages).
    pub kept_from: usize,
}

impl ChatFormat {
    /// Renders `messages` so that `reserve` tokens for the reply fit after
    /// them in `context`. When they do not fit, [`ContextPolicy::Refuse`]
    /// fails with the numbers; [`ContextPolicy::Shift`] drops whole turns
    /// (a user message and the replies after it), oldest first, after the
    /// leading system messages, until the rest also takes at most `target`
    /// tokens (a chat passes half its context so that it does not shift on
    /// every later turn), and never the last message.
    pub fn fit(
        &self,
        tok: &Tokenizer,
        messages: &[Message],
        context: usize,
        reserve: usize,
        target: usize,
        policy: ContextPolicy,
    ) -> Result<Fitted, FitError> {
        let tokens = self.tokens(tok, messages)?;
        let fits = |n: usize| n + reserve <= context;
        if fits(tokens.len()) {
            return Ok(Fitted {
                tokens,
                dropped: 0,
                kept_from: 0,
            });
        }
        if policy == ContextPolicy::Refuse {
            return Err(FitError::Refused {
                tokens: tokens.len(),
                reserve,
                context,
            });
        }
        let sys = messages.iter().take_while(|m| m.role == "system").count();
        let last = messages.len().saturating_sub(1).max(sys);
        let mut tokens = tokens;
        let mut start = sys;
        let mut kept: Vec<Message> = Vec::with_capacity(messages.len());
        while start < last && (!fits(tokens.len()) || tokens.len() > target) {
            // One turn: the message at `start` and every non-user message
            // after it.
            start += 1;
            while start < last && messages[start].role != "user" {
                start += 1;
            }
            kept.clear();
            kept.extend_from_slice(&messages[..sys]);
            kept.extend_from_slice(&messages[start..]);
            tokens = self.tokens(tok, &kept)?;
        }
        if !fits(tokens.len()) {
            return Err(FitError::TooLong {
                tokens: tokens.len(),
                reserve,
                context,
            });
        }
        Ok(Fitted {
            tokens,
            dropped: start - sys,
            kept_from: sys,
        })
    }
}

/// Meta's Llama 3 dialog prompt, as tokens (exactly one BOS).
pub fn llama3_dialog_tokens(
    tok: &Tokenizer,
    messages: &[Message],
    add_generation_prompt: bool,
) -> Result<Vec<u32>, ChatError> {
    let special = |s: &'static str| tok.token_to_id(s).ok_or(ChatError::MissingSpecial(s));
    let (bot, sh, eh, eot) = (
        special("<|begin_of_text|>")?,
        special("<|start_header_id|>")?,
        special("<|end_header_id|>")?,
        special("<|eot_id|>")?,
    );
    let plain = EncodeOptions {
        add_bos: false,
        parse_special: false,
    };
    let header = |out: &mut Vec<u32>, role: &str| {
        out.push(sh);
        out.extend(tok.encode(if role == "tool" { "ipython" } else { role }, plain));
        out.push(eh);
        out.extend(tok.encode("\n\n", plain));
    };
    let mut out = vec![bot];
    for m in messages {
        header(&mut out, &m.role);
        out.extend(tok.encode(&m.content, plain));
        out.push(eot);
    }
    if add_generation_prompt {
        header(&mut out, "assistant");
    }
    Ok(out)
}

/// A model's own Jinja chat template.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    /// The template's Jinja source.
    pub source: String,
    /// What `strftime_now` reads: the clock (`None`) or a fixed time
    /// (seconds since 1970, UTC).
    now: Option<i64>,
}

/// Template evaluation budget: generous for real templates, finite for
/// hostile ones.
const TEMPLATE_FUEL: u64 = 5_000_000;

impl ChatTemplate {
    /// A template from its Jinja source (checked when rendered).
    pub fn new(source: impl Into<String>) -> Self {
        ChatTemplate {
            source: source.into(),
            now: None,
        }
    }

    /// The same template rendering as if the time were `unix_secs` (UTC):
    /// what `strftime_now` gives templates that print today's date (Llama
    /// 3.2 and 3.3), for reproducible prompts and tests.
    pub fn at_time(mut self, unix_secs: i64) -> Self {
        self.now = Some(unix_secs);
        self
    }

    /// Renders the conversation to text (special tokens spelled out).
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String, ChatError> {
        let messages =
            serde_json::to_value(messages).map_err(|e| ChatError::Template(e.to_string()))?;
        self.render_json(&messages, None, add_generation_prompt, bos_token, eos_token)
    }

    /// [`ChatTemplate::render`] with messages as JSON, and `tools` (a list
    /// of OpenAI tool objects) for templates that read it.
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String, ChatError> {
        let mut env = minijinja::Environment::new();
        // The options transformers' `apply_chat_template` (and llama.cpp)
        // render chat templates with: a newline after a block tag is
        // dropped, and spaces before a block tag on its line.
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| ChatError::Template(e.to_string()))?,
        );
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_filter("tojson", tojson);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        // transformers and llama.cpp give templates `strftime_now(fmt)`,
        // Python's `datetime.now().strftime(fmt)`; here in UTC.
        let now = self.now;
        env.add_function(
            "strftime_now",
            move |fmt: String| -> Result<String, minijinja::Error> {
                let secs = match now {
                    Some(t) => t,
                    None => std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs() as i64),
                };
                strftime(&fmt, secs)
                    .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e))
            },
        );
        env.add_template("chat", &self.source)
            .map_err(|e| ChatError::Template(e.to_string()))?;
        let t = env
            .get_template("chat")
            .map_err(|e| ChatError::Template(e.to_string()))?;
        t.render(minijinja::context! {
            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
            tools => tools.map(|t| minijinja::Value::from(minijinja::value::Serde(t))),
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        })
        .map_err(|e| ChatError::Template(e.to_string()))
    }
}

/// Python's `time.strftime(fmt)` at `unix_secs` (UTC, C locale) for the
/// directives chat templates use: `%d %e %m %Y %y %b %B %a %A %H %I %M %S
/// %p %j %%`. Any other directive is an error naming it.
fn strftime(fmt: &str, unix_secs: i64) -> Result<String, String> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday.
    let weekday = (days + 4).rem_euclid(7) as usize;
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let mut out = String::with_capacity(fmt.len() + 16);
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            return Err("strftime_now: the format ends with a lone %".into());
        };
        let m = MONTHS[month as usize - 1];
        let w = DAYS[weekday];
        match d {
            'd' => out.push_str(&format!("{day:02}")),
            'e' => out.push_str(&format!("{day:2}")),
            'm' => out.push_str(&format!("{month:02}")),
            'Y' => out.push_str(&year.to_string()),
            'y' => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            'b' => out.push_str(&m[..3]),
            'B' => out.push_str(m),
            'a' => out.push_str(&w[..3]),
            'A' => out.push_str(w),
            'H' => out.push_str(&format!("{hour:02}")),
            'I' => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            'M' => out.push_str(&format!("{minute:02}")),
            'S' => out.push_str(&format!("{second:02}")),
            'p' => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            'j' => out.push_str(&format!("{yday:03}")),
            '%' => out.push('%'),
            other => return Err(format!("strftime_now: %{other} is not supported")),
        }
    }
    Ok(out)
}

/// The proleptic Gregorian date of day `z` since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Days since 1970-01-01 of a proleptic Gregorian date.
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// transformers' `tojson` filter, which chat templates are written for:
/// Python's `json.dumps(x, ensure_ascii=False, indent=indent,
/// sort_keys=sort_keys)`, so `", "` and `": "` between items (`","` at line
/// ends when indented), keys in the order the request gave them, and no
/// HTML escaping (minijinja's own `tojson` escapes `'`, `<`, `>` and `&`
/// and has other separators). A positional argument is the indent, as in
/// Jinja's `tojson`.
fn tojson(
    value: &minijinja::Value,
    indent: Option<minijinja::Value>,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, minijinja::Error> {
    use serde_json::ser::{PrettyFormatter, Serializer};
    let bad = |e: &dyn std::fmt::Display| {
        minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            format!("tojson: {e}"),
        )
    };
    let indent: Option<usize> = match indent {
        Some(v) if !v.is_none() => Some(usize::try_from(v)?),
        _ => kwargs.get("indent")?,
    };
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut v = serde_json::to_value(value).map_err(|e| bad(&e))?;
    if sort_keys == Some(true) {
        sort_keys_of(&mut v);
    }
    let mut out = Vec::new();
    match indent {
        Some(n) => {
            let pad = vec![b' '; n.min(64)];
            v.serialize(&mut Serializer::with_formatter(
                &mut out,
                PrettyFormatter::with_indent(&pad),
            ))
        }
        None => v.serialize(&mut Serializer::with_formatter(&mut out, PythonCompact)),
    }
    .map_err(|e| bad(&e))?;
    let s = String::from_utf8(out).map_err(|e| bad(&e))?;
    if ensure_ascii != Some(true) {
        return Ok(minijinja::Value::from(s));
    }
    // Non-ASCII characters only occur inside strings: escape them as
    // Python does (lowercase hex, surrogate pairs).
    let mut a = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_ascii() {
            a.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                a.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    Ok(minijinja::Value::from(a))
}

/// Python's compact JSON separators: `", "` and `": "`.
struct PythonCompact;

/// `", "` before every item but the first.
fn item_separator<W: ?Sized + std::io::Write>(w: &mut W, first: bool) -> std::io::Result<()> {
    if first {
        Ok(())
    } else {
        w.write_all(b", ")
    }
}

impl serde_json::ser::Formatter for PythonCompact {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        item_separator(w, first)
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        item_separator(w, first)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

fn sort_keys_of(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            let mut items: Vec<(String, serde_json::Value)> =
                std::mem::take(m).into_iter().collect();
            items.sort_by(|a, b| a.0.cmp(&b.0));
            for (k, mut x) in items {
                sort_keys_of(&mut x);
                m.insert(k, x);
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(sort_keys_of),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_template_renders() {
        let t = ChatTemplate::new(
            "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
        );
        let s = t
            .render(&[Message::new("user", "Hi")], true, "", "")
            .unwrap();
        assert_eq!(s, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn hostile_templates_fail_cleanly() {
        let t = ChatTemplate::new(
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        );
        assert!(t.render(&[], true, "", "").is_err());
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}");
        assert!(t
            .render(&[], true, "", "")
            .unwrap_err()
            .to_string()
            .contains("no system role"));
        assert!(ChatTemplate::new("{% if %}")
            .render(&[], true, "", "")
            .is_err());
    }
}
