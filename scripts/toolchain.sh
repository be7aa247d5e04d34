#!/usr/bin/env bash
# Make the toolchain pinned in rust-toolchain.toml available without a download: this
# workplace has no internet beyond package registries, so when rustup lacks the pinned
# version but its `stable` toolchain *is* that version, link it under the pinned name.
set -euo pipefail
cd "$(dirname "$0")/.."
want=$(sed -n 's/^channel = "\(.*\)"/\1/p' rust-toolchain.toml)
if rustup toolchain list | grep -q "^$want"; then exit 0; fi
have=$(rustup run stable rustc --version | awk '{print $2}')
if [ "$have" = "$want" ]; then
    rustup toolchain link "$want" "$(rustup run stable rustc --print sysroot)"
    echo "toolchain: linked stable ($have) as $want"
else
    echo "error: rust-toolchain.toml pins $want but rustup has stable $have; install $want or change the pin" >&2
    exit 1
fi
