//! `/openapi.json`: the OpenAPI 3.1 document of the API, generated from the route code.
//!
//! Each handler carries a `#[utoipa::path]` annotation (method, path, summary, parameters,
//! request body, responses with their body types, security), and the body types derive
//! `utoipa::ToSchema` next to their `Serialize`/`Deserialize`. `routes::api` registers
//! every handler with `utoipa_axum::routes!`, which routes it at the path and method its
//! annotation names and adds the operation to the document: the router and the document
//! are built from one list, so a route cannot be served undocumented or documented
//! unserved. What the annotations cannot see is added here: the answers every route can
//! give because of `guard` (see [`openapi`]), the bearer security scheme, and the title.
//!
//! Why utoipa (with utoipa-axum) and not aide: utoipa-axum 0.3 targets axum 0.8 with no
//! default features, and utoipa without default features adds four crates to the build
//! (utoipa, utoipa-gen, utoipa-axum, pastey) and no work beyond building this document
//! once. The handlers keep their signatures (`Result<Path<_>, PathRejection>` extractors
//! that turn rejections into `ApiError`s, `ApiResult<Json<T>>`) and their documentation
//! sits on them. aide infers operations from extractor and response types through its
//! own traits, which these wrapped extractors and `ApiError` would need implementations
//! of, and it brings `schemars` as a second schema derive. What utoipa's annotation does
//! not check is that the body type it names is the one the handler returns:
//! `tests/admin.rs` does, by validating every JSON answer the tests get against the schema
//! documented for its route and status.

use std::sync::LazyLock;

use serde_json::{json, Map, Value};

/// The answers every route can give besides its own, from `guard`: `(status, description,
/// which routes)`.
const GUARD_ANSWERS: &[(u16, &str, Applies)] = &[
    (401, "Bearer token missing", Applies::Secured),
    (
        403,
        "Bearer token wrong, or a write from a web page of another origin",
        Applies::SecuredOrWrite,
    ),
    (
        415,
        "A form content type without a token (a web page can send it cross-origin)",
        Applies::Write,
    ),
    (
        421,
        "Host is not one of this server's names (http.allowed_hosts)",
        Applies::All,
    ),
    (
        503,
        "Engine not ready or stopped; or busy (admission queue full) / timed out, with Retry-After",
        Applies::All,
    ),
];

#[derive(Clone, Copy)]
enum Applies {
    All,
    /// Operations that name the bearer security scheme.
    Secured,
    /// Operations that are not GET.
    Write,
    SecuredOrWrite,
}

/// The OpenAPI 3.1 document, built once. Besides its own statuses, every route can answer
/// 421 (a `Host` that is not this server's) and 503 (queue full or request timeout, with
/// `Retry-After`); every route that needs the token 401 and 403; every route that is not a
/// GET also 403 (another `Origin`) and 415 (a form content type without a token). All of
/// them with the `ErrorBody` schema.
pub fn openapi() -> &'static Value {
    static DOC: LazyLock<Value> = LazyLock::new(build);
    &DOC
}

fn build() -> Value {
    let generated = super::routes::api(0).into_openapi();
    let mut doc = serde_json::to_value(&generated).unwrap_or_else(|_| json!({}));
    doc["openapi"] = json!("3.1.0");
    doc["info"] = json!({
        "title": "dedupd admin and ingest API",
        "version": env!("CARGO_PKG_VERSION"),
        "description": "Every error answer has the ErrorBody schema. With a token configured (http.token), every route marked with the bearer scheme needs `Authorization: Bearer <token>`; record lists then leave out what could reveal a payload without it.",
    });
    doc["components"]["securitySchemes"] = json!({"bearer": {"type": "http", "scheme": "bearer"}});
    let error = json!({"$ref": "#/components/schemas/ErrorBody"});
    if let Some(paths) = doc["paths"].as_object_mut() {
        for item in paths.values_mut() {
            let Some(ops) = item.as_object_mut() else {
                continue;
            };
            for (method, op) in ops.iter_mut() {
                let secured = op.get("security").is_some();
                let write = method != "get";
                let responses = op["responses"].as_object_mut();
                let Some(responses) = responses else { continue };
                for (status, description, applies) in GUARD_ANSWERS {
                    let applies = match applies {
                        Applies::All => true,
                        Applies::Secured => secured,
                        Applies::Write => write,
                        Applies::SecuredOrWrite => secured || write,
                    };
                    if applies {
                        responses
                            .entry(status.to_string())
                            .or_insert_with(|| error_response(description, *status, &error));
                    }
                }
            }
        }
    }
    doc
}

fn error_response(description: &str, status: u16, schema: &Value) -> Value {
    let mut response = json!({
        "description": description,
        "content": {"application/json": {"schema": schema}},
    });
    let header = match status {
        401 => Some(("WWW-Authenticate", "`Bearer`")),
        503 => Some(("Retry-After", "Seconds, when busy or timed out")),
        _ => None,
    };
    if let Some((name, what)) = header {
        let mut headers = Map::new();
        headers.insert(
            name.into(),
            json!({"description": what, "schema": {"type": "string"}}),
        );
        response["headers"] = Value::Object(headers);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SubscriberSettings;

    /// The defaults the document states for the settings are the ones a subscriber gets,
    /// written as the API writes them (durations as `7days`, not serde's `{secs, nanos}`).
    #[test]
    fn documented_setting_defaults_are_the_real_ones() {
        let doc = openapi();
        let schema = &doc["components"]["schemas"]["SubscriberSettings"]["properties"];
        let real = serde_json::to_value(SubscriberSettings::default()).expect("serializes");
        let real = real.as_object().expect("an object");
        assert!(!real.is_empty());
        for (field, value) in real {
            assert_eq!(
                &schema[field]["default"], value,
                "the documented default of `{field}`"
            );
        }
    }

    /// Every route answers the guard's statuses with the error body, and the security
    /// scheme the operations name exists.
    #[test]
    fn guard_answers_and_the_security_scheme_are_documented() {
        let doc = openapi();
        assert_eq!(doc["openapi"], "3.1.0");
        assert_eq!(
            doc["components"]["securitySchemes"]["bearer"]["scheme"],
            "bearer"
        );
        let mut secured = 0;
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for (method, op) in item.as_object().expect("operations") {
                let codes = ["421", "503"];
                for code in codes {
                    assert!(op["responses"][code].is_object(), "{method} {path} {code}");
                }
                if op.get("security").is_some() {
                    secured += 1;
                    assert!(op["responses"]["401"].is_object(), "{method} {path}");
                }
                if method != "get" {
                    assert!(op["responses"]["415"].is_object(), "{method} {path}");
                    assert!(op.get("security").is_some(), "{method} {path}");
                }
            }
        }
        assert!(secured >= 14, "{secured}");
    }
}
