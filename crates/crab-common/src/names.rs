//! Validation of user-chosen names (sandboxes, images, checkpoints).
//!
//! Names become path components under the state directory and cgroup names, so they are
//! restricted to `[A-Za-z0-9][A-Za-z0-9_.-]{0,62}` and may not be `.` or `..`.

use crate::error::ApiError;

/// Longest accepted name.
pub const MAX_NAME_LEN: usize = 63;

/// Check that `name` is a valid name for a `kind` ("sandbox", "image", ...).
pub fn validate(kind: &str, name: &str) -> Result<(), ApiError> {
    let ok_first = name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric());
    let ok_rest = name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if name.is_empty() || name.len() > MAX_NAME_LEN || !ok_first || !ok_rest {
        return Err(ApiError::invalid(
            format!("invalid {kind} name {name:?}"),
            format!(
                "use 1-{MAX_NAME_LEN} characters from A-Z a-z 0-9 _ . -, starting with a letter or digit"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::validate;

    #[test]
    fn accepts_and_refuses() {
        assert!(validate("sandbox", "sb-1.a_b").is_ok());
        for bad in ["", ".", "..", "-x", "a/b", "a b", &"x".repeat(64)] {
            assert!(validate("sandbox", bad).is_err(), "{bad:?} accepted");
        }
    }
}
