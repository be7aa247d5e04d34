//! Loading smoke test (root only).
#[test]
fn loads() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root");
        return;
    }
    let i = crab_inspector::Inspector::load().map_err(|e| format!("{e:#?}")).unwrap();
    eprintln!("programs: {}", i.programs());
}
