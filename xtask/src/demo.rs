//! `cargo xtask demo`: the main job (implemented in issue 3).

use anyhow::{Result, bail};

pub fn demo() -> Result<()> {
    bail!("`cargo xtask demo` is not implemented yet: see issue 3")
}
