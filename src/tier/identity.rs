//! Which instance of a tier this is: an id that starts every delivery id the instance mints, so any instance
//! can tell which one handed a delivery out. It stays the same across restarts with the same state directory
//! (the deliveries stored there are that instance's), so it is kept in the directory.

use std::fmt;
use std::path::{Path, PathBuf};

use rand::RngCore;

use crate::config::{is_valid_instance_id, MAX_INSTANCE_ID_LEN};

/// The file in the state directory that keeps the instance's id.
const ID_FILE: &str = "instance-id";

/// A tier instance's id: lowercase letters, digits and `-` (see [`is_valid_instance_id`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InstanceId(String);

/// Why the instance's id could not be settled.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// The state directory's id file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The id file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// The id file holds something that is not an id.
    #[error("{path} holds `{found}`, which is not an instance id")]
    Corrupt {
        /// The id file.
        path: PathBuf,
        /// What it holds.
        found: String,
    },
    /// `tier.instance_id` names another instance than the one the state directory belongs to.
    #[error(
        "config key `tier.instance_id`: `{configured}`, but the state directory belongs to instance `{stored}` \
         ({path}); its deliveries are that instance's, so give it that id (or a fresh state directory)"
    )]
    AnotherInstancesState {
        /// The configured id.
        configured: String,
        /// The id the state directory keeps.
        stored: String,
        /// The id file.
        path: PathBuf,
    },
}

impl InstanceId {
    /// `id`, when it is a valid instance id.
    pub fn parse(id: &str) -> Option<InstanceId> {
        is_valid_instance_id(id).then(|| InstanceId(id.to_owned()))
    }

    /// An id made of `host`'s first label (lowercased, anything else than a letter or digit as `-`) and a
    /// random suffix, so two instances on one host differ.
    pub fn from_host_name(host: &str) -> InstanceId {
        let mut suffix = [0u8; 3];
        rand::rng().fill_bytes(&mut suffix);
        let suffix = hex::encode(suffix);
        let label: String = host
            .split('.')
            .next()
            .unwrap_or_default()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' })
            .take(MAX_INSTANCE_ID_LEN - suffix.len() - 1)
            .collect();
        let label = label.trim_matches('-');
        let label = if label.is_empty() { "popgate" } else { label };
        InstanceId(format!("{label}-{suffix}"))
    }

    /// This instance's id: the one `state_dir` keeps; else `configured`, or one made from the host name, stored
    /// there for the next start.
    ///
    /// # Errors
    /// [`IdentityError`] when the id file cannot be read or written, holds no id, or keeps another id than
    /// `configured`.
    pub fn resolve(configured: Option<&str>, state_dir: &Path) -> Result<InstanceId, IdentityError> {
        let path = state_dir.join(ID_FILE);
        let io = |source| IdentityError::Io { path: path.clone(), source };
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                let found = text.trim();
                let stored = InstanceId::parse(found)
                    .ok_or_else(|| IdentityError::Corrupt { path: path.clone(), found: found.to_owned() })?;
                match configured {
                    Some(configured) if configured != stored.0 => Err(IdentityError::AnotherInstancesState {
                        configured: configured.to_owned(),
                        stored: stored.0,
                        path,
                    }),
                    _ => Ok(stored),
                }
            }
            Err(missing) if missing.kind() == std::io::ErrorKind::NotFound => {
                // `configured` was validated with the rest of the config.
                let id = configured.and_then(InstanceId::parse).unwrap_or_else(|| Self::from_host_name(&host_name()));
                std::fs::create_dir_all(state_dir).map_err(io)?;
                // Written whole and renamed into place: a crash leaves the old file or the new one, never half.
                let partial = state_dir.join(format!("{ID_FILE}.partial"));
                std::fs::write(&partial, format!("{}\n", id.0)).map_err(io)?;
                std::fs::rename(&partial, &path).map_err(io)?;
                Ok(id)
            }
            Err(unreadable) => Err(io(unreadable)),
        }
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The host's name, as the kernel has it (`popgate` when it cannot be read).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_owned())
        .ok()
        .filter(|name| !name.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "popgate".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_name_makes_a_valid_id_with_a_random_suffix() {
        for host in ["popgate-0.popgate-peers.default.svc", "Node_7", "", "---", &"x".repeat(80)] {
            let id = InstanceId::from_host_name(host);
            assert!(is_valid_instance_id(id.as_str()), "{host:?} gave {id}");
        }
        assert!(InstanceId::from_host_name("popgate-0.svc").as_str().starts_with("popgate-0-"));
        assert_ne!(InstanceId::from_host_name("a"), InstanceId::from_host_name("a"), "two instances on one host");
    }

    #[test]
    fn the_state_directory_keeps_the_id_and_refuses_another() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = InstanceId::resolve(None, dir.path()).expect("made and stored");
        assert_eq!(InstanceId::resolve(None, dir.path()).expect("read"), first, "the same after a restart");
        assert_eq!(InstanceId::resolve(Some(first.as_str()), dir.path()).expect("the same"), first);
        let other = InstanceId::resolve(Some("another-1"), dir.path()).expect_err("another instance's state");
        assert!(other.to_string().contains("tier.instance_id"), "{other}");

        let fresh = tempfile::tempdir().expect("tempdir");
        let named = InstanceId::resolve(Some("popgate-2"), fresh.path()).expect("configured");
        assert_eq!(named.as_str(), "popgate-2");
        std::fs::write(fresh.path().join(ID_FILE), "Not An Id\n").expect("write");
        assert!(matches!(InstanceId::resolve(None, fresh.path()), Err(IdentityError::Corrupt { .. })));
    }
}
