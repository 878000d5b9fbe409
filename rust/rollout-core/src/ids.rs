//! Names of the fleet's things, typed: made once where they enter (an HTTP path or body, the
//! store) and passed on as their type, so a name is checked once, not at every use: a weight
//! version's name ([`VersionName`]), an engine's id ([`EngineId`]), a scale operation's id
//! ([`OpId`]) and a weight update's id ([`UpdateId`]). The types keep one id from standing in
//! for another: a function that takes an [`EngineId`] cannot be handed an operation's id.
//!
//! A name is cheap to clone (a shared string) and reads as `&str` where text is needed (`Deref`,
//! `Borrow<str>`). On the wire and in the store it is its plain string.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(Arc<str>);

        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl Deref for $name {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        /// On the wire an id is its plain string.
        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                <String as utoipa::PartialSchema>::schema()
            }
        }

        impl utoipa::ToSchema for $name {}

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&*self.0, f)
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                &*self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                &*self.0 == *other
            }
        }

        impl PartialEq<String> for $name {
            fn eq(&self, other: &String) -> bool {
                *self.0 == **other
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0)
            }
        }
    };
}

name_type!(
    /// A weight version's name: 1 to 128 letters, digits and `.` `_` `-` `+`, without `..`
    /// (versions name directories where weights are staged, so no path separators). Made only
    /// through [`VersionName::parse`] (or from the store, where it was checked when written).
    VersionName
);

name_type!(
    /// An engine's id: `engine_<n>`, `n` its creation order ([`EngineId::of_seq`]); ids read
    /// back (the store, an HTTP path) are checked by [`EngineId::parse`].
    EngineId
);

name_type!(
    /// A scale operation's id (`request_id`): a UUID when the manager makes one.
    OpId
);

name_type!(
    /// A weight update's id (`update_id`): a UUID when the manager makes one.
    UpdateId
);

/// Why a text is not an id: ids are 1 to 128 letters, digits and `.` `_` `-`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadId {
    pub kind: &'static str,
    pub text: String,
}

impl fmt::Display for BadId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {:?} must be 1 to 128 letters, digits and . _ -", self.kind, self.text)
    }
}

impl std::error::Error for BadId {}

fn id_text(kind: &'static str, text: &str) -> Result<Arc<str>, BadId> {
    let ok = !text.is_empty()
        && text.len() <= 128
        && text.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(Arc::from(text))
    } else {
        Err(BadId { kind, text: text.to_string() })
    }
}

macro_rules! id_type {
    ($name:ident, $kind:literal) => {
        impl $name {
            pub fn parse(text: &str) -> Result<Self, BadId> {
                id_text($kind, text).map(Self)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let text = String::deserialize(d)?;
                $name::parse(&text).map_err(serde::de::Error::custom)
            }
        }
    };
}

id_type!(EngineId, "engine id");
id_type!(OpId, "request id");
id_type!(UpdateId, "update id");

impl EngineId {
    /// The id of the engine created `seq`-th.
    pub fn of_seq(seq: u64) -> Self {
        Self(Arc::from(format!("engine_{seq}")))
    }
}

impl From<uuid::Uuid> for OpId {
    fn from(u: uuid::Uuid) -> Self {
        Self(Arc::from(u.to_string()))
    }
}

impl From<uuid::Uuid> for UpdateId {
    fn from(u: uuid::Uuid) -> Self {
        Self(Arc::from(u.to_string()))
    }
}

/// Why a text is not a version name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadVersionName(pub String);

impl fmt::Display for BadVersionName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "version {:?} must be 1 to 128 letters, digits and . _ - + (no '..')", self.0)
    }
}

impl std::error::Error for BadVersionName {}

impl VersionName {
    pub fn parse(text: &str) -> Result<Self, BadVersionName> {
        let ok = !text.is_empty()
            && text.len() <= 128
            && !text.contains("..")
            && text.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '+'));
        if ok {
            Ok(Self(Arc::from(text)))
        } else {
            Err(BadVersionName(text.to_string()))
        }
    }
}

impl<'de> Deserialize<'de> for VersionName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        VersionName::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_names_are_checked_once_when_made() {
        for good in ["v1", "step-10", "1.2.3+rc_1", &"a".repeat(128)] {
            assert_eq!(VersionName::parse(good).map(|v| v.to_string()), Ok(good.to_string()), "{good}");
        }
        for bad in ["", "a/b", "..", "v1..2", "with space", &"a".repeat(129), "ü"] {
            let err = VersionName::parse(bad).unwrap_err();
            assert!(err.to_string().contains("1 to 128 letters"), "{bad}: {err}");
        }
        assert!(serde_json::from_str::<VersionName>("\"../etc\"").is_err(), "checked when read too");
        let v2 = serde_json::from_str::<VersionName>("\"v2\"").unwrap();
        assert_eq!(v2, "v2");
        assert_eq!(
            (v2.to_string(), format!("{v2:?}"), serde_json::to_string(&v2).unwrap()),
            ("v2".into(), "\"v2\"".into(), "\"v2\"".into())
        );
        let mut names = std::collections::BTreeSet::new();
        names.insert(v2);
        assert!(names.contains("v2"), "looked up by &str");
    }

    #[test]
    fn ids_are_checked_when_read_and_made_valid() {
        assert_eq!(EngineId::of_seq(7), "engine_7");
        assert_eq!(EngineId::parse("engine_7"), Ok(EngineId::of_seq(7)));
        let uuid = uuid::Uuid::from_u128(1);
        assert_eq!(OpId::from(uuid).as_str(), uuid.to_string());
        assert!(OpId::parse(OpId::from(uuid).as_str()).is_ok(), "a made id reads back");
        for bad in ["", "a/b", "with space", "x?y", &"a".repeat(129)] {
            let err = EngineId::parse(bad).unwrap_err();
            assert_eq!(err.kind, "engine id");
            assert!(err.to_string().contains("1 to 128 letters"), "{bad}: {err}");
            assert!(UpdateId::parse(bad).is_err() && OpId::parse(bad).is_err(), "{bad}");
        }
        assert!(serde_json::from_str::<EngineId>("\"../x\"").is_err(), "checked when read");
        assert_eq!(serde_json::to_string(&EngineId::of_seq(1)).unwrap(), "\"engine_1\"");
    }
}
