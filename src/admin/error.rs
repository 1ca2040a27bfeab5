//! `ApiError`: every failure of a route, with its HTTP status and a JSON body.
//!
//! Bodies are `{"error": code, "message": text, "field": name?}`. Client errors say what
//! to change; server errors (5xx) never carry internals: the detail goes to the log.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

use crate::ledger::LedgerError;

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    /// 400: the request is malformed; `field` names the offending part when there is one.
    #[error("{message}")]
    BadRequest {
        field: Option<String>,
        message: String,
    },
    /// 401: no bearer token where one is required.
    #[error("this route needs `Authorization: Bearer <token>`")]
    Unauthorized,
    /// 403: a bearer token that is not the configured one.
    #[error("the bearer token is not valid")]
    Forbidden,
    /// 403: a state-changing request from a web page of another origin (CSRF, DNS
    /// rebinding); the text names the origin and `http.allowed_hosts`.
    #[error("{0}")]
    CrossOrigin(String),
    /// 403: a new subscriber past `ledger.max_implicit_subscribers`.
    #[error("{0}")]
    SubscriberLimit(String),
    /// 404: no such subscriber, claim, record or route.
    #[error("{0}")]
    NotFound(String),
    /// 409: the same idempotency key is being processed right now; retry later.
    #[error("{0}")]
    Conflict(String),
    /// 409: the thing to create exists already (a backup name, say).
    #[error("{0}")]
    Exists(String),
    /// 409: the outbox is relayed to the broker (Kafka or RabbitMQ), so it cannot be pulled
    /// too. Its code stays `relayed_to_kafka` for either.
    #[error("{0}")]
    Relayed(String),
    /// 409: a settings change the subscriber's live claims forbid (another key source).
    #[error("{0}")]
    LiveClaims(String),
    /// 421: the `Host` is not a name this server answers to (DNS rebinding); the text
    /// names `http.allowed_hosts`.
    #[error("{0}")]
    MisdirectedHost(String),
    /// 413: the body is larger than the configured limit.
    #[error("the request body is larger than the limit of {limit} bytes")]
    TooLarge { limit: usize },
    /// 415: a content type this route does not take (a form type without a token, or a
    /// body that is not what its type says).
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// 422: the idempotency key was used before with another payload.
    #[error("{0}")]
    Unprocessable(String),
    /// 500 with a safe message: the handler failed for good and the message was dead-lettered.
    #[error("{0}")]
    HandlerFailed(String),
    /// 503: the engine cannot accept work (storage stopped, shutting down).
    #[error("{0}")]
    Unavailable(String),
    /// 503 with `Retry-After`: every slot is taken and the wait queue is full, or the wait
    /// for a slot took longer than `http.queue_timeout`.
    #[error("{0}")]
    Busy(String),
    /// 503 with `Retry-After`: the request took longer than `http.request_timeout`. Work the
    /// engine accepted still completes; a retry with the same key is answered from it.
    #[error("the request took longer than http.request_timeout ({0:?}); work the engine accepted still completes: retry (with the same Idempotency-Key) to learn its outcome")]
    TimedOut(std::time::Duration),
    /// 500: anything else; the detail is logged, never sent.
    #[error("internal error")]
    Internal(String),
}

impl ApiError {
    pub(crate) fn bad(field: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::BadRequest {
            field: Some(field.into()),
            message: message.into(),
        }
    }

    pub(crate) fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden | ApiError::CrossOrigin(_) | ApiError::SubscriberLimit(_) => {
                StatusCode::FORBIDDEN
            }
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MisdirectedHost(_) => StatusCode::MISDIRECTED_REQUEST,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::Conflict(_)
            | ApiError::Exists(_)
            | ApiError::Relayed(_)
            | ApiError::LiveClaims(_) => StatusCode::CONFLICT,
            ApiError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Unprocessable(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::HandlerFailed(_) | ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Unavailable(_) | ApiError::Busy(_) | ApiError::TimedOut(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }

    /// The stable machine-readable code in the body.
    pub(crate) fn code(&self) -> &'static str {
        match self {
            ApiError::BadRequest { .. } => "bad_request",
            ApiError::Unauthorized => "unauthorized",
            ApiError::Forbidden => "forbidden",
            ApiError::CrossOrigin(_) => "cross_origin",
            ApiError::SubscriberLimit(_) => "subscriber_limit",
            ApiError::NotFound(_) => "not_found",
            ApiError::MisdirectedHost(_) => "misdirected_host",
            ApiError::UnsupportedMediaType(_) => "unsupported_media_type",
            ApiError::Conflict(_) => "in_flight",
            ApiError::Exists(_) => "exists",
            ApiError::Relayed(_) => "relayed_to_kafka",
            ApiError::LiveClaims(_) => "live_claims",
            ApiError::TooLarge { .. } => "too_large",
            ApiError::Unprocessable(_) => "payload_mismatch",
            ApiError::HandlerFailed(_) => "dead_lettered",
            ApiError::Unavailable(_) => "unavailable",
            ApiError::Busy(_) => "busy",
            ApiError::TimedOut(_) => "timeout",
            ApiError::Internal(_) => "internal",
        }
    }
}

impl From<LedgerError> for ApiError {
    fn from(e: LedgerError) -> Self {
        match e {
            LedgerError::UnknownSubscriber { name } => {
                ApiError::NotFound(format!("no subscriber {name:?}"))
            }
            LedgerError::InvalidSubscriber(m) => ApiError::bad("subscriber", m),
            e @ LedgerError::TooManySubscribers { .. } => ApiError::SubscriberLimit(e.to_string()),
            e @ LedgerError::KeySourceChanged { .. } => ApiError::LiveClaims(e.to_string()),
            LedgerError::Invalid(m) => ApiError::BadRequest {
                field: None,
                message: m,
            },
            LedgerError::Poisoned(_) | LedgerError::Storage { .. } => {
                tracing::error!(error = %e, "admin request hit a stopped ledger");
                ApiError::Unavailable(
                    "the engine stopped after a storage error; see its log".into(),
                )
            }
            other => ApiError::Internal(other.to_string()),
        }
    }
}

/// The body of every error answer (`ErrorBody` in `/openapi.json`).
#[derive(Serialize, utoipa::ToSchema)]
pub struct ErrorBody<'a> {
    /// Stable machine-readable code (`bad_request`, `not_found`, `in_flight`, ...).
    error: &'a str,
    /// What went wrong and what to change; never internals for a 5xx.
    message: String,
    /// The field, header or parameter at fault (400 only).
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<&'a str>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let message = match &self {
            ApiError::Internal(detail) => {
                tracing::error!(%detail, "admin request failed");
                "internal error; the server log has the detail".to_string()
            }
            other => other.to_string(),
        };
        let field = match &self {
            ApiError::BadRequest { field, .. } => field.as_deref(),
            _ => None,
        };
        let mut resp = (
            status,
            Json(ErrorBody {
                error: self.code(),
                message,
                field,
            }),
        )
            .into_response();
        match self {
            ApiError::Unauthorized => {
                resp.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            ApiError::Conflict(_) | ApiError::Busy(_) | ApiError::TimedOut(_) => {
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            _ => {}
        }
        resp
    }
}
