//! Answers checked against the OpenAPI document (`dedupd::admin::openapi`): the status must
//! be one the operation documents, the content type one documented for that status, and a
//! JSON body must validate against the documented schema (JSON Schema 2020-12, which
//! OpenAPI 3.1 schemas are), `$ref`s resolved within the document's components. Requests
//! no route serves are checked against `ErrorBody` (the 404 and 405 fallbacks).

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use axum::http::{HeaderMap, StatusCode};
use serde_json::{json, Value};

/// The operation of the document that serves `method path`, as `(path template, operation)`.
pub fn operation(method: &str, path: &str) -> Option<(String, &'static Value)> {
    let doc = dedupd::admin::openapi();
    let method = method.to_ascii_lowercase();
    let segments: Vec<&str> = path.split('/').collect();
    doc["paths"]
        .as_object()?
        .iter()
        .find_map(|(template, item)| {
            let parts: Vec<&str> = template.split('/').collect();
            let matches = parts.len() == segments.len()
                && parts.iter().zip(&segments).all(|(t, s)| {
                    (t.starts_with('{') && t.ends_with('}') && !s.is_empty()) || t == s
                });
            let op = item.get(&method)?;
            matches.then(|| (template.clone(), op))
        })
}

/// A validator of `schema`, with the document's components beside it so `$ref`s resolve.
fn validator(schema: &Value) -> Arc<jsonschema::Validator> {
    static CACHE: LazyLock<Mutex<HashMap<String, Arc<jsonschema::Validator>>>> =
        LazyLock::new(Default::default);
    let key = schema.to_string();
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    cache
        .entry(key)
        .or_insert_with(|| {
            let root = json!({
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "components": dedupd::admin::openapi()["components"],
                "allOf": [schema],
            });
            Arc::new(
                jsonschema::draft202012::new(&root).unwrap_or_else(|e| {
                    panic!("the documented schema {schema} does not compile: {e}")
                }),
            )
        })
        .clone()
}

/// Whether `value` validates against `schema` (a schema of the document, `$ref`s resolved
/// in its components).
pub fn validates(schema: &Value, value: &Value) -> bool {
    validator(schema).is_valid(value)
}

/// `schema` itself, or the component schema it is a `$ref` to.
pub fn resolved(schema: &'static Value) -> &'static Value {
    match schema["$ref"].as_str() {
        Some(r) => {
            let name = r
                .strip_prefix("#/components/schemas/")
                .unwrap_or_else(|| panic!("a $ref outside the components: {r}"));
            &dedupd::admin::openapi()["components"]["schemas"][name]
        }
        None => schema,
    }
}

/// Fails the test unless the answer is one the document describes.
pub fn check_answer(
    method: &str,
    path: &str,
    status: StatusCode,
    headers: &HeaderMap,
    body: &[u8],
) {
    let status_text = status.as_u16().to_string();
    let what = format!("{method} {path} answered {status}");
    let media = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        });
    let schema = match operation(method, path) {
        Some((template, op)) => {
            let response = op["responses"].get(&status_text).unwrap_or_else(|| {
                panic!("{what}, a status `{method} {template}` does not document")
            });
            let Some(content) = response.get("content").and_then(Value::as_object) else {
                assert!(
                    body.is_empty(),
                    "{what} with a body the document does not describe"
                );
                return;
            };
            let media = media.unwrap_or_else(|| panic!("{what} without a content type"));
            let Some(documented) = content.get(&media) else {
                panic!(
                    "{what} with content type {media}; `{method} {template}` documents {:?}",
                    content.keys().collect::<Vec<_>>()
                );
            };
            if media != "application/json" {
                return;
            }
            documented["schema"].clone()
        }
        // The JSON 404 (no route) and 405 (no such method) and what `guard` refuses
        // before routing.
        None => {
            assert_eq!(media.as_deref(), Some("application/json"), "{what}");
            json!({"$ref": "#/components/schemas/ErrorBody"})
        }
    };
    let value: Value = serde_json::from_slice(body)
        .unwrap_or_else(|e| panic!("{what} with a body that is not JSON ({e})"));
    let errors: Vec<String> = validator(&schema)
        .iter_errors(&value)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "{what} with a body that does not match its documented schema {schema}:\n{}\nbody: {value}",
        errors.join("\n")
    );
}
