//! Content ids: 32-byte BLAKE3 digests, written as 64 lower-case hex digits.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A BLAKE3 digest naming a blob, pack or index object.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Id(pub [u8; 32]);

impl Id {
    /// The plain BLAKE3 digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Id {
        Id(*blake3::hash(bytes).as_bytes())
    }

    /// Parse 64 hex digits.
    pub fn parse(s: &str) -> Option<Id> {
        let mut out = [0u8; 32];
        if s.len() != 64 || hex::decode_to_slice(s, &mut out).is_err() {
            return None;
        }
        Some(Id(out))
    }

    /// The object-key form `xx/xxxx…` (two-digit fan-out directory).
    pub fn fanout(&self) -> String {
        let h = self.to_string();
        format!("{}/{}", &h[..2], h)
    }

    /// The first 12 hex digits, for messages.
    pub fn short(&self) -> String {
        self.to_string()[..12].to_string()
    }
}

impl fmt::Display for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Id({})", self.short())
    }
}

impl Serialize for Id {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Id {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Id, D::Error> {
        let s = String::deserialize(d)?;
        Id::parse(&s)
            .ok_or_else(|| serde::de::Error::custom(format!("not a 64-hex-digit id: {s:?}")))
    }
}
