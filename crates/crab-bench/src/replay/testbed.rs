//! The stand-in working tree of SWE-bench trajectories: `/testbed` holds the source distribution
//! of the task's project from PyPI, at one fixed version per project, committed as a git
//! repository, so that edits, `sed -i` and scripts act on real files.
//!
//! Versions (one per project, chosen near the SWE-bench Lite snapshot of each repository):
//!
//! | task prefix | PyPI package | version |
//! |---|---|---|
//! | `django__django` | Django | 4.0 |
//! | `marshmallow-code__marshmallow` | marshmallow | 3.13.0 |
//! | `pvlib__pvlib-python` | pvlib | 0.9.0 |
//! | `pydicom__pydicom` | pydicom | 2.1.2 |
//! | `pylint-dev__astroid` | astroid | 2.12.13 |
//! | `sqlfluff__sqlfluff` | sqlfluff | 0.9.0 |
//!
//! astropy and pyvista have none: `pip download --no-binary :all:` cannot fetch their sdists
//! here (it must build their metadata: astropy 5.0's needs numpy and a compiler toolchain and
//! ran past 5 minutes; pyvista 0.32–0.36's setup.py has an invalid `python_requires`). Their
//! trajectories, like any whose stand-in cannot be prepared, replay against an empty `/testbed`,
//! where their commands fail the same way in every run.
//!
//! Everything happens on the host and is cached under `<cache>` (default
//! `/var/cache/crab/replay`): `pip download --no-deps --no-binary :all: PKG==VER` into
//! `sdists/`, unpacked and committed once (fixed author, committer and dates, so every copy is
//! identical) into `testbed/<pkg>-<ver>.tar`. Each sandbox then gets the tree by unpacking that
//! tar into its root filesystem before the first turn.

use std::path::{Path, PathBuf};
use std::process::Command;

use crab_common::{ApiError, ErrorCode};

/// Default cache directory.
pub const DEFAULT_CACHE: &str = "/var/cache/crab/replay";

/// The PyPI project and version standing in for a SWE-bench task's repository.
pub fn project_for(task: &str) -> Option<(&'static str, &'static str)> {
    const MAP: [(&str, &str, &str); 6] = [
        ("django__django", "Django", "4.0"),
        ("marshmallow-code__marshmallow", "marshmallow", "3.13.0"),
        ("pvlib__pvlib-python", "pvlib", "0.9.0"),
        ("pydicom__pydicom", "pydicom", "2.1.2"),
        ("pylint-dev__astroid", "astroid", "2.12.13"),
        ("sqlfluff__sqlfluff", "sqlfluff", "0.9.0"),
    ];
    let base = task.rsplit('/').next().unwrap_or(task);
    MAP.iter().find(|(p, _, _)| base.starts_with(&format!("{p}-"))).map(|(_, n, v)| (*n, *v))
}

fn run(cmd: &mut Command, what: &str) -> Result<(), ApiError> {
    let out = cmd.output().map_err(|e| {
        ApiError::internal(format!("{what}: cannot run {:?}: {e}", cmd.get_program()))
    })?;
    if !out.status.success() {
        return Err(ApiError::new(
            ErrorCode::Internal,
            format!(
                "{what} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
            ),
            "the stand-in /testbed needs pip (with access to PyPI), tar and git on the host; pass --no-testbed to replay without it",
        ));
    }
    Ok(())
}

