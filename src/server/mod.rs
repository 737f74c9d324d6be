//! `llama-graph serve`: an OpenAI-compatible HTTP server.
//!
//! [`engine`] turns token-id requests into token streams, running several
//! sequences per graph step as [`scheduler`] plans them; [`http`] is the
//! HTTP side (routes, OpenAI JSON and SSE, authentication, limits), which
//! talks to the engine only through [`engine::EngineHandle`]; [`api`] holds
//! the wire format and its checks; [`text`] turns token ids into response
//! text (streaming UTF-8 decoding, stop strings); [`tools`] renders
//! `tools` into the model's chat format and parses its calls back.
pub mod api;
pub mod engine;
pub mod http;
pub mod scheduler;
pub mod text;
pub mod tools;

pub use http::{router, serve, AppState, Loaded, ServerOptions};
