//! `${NAME}` in config strings: replaced by the environment variable `NAME` before the
//! file is read into a [`super::Config`], so secrets (`sasl.password`, tokens) need not be
//! written into the file. Only string values are expanded, after TOML parsing, so a value
//! with quotes or newlines cannot change the file's structure; any setting written as a
//! string may use it (durations such as `ttl = "${TTL}"`, addresses, paths). `$${` is a
//! literal `${`. An unset variable is an error naming the field, never an empty string,
//! unless it gives a default: `${NAME:-default}` (as in Vector and the shell) takes
//! `default` when `NAME` is unset or empty.

use super::{invalid, ConfigError};

/// Expands `${NAME}` in every string of `value`; `field` is the path so far (for errors).
pub(super) fn expand(
    value: &mut toml::Value,
    field: &str,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<(), ConfigError> {
    match value {
        toml::Value::String(s) if s.contains('$') => *s = expand_str(s, field, lookup)?,
        toml::Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                expand(item, &format!("{field}[{i}]"), lookup)?;
            }
        }
        toml::Value::Table(table) => {
            for (k, v) in table.iter_mut() {
                let path = if field.is_empty() {
                    k.clone()
                } else {
                    format!("{field}.{k}")
                };
                expand(v, &path, lookup)?;
            }
        }
        _ => {}
    }
    Ok(())
}

fn expand_str(
    s: &str,
    field: &str,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<String, ConfigError> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        if let Some(after) = tail.strip_prefix("$${") {
            out.push_str("${");
            rest = after;
        } else if let Some(after) = tail.strip_prefix("${") {
            let end = after.find('}').ok_or_else(|| {
                invalid(
                    field,
                    "has `${` without a closing `}` (write `$${` for a literal `${`)",
                )
            })?;
            let (name, default) = match after[..end].split_once(":-") {
                Some((name, default)) => (name, Some(default)),
                None => (&after[..end], None),
            };
            let valid =
                !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(invalid(
                    field,
                    format!("names environment variable {name:?}: use letters, digits and `_`"),
                ));
            }
            let v = match (lookup(name), default) {
                (Some(v), Some(d)) if v.is_empty() => d.to_string(),
                (Some(v), _) => v,
                (None, Some(d)) => d.to_string(),
                (None, None) => {
                    return Err(invalid(
                        field,
                        format!("uses environment variable {name}, which is not set (write `${{{name}:-default}}` for a default)"),
                    ))
                }
            };
            out.push_str(&v);
            rest = &after[end + 1..];
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "PASS" => Some("s3\"cr}et".into()),
            "USER" => Some("svc".into()),
            _ => None,
        }
    }

    fn expanded(toml_text: &str) -> Result<toml::Value, ConfigError> {
        let mut v: toml::Value = toml::from_str(toml_text).unwrap();
        expand(&mut v, "", &env)?;
        Ok(v)
    }

    #[test]
    fn variables_in_strings_are_replaced_and_quotes_stay_data() {
        let v = expanded(
            "[kafka.options]\n\"sasl.username\" = \"${USER}\"\n\"sasl.password\" = \"${PASS}\"\nlist = [\"a-${USER}-b\", 3]\nprice = \"$5 and $${LITERAL}\"\n",
        )
        .unwrap();
        let o = &v["kafka"]["options"];
        assert_eq!(o["sasl.username"].as_str(), Some("svc"));
        assert_eq!(o["sasl.password"].as_str(), Some("s3\"cr}et"));
        assert_eq!(o["list"][0].as_str(), Some("a-svc-b"));
        assert_eq!(o["price"].as_str(), Some("$5 and ${LITERAL}"));
    }

    #[test]
    fn a_default_is_taken_when_the_variable_is_unset() {
        let v =
            expanded("a = \"${NOPE:-7d}\"\nb = \"${USER:-other}\"\nc = \"${NOPE:-}x\"\n").unwrap();
        assert_eq!(v["a"].as_str(), Some("7d"));
        assert_eq!(v["b"].as_str(), Some("svc"));
        assert_eq!(v["c"].as_str(), Some("x"));
    }

    #[test]
    fn an_unset_or_malformed_variable_names_the_field() {
        let e = expanded("[http]\ntoken = \"${NOPE}\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("http.token") && e.contains("NOPE") && e.contains("not set"),
            "{e}"
        );
        let e = expanded("a = \"${OPEN\"\n").unwrap_err().to_string();
        assert!(e.contains("`a`") && e.contains("closing"), "{e}");
        let e = expanded("a = [\"${bad name}\"]\n").unwrap_err().to_string();
        assert!(e.contains("a[0]"), "{e}");
    }
}