/// The prepared tar of `pkg==ver` (building it on first use).
pub fn prepared(cache: &Path, pkg: &str, ver: &str) -> Result<PathBuf, ApiError> {
    let out = cache.join("testbed").join(format!("{pkg}-{ver}.tar"));
    if out.exists() {
        return Ok(out);
    }
    let sdists = cache.join("sdists");
    std::fs::create_dir_all(&sdists)
        .and_then(|_| std::fs::create_dir_all(cache.join("testbed")))
        .map_err(|e| ApiError::internal(format!("creating {}: {e}", cache.display())))?;
    let find = || -> Option<PathBuf> {
        let lower = pkg.to_lowercase();
        std::fs::read_dir(&sdists).ok()?.flatten().map(|e| e.path()).find(|p| {
            let n = p.file_name().map(|n| n.to_string_lossy().to_lowercase()).unwrap_or_default();
            n.starts_with(&format!("{lower}-{ver}."))
                && (n.ends_with(".tar.gz") || n.ends_with(".zip"))
        })
    };
    let sdist = match find() {
        Some(p) => p,
        None => {
            run(
                Command::new("pip")
                    .args(["download", "-q", "--no-deps", "--no-binary", ":all:"])
                    .arg(format!("{pkg}=={ver}"))
                    .arg("-d")
                    .arg(&sdists),
                &format!("pip download {pkg}=={ver}"),
            )?;
            find().ok_or_else(|| {
                ApiError::internal(format!(
                    "pip download left no sdist of {pkg}=={ver} in {}",
                    sdists.display()
                ))
            })?
        }
    };
    let work = cache.join("testbed").join(format!(".work-{pkg}-{ver}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)
        .map_err(|e| ApiError::internal(format!("creating {}: {e}", work.display())))?;
    let result = (|| {
        if sdist.extension().is_some_and(|x| x == "zip") {
            run(Command::new("unzip").arg("-q").arg(&sdist).arg("-d").arg(&work), "unzip sdist")?;
        } else {
            run(
                Command::new("tar")
                    .arg("--no-same-owner")
                    .arg("-xzf")
                    .arg(&sdist)
                    .arg("-C")
                    .arg(&work),
                "untar sdist",
            )?;
        }
        let top = std::fs::read_dir(&work)
            .map_err(|e| ApiError::internal(e.to_string()))?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.is_dir())
            .ok_or_else(|| {
                ApiError::internal(format!("{} has no top directory", sdist.display()))
            })?;
        let tb = work.join("testbed");
        std::fs::rename(&top, &tb).map_err(|e| ApiError::internal(e.to_string()))?;
        let git = |args: &[&str]| {
            let mut c = Command::new("git");
            c.args(["-c", "safe.directory=*", "-c", "gc.auto=0", "-c", "maintenance.auto=false"]);
            c.arg("-C").arg(&tb).args(args);
            for (k, v) in [
                ("GIT_AUTHOR_NAME", "crab"),
                ("GIT_AUTHOR_EMAIL", "crab@localhost"),
                ("GIT_COMMITTER_NAME", "crab"),
                ("GIT_COMMITTER_EMAIL", "crab@localhost"),
                ("GIT_AUTHOR_DATE", "2024-01-01T00:00:00Z"),
                ("GIT_COMMITTER_DATE", "2024-01-01T00:00:00Z"),
            ] {
                c.env(k, v);
            }
            c
        };
        run(&mut git(&["init", "-q", "-b", "main"]), "git init")?;
        run(&mut git(&["add", "-A"]), "git add")?;
        run(&mut git(&["commit", "-q", "-m", "stand-in /testbed"]), "git commit")?;
        let tmp = out.with_extension("tar.tmp");
        run(
            Command::new("tar").arg("-cf").arg(&tmp).arg("-C").arg(&work).arg("testbed"),
            "tar testbed",
        )?;
        std::fs::rename(&tmp, &out).map_err(|e| ApiError::internal(e.to_string()))
    })();
    let _ = std::fs::remove_dir_all(&work);
    result.map(|_| out)
}

/// Unpack a prepared tree into a sandbox's root filesystem (as `/testbed`).
pub fn install(tar: &Path, rootfs: &Path) -> Result<(), ApiError> {
    run(
        Command::new("tar").arg("-xf").arg(tar).arg("-C").arg(rootfs).arg("--no-same-owner"),
        "unpacking /testbed into the sandbox",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn projects() {
        assert_eq!(project_for("mini-swe-agent/x/django__django-11099"), Some(("Django", "4.0")));
        assert_eq!(project_for("pvlib__pvlib-python-1072"), Some(("pvlib", "0.9.0")));
        assert_eq!(project_for("counter-server"), None);
    }
}
