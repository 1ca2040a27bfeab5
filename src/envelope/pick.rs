//! Reading the few values a subscriber's key sources name without building the whole
//! payload as a `serde_json::Value`.
//!
//! A JSON-pointer key or partition key needs one or two leaves of a payload, and a full
//! parse builds a map node and a string for every member of it (with
//! `arbitrary_precision`, every number too) only to drop them again. [`pick`] runs
//! serde_json's own parser over the whole document — so it refuses what a full parse
//! refuses for its syntax — but keeps only the members on the way to a pointer: the value
//! it returns holds, at every requested pointer, exactly what the full parse holds there
//! (a duplicated member: the last one, as the full parse keeps), and nothing else.
//!
//! Members no pointer names are skipped by serde_json's `IgnoredAny`, which checks their
//! syntax but, unlike building a `Value`, neither limits their nesting depth nor refuses a
//! lone surrogate escape (`"\ud800"`) in them. A payload refused by the full parse only for
//! one of those two is therefore read here; every payload the full parse reads gives the
//! same values, so no key derived before changes.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// The members of a payload on the way to `pointers` (RFC 6901), or `None` when `bytes`
/// is not one JSON document.
pub fn pick<'p>(bytes: &[u8], pointers: impl IntoIterator<Item = &'p str>) -> Option<Value> {
    let mut root = Node::default();
    for pointer in pointers {
        root.add(pointer)?;
    }
    let text = std::str::from_utf8(bytes).ok()?;
    let mut de = serde_json::Deserializer::from_str(text);
    let value = Pick(&root).deserialize(&mut de).ok()?;
    de.end().ok()?;
    Some(value)
}

/// The pointers below one member, as a tree of their reference tokens.
#[derive(Debug, Default)]
struct Node<'p> {
    /// A pointer ends here: the whole value is kept.
    leaf: bool,
    children: Vec<(Cow<'p, str>, Node<'p>)>,
}

impl<'p> Node<'p> {
    /// Adds a pointer's path; `None` for a string that is not a JSON pointer.
    fn add(&mut self, pointer: &'p str) -> Option<()> {
        if pointer.is_empty() {
            self.leaf = true;
            return Some(());
        }
        let rest = pointer.strip_prefix('/')?;
        let mut node = self;
        for token in rest.split('/') {
            let token = if token.contains('~') {
                Cow::Owned(token.replace("~1", "/").replace("~0", "~"))
            } else {
                Cow::Borrowed(token)
            };
            let at = match node.children.iter().position(|(t, _)| *t == token) {
                Some(at) => at,
                None => {
                    node.children.push((token, Node::default()));
                    node.children.len() - 1
                }
            };
            node = &mut node.children[at].1;
        }
        node.leaf = true;
        Some(())
    }

    fn child(&self, token: &str) -> Option<usize> {
        self.children.iter().position(|(t, _)| t == token)
    }

    /// The child an array element is reached by: tokens as `Value::pointer` reads indexes
    /// (decimal, no sign, no leading zero).
    fn element(&self, index: usize) -> Option<usize> {
        self.children.iter().position(|(t, _)| {
            let canonical = !t.starts_with('+') && (t == "0" || !t.starts_with('0'));
            canonical && t.parse::<usize>() == Ok(index)
        })
    }
}

/// Deserializes a value keeping only what `.0` names.
struct Pick<'a, 'p>(&'a Node<'p>);

impl<'de> DeserializeSeed<'de> for Pick<'_, '_> {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        if self.0.leaf {
            return serde::Deserialize::deserialize(d);
        }
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Pick<'_, '_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    // Scalars on the way to a pointer: nothing below them, so nothing is kept. (A number
    // under `arbitrary_precision` arrives as a one-member map, skipped like any map.)
    fn visit_bool<E>(self, _: bool) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_str<E>(self, _: &str) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(at) = map.next_key_seed(Token(self.0))? {
            match at {
                Some(at) => {
                    let (name, node) = &self.0.children[at];
                    let value = map.next_value_seed(Pick(node))?;
                    out.insert(name.to_string(), value); // a later duplicate replaces it
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Value::Object(out))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        let mut index = 0;
        loop {
            let more = match self.0.element(index) {
                Some(at) => match seq.next_element_seed(Pick(&self.0.children[at].1))? {
                    Some(value) => {
                        out.resize(index, Value::Null);
                        out.push(value);
                        true
                    }
                    None => false,
                },
                None => seq.next_element::<IgnoredAny>()?.is_some(),
            };
            if !more {
                return Ok(Value::Array(out));
            }
            index += 1;
        }
    }
}

/// A member name, matched against a node's children without copying it.
struct Token<'a, 'p>(&'a Node<'p>);

impl<'de> DeserializeSeed<'de> for Token<'_, '_> {
    type Value = Option<usize>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Option<usize>, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Token<'_, '_> {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_str<E>(self, name: &str) -> Result<Option<usize>, E> {
        Ok(self.0.child(name))
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        reason = "tests: a failed unwrap is a failed test"
    )]

