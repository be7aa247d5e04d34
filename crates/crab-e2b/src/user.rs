//! Who an envd call runs as: `Authorization: Basic base64("name:")` names the account (E2B's
//! templates' `user` when it names none, `root` when asked), checked to be a portable user
//! name before it reaches the host's file and process services (which switch to it with
//! `setpriv` inside the sandbox), and that account's home (E2B's convention), where relative
//! paths and a command without a cwd start.

/// The account commands run as when the call names none (E2B's templates' default user).
pub const DEFAULT_USER: &str = "user";

/// The user an envd call runs as: `Authorization: Basic base64("name:")`, else [`DEFAULT_USER`].
pub fn user_from_basic(header: Option<&str>) -> Result<String, String> {
    use base64::Engine;
    let Some(h) = header else { return Ok(DEFAULT_USER.to_string()) };
    let b64 = h
        .strip_prefix("Basic ")
        .ok_or_else(|| "Authorization must be `Basic base64(user:)`".to_string())?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|_| "Authorization: the Basic credentials are not base64".to_string())?;
    let s = String::from_utf8(raw).map_err(|_| "Authorization: user is not UTF-8".to_string())?;
    let user = s.split(':').next().unwrap_or("").to_string();
    check_user(&user)?;
    Ok(if user.is_empty() { DEFAULT_USER.to_string() } else { user })
}

/// A user name usable on a command line (POSIX portable names).
pub fn check_user(user: &str) -> Result<(), String> {
    if user.len() > 32
        || !user.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        || user.starts_with('-')
    {
        return Err(format!("invalid user name {user:?}"));
    }
    Ok(())
}

/// The home directory of `user` (E2B's convention: `/root` or `/home/<user>`).
pub use crab_common::files::home_of;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_user() {
        assert_eq!(user_from_basic(None).as_deref(), Ok("user"));
        assert_eq!(user_from_basic(Some("Basic cm9vdDo=")).as_deref(), Ok("root"));
        assert!(user_from_basic(Some("Bearer x")).is_err());
        // "a b:" has a space: refused rather than passed to setpriv.
        assert!(user_from_basic(Some("Basic YSBiOg==")).is_err());
        assert_eq!(home_of("root"), "/root");
        assert_eq!(home_of("user"), "/home/user");
    }
}
