//! `llama-graph serve`: an OpenAI-compatible HTTP server.
//!
//! [`engine`] turns token-id requests into token streams; the HTTP layer
//! (routing, JSON, SSE, detokenization, stop strings, limits) talks to it
//! only through [`engine::EngineHandle`].
pub mod engine;