    use super::*;
    use proptest::prelude::*;

    /// Sets of pointers read together: deep ones only (the member on the way is not kept
    /// whole), and with the member itself or the whole document.
    const POINTERS: &[&[&str]] = &[
        &[
            "/order_id",
            "/a/b",
            "/a/0",
            "/a/1/b",
            "/~1x",
            "/a~0",
            "/b/c/0",
        ],
        &["/a", "/a/b"],
        &[""],
    ];

    fn same_at_pointers(text: &str) {
        let full: Value = serde_json::from_str(text).unwrap_or(Value::Null);
        for pointers in POINTERS {
            let picked = pick(text.as_bytes(), pointers.iter().copied()).unwrap_or(Value::Null);
            for p in *pointers {
                assert_eq!(full.pointer(p), picked.pointer(p), "{p} in {text}");
            }
        }
    }

    #[test]
    fn a_payload_gives_the_values_a_full_parse_gives() {
        for text in [
            r#"{"amount_cents":1999,"currency":"EUR","order_id":"o-1","qty":2}"#,
            r#"{"order_id":12345678901234567890123,"a":{"b":[1,2]}}"#,
            r#"{"a":[{"b":1},{"b":"two"}],"/x":1,"~1x":2,"a~":3}"#,
            r#"{"a":"scalar"}"#,
            r#"{"a":{"b":1},"a":{"c":2}}"#,
            r#"{"order_id":"x","order_id":"y"}"#,
            r#"{"a":["x",{"b":{"c":[true,null]}}]}"#,
            r#"{"a\u0020":1,"order\u005fid":"escaped name"}"#,
            r#"  {"order_id" : "spaced" }  "#,
            r#"[1,2]"#,
            r#""text""#,
            r#"{"order_id":"o-1"} trailing"#,
            r#"{"order_id":"o-1""#,
            r#"{"order_id":"o-1",}"#,
            "not json",
            "",
        ] {
            same_at_pointers(text);
        }
    }

    #[test]
    fn a_payload_that_is_not_one_document_is_refused() {
        assert_eq!(pick(b"{\"a\":1} {}", ["/a"]), None);
        assert_eq!(pick(b"{\"a\":\xff}", ["/a"]), None);
        assert_eq!(pick(b"{\"x\":\"\xff\",\"a\":1}", ["/a"]), None);
        assert_eq!(pick(b"{\"a\":1}", ["a"]), None, "not a pointer");
        assert_eq!(
            pick(b"{\"a\":1,\"b\":{\"c\":2}}", ["/a"]),
            Some(serde_json::json!({"a": 1})),
            "only the named member is kept"
        );
    }

    #[test]
    fn a_member_no_pointer_names_is_checked_for_syntax_only() {
        // Deeper than serde_json's recursion limit (128) for a `Value`, and a lone
        // surrogate: a full parse refuses both documents, the pick reads them (module docs).
        let deep = format!(
            r#"{{"x":{}{},"order_id":"o-1"}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        let surrogate = r#"{"x":"\ud800","order_id":"o-1"}"#;
        for text in [deep.as_str(), surrogate] {
            assert!(serde_json::from_str::<Value>(text).is_err(), "{text}");
            let picked = pick(text.as_bytes(), ["/order_id"]).unwrap();
            assert_eq!(picked.pointer("/order_id"), Some(&Value::from("o-1")));
        }
        // Named, the same member is parsed whole and refused as before.
        assert_eq!(pick(deep.as_bytes(), ["/x"]), None);
        assert_eq!(pick(surrogate.as_bytes(), ["/x"]), None);
        // Broken syntax in it is refused either way.
        assert_eq!(
            pick(br#"{"x":[1,,2],"order_id":"o-1"}"#, ["/order_id"]),
            None
        );
    }

    fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            "[a-z0-9 ~/-]{0,6}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::vec(
                    (
                        prop_oneof![
                            Just("a".to_string()),
                            Just("b".to_string()),
                            Just("order_id".to_string()),
                            Just("/x".to_string()),
                            Just("a~".to_string()),
                            "[a-c0-1]{1,2}"
                        ],
                        inner
                    ),
                    0..4
                )
                .prop_map(|members| Value::Object(members.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn any_document_gives_the_values_a_full_parse_gives(doc in json(), spaced in any::<bool>()) {
            let text = if spaced { serde_json::to_string_pretty(&doc).unwrap() } else { doc.to_string() };
            same_at_pointers(&text);
        }

        #[test]
        fn a_damaged_document_is_read_as_a_full_parse_reads_it(doc in json(), cut in any::<prop::sample::Index>()) {
            let text = doc.to_string();
            let at = cut.index(text.len() + 1);
            if text.is_char_boundary(at) {
                same_at_pointers(&text[..at]);
            }
        }
    }
}
