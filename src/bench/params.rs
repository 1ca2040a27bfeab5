//! The checks of a bench's parameters, shared by every bench's `validate` (the engine
//! bench's [`BenchParams`](super::BenchParams), [`AdversarialParams`](super::AdversarialParams)
//! and the broker benches' params), which each bench's `run` calls first: a library
//! caller is refused as the command line is, before any directory, broker or ledger is
//! touched.

use std::fmt::Display;
use std::path::{Path, PathBuf};

/// A bench parameter the run cannot use. The message names the parameter both as the
/// field of the params struct and as the `dedupd` flag that sets it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ParamError {
    /// `param` (a field name, or fields joined by ` + `) is outside what the run can use.
    #[error("{param} ({}) must be {rule}, got {value}", flags(.param))]
    Invalid {
        param: &'static str,
        rule: &'static str,
        value: String,
    },
    /// The handler component is not there: the plugins are built separately.
    #[error("handler {} not found: build the plugins first (plugins/build.sh)", .0.display())]
    HandlerNotFound(PathBuf),
}

/// `dup_rate + mismatch_rate` as the flags that set them: `--dup-rate + --mismatch-rate`.
fn flags(param: &str) -> String {
    param
        .split(" + ")
        .map(|p| format!("--{}", p.replace('_', "-")))
        .collect::<Vec<_>>()
        .join(" + ")
}

fn invalid(param: &'static str, rule: &'static str, value: impl Display) -> ParamError {
    ParamError::Invalid {
        param,
        rule,
        value: value.to_string(),
    }
}

/// `value` is a fraction of the messages: in [0, 1).
pub(crate) fn fraction(param: &'static str, value: f64) -> Result<(), ParamError> {
    match (0.0..1.0).contains(&value) {
        true => Ok(()),
        false => Err(invalid(param, "in [0, 1)", value)),
    }
}

/// `value` counts something the run needs at least one of.
pub(crate) fn at_least_one<T>(param: &'static str, value: T) -> Result<(), ParamError>
where
    T: PartialOrd + From<u8> + Display,
{
    match value >= T::from(1) {
        true => Ok(()),
        false => Err(invalid(param, "at least 1", value)),
    }
}

/// `value`, when given, is at least 1.
pub(crate) fn at_least_one_if_set(
    param: &'static str,
    value: Option<u64>,
) -> Result<(), ParamError> {
    value.map_or(Ok(()), |v| at_least_one(param, v))
}

/// A bench's `handler`, when given, exists.
pub(crate) fn handler_built(handler: Option<&Path>) -> Result<(), ParamError> {
    match handler {
        Some(h) if !h.exists() => Err(ParamError::HandlerNotFound(h.to_path_buf())),
        _ => Ok(()),
    }
}

/// `Err` with `rule` for `param` unless `ok`.
pub(crate) fn require(
    ok: bool,
    param: &'static str,
    rule: &'static str,
    value: impl Display,
) -> Result<(), ParamError> {
    match ok {
        true => Ok(()),
        false => Err(invalid(param, rule, value)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_names_the_field_and_its_flag() {
        let e = fraction("dup_rate", 1.5).unwrap_err();
        assert_eq!(
            e.to_string(),
            "dup_rate (--dup-rate) must be in [0, 1), got 1.5"
        );
        let e = require(false, "dup_rate + mismatch_rate", "less than 1", 1.2).unwrap_err();
        assert_eq!(
            e.to_string(),
            "dup_rate + mismatch_rate (--dup-rate + --mismatch-rate) must be less than 1, got 1.2"
        );
        assert!(at_least_one("partitions", 0i32).is_err());
        assert!(at_least_one("window", 1u16).is_ok());
        assert!(fraction("dup_rate", 0.0).is_ok() && fraction("dup_rate", f64::NAN).is_err());
    }
}
