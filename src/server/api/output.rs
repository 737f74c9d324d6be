//! Structured output: `response_format` (and llama-server's top-level
//! `json_schema` / `grammar`) to the constraint the sampler follows.

use super::ApiError;
use crate::generate::constraint::{Constraint, GrammarSpec, Grammars};
use serde::Deserialize;

/// `response_format`: `{"type": "text" | "json_object" | "json_schema"}`;
/// a `json_schema` carries `{"name", "schema", "strict"}` (llama-server
/// also reads a `schema` beside `type`).
#[derive(Debug, Clone, Deserialize)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub json_schema: Option<JsonSchemaFormat>,
    #[serde(default)]
    pub schema: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct JsonSchemaFormat {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub schema: Option<serde_json::Value>,
    #[serde(default)]
    pub strict: Option<bool>,
}

/// What the output must follow, from `response_format` or llama-server's
/// top-level `json_schema` / `grammar` (at most one of them), with the
/// field that asked for it (for errors).
pub fn output_spec(
    response_format: Option<&ResponseFormat>,
    json_schema: Option<&serde_json::Value>,
    grammar: Option<&str>,
) -> Result<Option<(GrammarSpec, &'static str)>, ApiError> {
    let mut specs: Vec<(GrammarSpec, &'static str)> = Vec::new();
    if let Some(rf) = response_format {
        match rf.kind.as_str() {
            "text" => {}
            "json_object" => specs.push(match &rf.schema {
                Some(s) => (GrammarSpec::JsonSchema(s.clone()), "response_format.schema"),
                None => (GrammarSpec::JsonObject, "response_format"),
            }),
            "json_schema" => {
                let schema = rf
                    .json_schema
                    .as_ref()
                    .and_then(|j| j.schema.clone())
                    .or_else(|| rf.schema.clone());
                match schema {
                    Some(s) => specs.push((
                        GrammarSpec::JsonSchema(s),
                        "response_format.json_schema.schema",
                    )),
                    None => {
                        return Err(ApiError::invalid(
                            "response_format.json_schema",
                            "`response_format.json_schema.schema` is missing",
                        ))
                    }
                }
            }
            other => {
                return Err(ApiError::invalid(
                    "response_format.type",
                    format!(
                        "`response_format.type` must be `text`, `json_object` or `json_schema`, got `{other}`"
                    ),
                ))
            }
        }
    }
    if let Some(s) = json_schema {
        specs.push((GrammarSpec::JsonSchema(s.clone()), "json_schema"));
    }
    if let Some(g) = grammar {
        specs.push((GrammarSpec::from_grammar_text(g), "grammar"));
    }
    if specs.len() > 1 {
        let names: Vec<&str> = specs.iter().map(|s| s.1).collect();
        return Err(ApiError::invalid(
            specs[1].1,
            format!(
                "give one output constraint, not several: {}",
                names.join(", ")
            ),
        ));
    }
    Ok(specs.pop())
}

/// Compiles the output constraint; a schema or grammar llguidance refuses
/// is a 400 naming `field` and what it refused.
pub fn compile_constraint(
    grammars: &Grammars,
    spec: &GrammarSpec,
    field: &str,
) -> Result<Constraint, ApiError> {
    grammars.compile(spec).map_err(|e| {
        let what = match spec {
            GrammarSpec::JsonObject | GrammarSpec::JsonSchema(_) => "the JSON schema",
            GrammarSpec::Lark(_) | GrammarSpec::Gbnf(_) => "the grammar",
        };
        ApiError::invalid(field, format!("`{field}`: {what} cannot be used: {e}"))
    })
}
