//! Optional encryption at rest: XChaCha20-Poly1305 with a 32-byte key from a key file, random
//! 24-byte nonces, and blob ids keyed by a key derived from it (so ids do not reveal content).

use std::path::Path;

use chacha20poly1305::aead::{Aead, KeyInit};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};

use crate::error::{RemoteError, Result};

const NONCE_LEN: usize = 24;

/// A repository key.
#[derive(Clone)]
pub struct Key {
    cipher: XChaCha20Poly1305,
    id_key: [u8; 32],
    check_key: [u8; 32],
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(..)")
    }
}

/// `n` random bytes from the kernel.
pub fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut out = [0u8; N];
    let mut filled = 0;
    while filled < N {
        // SAFETY: the pointer and length describe the unfilled tail of `out`, which lives for
        // the whole call.
        let n = unsafe { libc::getrandom(out[filled..].as_mut_ptr().cast(), N - filled, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(RemoteError::Io {
                op: "getrandom",
                path: "/dev/urandom".into(),
                source: e,
            });
        }
        filled += n as usize;
    }
    Ok(out)
}

impl Key {
    /// A key from its 32 raw bytes.
    pub fn from_bytes(raw: [u8; 32]) -> Key {
        Key {
            cipher: XChaCha20Poly1305::new(&raw.into()),
            id_key: blake3::derive_key("crab-remote 1 blob id", &raw),
            check_key: blake3::derive_key("crab-remote 1 key check", &raw),
        }
    }

    /// Read a key file: 64 hex digits (whitespace around them ignored).
    pub fn load(path: &Path) -> Result<Key> {
        let text = std::fs::read_to_string(path).map_err(RemoteError::io("read key file", path))?;
        let mut raw = [0u8; 32];
        hex::decode_to_slice(text.trim(), &mut raw).map_err(|_| {
            RemoteError::Key(format!(
                "{} does not hold 64 hex digits (create one with `crab remote key-gen {}`)",
                path.display(),
                path.display()
            ))
        })?;
        Ok(Key::from_bytes(raw))
    }

    /// Write a new random key file (mode 0600); refuses to overwrite.
    pub fn generate(path: &Path) -> Result<Key> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let raw: [u8; 32] = random_bytes()?;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(RemoteError::io("create key file", path))?;
        f.write_all(format!("{}\n", hex::encode(raw)).as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(RemoteError::io("write key file", path))?;
        Ok(Key::from_bytes(raw))
    }

    /// The id of a blob with plaintext `plain`.
    pub fn blob_id(&self, plain: &[u8]) -> [u8; 32] {
        *blake3::keyed_hash(&self.id_key, plain).as_bytes()
    }

    /// The value recorded in the config to recognize this key.
    pub fn check_value(&self) -> String {
        blake3::keyed_hash(&self.check_key, b"crab-remote key check").to_hex().to_string()
    }

    /// Encrypt: nonce ‖ ciphertext+tag.
    pub fn seal(&self, plain: &[u8]) -> Result<Vec<u8>> {
        let nonce: [u8; NONCE_LEN] = random_bytes()?;
        let ct = self
            .cipher
            .encrypt(XNonce::from_slice(&nonce), plain)
            .map_err(|_| RemoteError::Key("encryption failed".into()))?;
        let mut out = Vec::with_capacity(NONCE_LEN + ct.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&ct);
        Ok(out)
    }

    /// Decrypt and authenticate what [`Key::seal`] wrote; `object` names it in errors.
    pub fn open(&self, sealed: &[u8], object: &str) -> Result<Vec<u8>> {
        if sealed.len() < NONCE_LEN + 16 {
            return Err(RemoteError::corrupt(object, "encrypted data shorter than nonce + tag"));
        }
        let (nonce, ct) = sealed.split_at(NONCE_LEN);
        self.cipher.decrypt(XNonce::from_slice(nonce), ct).map_err(|_| {
            RemoteError::corrupt(object, "authentication failed (modified, or another key)")
        })
    }
}
