//! API keys (`--e2b-keys FILE`: SHA-256 digests, hex, one per line; `#` comments) and the
//! per-sandbox envd access tokens.

use std::path::Path;

use sha2::{Digest, Sha256};

/// The accepted API keys, as SHA-256 digests.
#[derive(Debug, Clone, Default)]
pub struct Keys {
    digests: Vec<[u8; 32]>,
}

/// Why a keys file was refused.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    /// It could not be read.
    #[error("reading the E2B keys file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A line is not a SHA-256 digest.
    #[error(
        "{path}:{line}: not a SHA-256 digest (64 hex characters); store `printf %s KEY | sha256sum | cut -d' ' -f1`, not the key"
    )]
    Malformed {
        /// The file.
        path: String,
        /// 1-based line.
        line: usize,
    },
    /// No digest at all.
    #[error("{path} holds no key digest; add one SHA-256 digest per line")]
    Empty {
        /// The file.
        path: String,
    },
}

impl Keys {
    /// Read a keys file.
    pub fn load(path: &Path) -> Result<Keys, KeysError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|source| KeysError::Read { path: p.clone(), source })?;
        Keys::parse(&text, &p)
    }

    /// Parse the file's text.
    pub fn parse(text: &str, path: &str) -> Result<Keys, KeysError> {
        let mut digests = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let l = line.trim();
            if l.is_empty() || l.starts_with('#') {
                continue;
            }
            let mut d = [0u8; 32];
            hex::decode_to_slice(l, &mut d)
                .map_err(|_| KeysError::Malformed { path: path.to_string(), line: i + 1 })?;
            digests.push(d);
        }
        if digests.is_empty() {
            return Err(KeysError::Empty { path: path.to_string() });
        }
        Ok(Keys { digests })
    }

    /// Whether `key` is one of them (compared by digest, in constant time per digest).
    pub fn accepts(&self, key: &str) -> bool {
        let d: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        let mut ok = false;
        for k in &self.digests {
            ok |= ct_eq(k, &d);
        }
        ok
    }
}

/// Constant-time equality of two byte strings of equal length.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A fresh random token, hex (`bytes` random bytes).
pub fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    if let Err(e) = getrandom::getrandom(&mut b) {
        // The kernel's CSPRNG does not fail after boot; if it ever does, refuse to hand out a
        // guessable token by making it unusable instead.
        tracing::error!(error = %e, "getrandom failed");
        return String::new();
    }
    hex::encode(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_accept_only_their_key() {
        let d = hex::encode(Sha256::digest(b"e2b_secret"));
        let keys = Keys::parse(&format!("# test\n\n{d}\n"), "k").expect("parses");
        assert!(keys.accepts("e2b_secret"));
        assert!(!keys.accepts("e2b_secreT"));
        assert!(!keys.accepts(""));
    }

    #[test]
    fn malformed_files_name_the_line() {
        let e = Keys::parse("# ok\nnot-hex\n", "keys.txt").expect_err("refused");
        assert!(e.to_string().contains("keys.txt:2"), "{e}");
        assert!(matches!(Keys::parse("\n# none\n", "k"), Err(KeysError::Empty { .. })));
    }

    #[test]
    fn tokens_are_random() {
        let a = random_hex(16);
        assert_eq!(a.len(), 32);
        assert_ne!(a, random_hex(16));
    }
}
