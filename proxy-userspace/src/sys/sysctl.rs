//! Reading and writing integer sysctls and module parameters under /proc
//! and /sys, writing only when the value differs (as kube-proxy does: a
//! read-only /proc/sys in a container is then no error while nothing needs
//! to change).

use std::{fs, io, path::Path};

/// What [`set`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Unchanged,
    Written { was: u64 },
}

/// The integer in the file at `path`.
pub fn read(path: &Path) -> io::Result<u64> {
    let text = fs::read_to_string(path)?;
    text.trim()
        .parse()
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, format!("{text:?} is not a number")))
}

/// Writes `value` to `path` unless it holds that value already.
pub fn set(path: &Path, value: u64) -> io::Result<Outcome> {
    let was = read(path)?;
    if was == value {
        return Ok(Outcome::Unchanged);
    }
    fs::write(path, value.to_string())?;
    Ok(Outcome::Written { was })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_only_a_different_value() {
        let dir = std::env::temp_dir().join(format!("xproxy-sysctl-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("value");
        fs::write(&path, "300\n").unwrap();
        assert_eq!(set(&path, 300).unwrap(), Outcome::Unchanged);
        assert_eq!(set(&path, 120).unwrap(), Outcome::Written { was: 300 });
        assert_eq!(read(&path).unwrap(), 120);
        fs::write(&path, "many").unwrap();
        assert!(set(&path, 1).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }
}
