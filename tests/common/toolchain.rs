//! Checks that need a piece of the GPU toolchain (clang-19, libclang, Debian's HIP headers and
//! runtime): where that piece is missing they skip, saying so in the test output on one line
//! with what is missing and how to get it; under `HIPKV_REQUIRE_HIP=1` (CI) they fail instead.

use std::fmt::Display;
use std::io::Write as _;

/// How to get every piece these checks look for.
pub const INSTALL: &str = "`sudo scripts/install-hip-toolchain.sh` installs it";

/// Whether a missing toolchain piece is a failure (`HIPKV_REQUIRE_HIP=1`).
pub fn required() -> bool {
    std::env::var("HIPKV_REQUIRE_HIP").as_deref() == Ok("1")
}

/// Ends the calling check for want of a toolchain piece: `what` is the check, `why` names what
/// is missing. Panics under `HIPKV_REQUIRE_HIP=1`; otherwise writes one line straight to stderr,
/// past the harness's capture of passing tests' output, so a green run still says what it left
/// out.
pub fn skip(what: &str, why: impl Display) {
    if required() {
        panic!("HIPKV_REQUIRE_HIP=1 but {what} cannot run: {why}");
    }
    // One write of whole lines: the harness prints to stdout from other threads meanwhile,
    // and a line written in pieces would be cut by its `ok`s where both go to one pipe.
    let line =
        format!("\nSKIPPED {what}: {why}; {INSTALL} (HIPKV_REQUIRE_HIP=1 makes this a failure)\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}
