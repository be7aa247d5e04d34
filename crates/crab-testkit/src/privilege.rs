//! The privilege probe every root-only test uses. Without root a test is skipped with a note on
//! stderr — unless `CRAB_REQUIRE_PRIVILEGED=1` (CI and `make test` set it), where it panics: a
//! test that cannot run there must not count as passed.

/// Whether this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Whether the run demands every privileged test (`CRAB_REQUIRE_PRIVILEGED=1`).
pub fn required() -> bool {
    std::env::var("CRAB_REQUIRE_PRIVILEGED").as_deref() == Ok("1")
}

/// A test cannot run because `why`: panics when [`required`], else says so and returns (the
/// caller returns too).
pub fn cannot_run(why: &str) {
    if required() {
        panic!("cannot run, and CRAB_REQUIRE_PRIVILEGED=1 says it must: {why}");
    }
    eprintln!("skipped: {why}");
}

/// True when the test may go on as root; otherwise [`cannot_run`] (panics under
/// `CRAB_REQUIRE_PRIVILEGED=1`).
pub fn root_or_skip() -> bool {
    if is_root() {
        return true;
    }
    cannot_run("needs root");
    false
}

/// `require_root!();` at the top of a test: returns from it when it may be skipped.
#[macro_export]
macro_rules! require_root {
    () => {
        if !$crate::privilege::root_or_skip() {
            return;
        }
    };
}
