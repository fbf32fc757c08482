//! The expiry index a family may keep beside its records (`~<time>\n<key>`), so what is due is read in time
//! order without a pass over every record: its keys, and the store's reads and removals of what is due.

use super::{Change, Family, StateStore, StoreError};
use crate::clock::Epoch;

/// Prefix of an expiry index kept inside a family beside its records: keys `~<time ms, 13 digits>\n<key>`,
/// in the order they expire, so forgetting what is due reads only that ([`StateStore::due`]). Record keys
/// never start with `~`.
pub const EXPIRY_PREFIX: &str = "~";

/// The expiry-index key that makes `key` due at `at`.
pub fn expiry_key(at: Epoch, key: &str) -> String {
    let at_ms = at.as_millis();
    format!("{EXPIRY_PREFIX}{at_ms:013}\n{key}")
}

fn parse_expiry_key(index_key: &str) -> Option<(i64, &str)> {
    let (at, key) = index_key.strip_prefix(EXPIRY_PREFIX)?.split_once('\n')?;
    Some((at.parse().ok()?, key))
}

impl StateStore {
    /// The entries of `family`'s expiry index ([`expiry_key`]) whose time is at most `cutoff_ms`, oldest
    /// first, as `(index key, key)`.
    ///
    /// # Errors
    /// [`StoreError::Read`] when iteration fails.
    pub fn due(&self, family: Family, cutoff: Epoch) -> Result<Vec<(String, String)>, StoreError> {
        let mut due = Vec::new();
        self.scan_prefix(family, EXPIRY_PREFIX, |index_key| {
            let Some((at, key)) = parse_expiry_key(index_key) else { return true };
            if at > cutoff.as_millis() {
                return false;
            }
            due.push((index_key.to_owned(), key.to_owned()));
            true
        })?;
        Ok(due)
    }

    /// Removes `due` entries of `family`'s expiry index and the keys they name, in batches.
    ///
    /// # Errors
    /// [`StoreError::Write`]: what was not removed yet stays due.
    pub async fn remove_due(&self, family: Family, due: &[(String, String)]) -> Result<(), StoreError> {
        for chunk in due.chunks(512) {
            let changes: Vec<Change<'_>> = chunk
                .iter()
                .flat_map(|(index, key)| [Change::Delete(family, index), Change::Delete(family, key)])
                .collect();
            self.apply(&changes).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Rec {
        n: u32,
    }

    #[test]
    fn expiry_keys_sort_by_time_and_parse_back() {
        let (a, b) = (expiry_key(Epoch::from_millis(999), "t\nx"), expiry_key(Epoch::from_millis(1_000), "t\ny"));
        assert!(a < b);
        assert_eq!(parse_expiry_key(&b), Some((1_000, "t\ny")));
    }

    #[tokio::test]
    async fn only_what_is_due_is_removed_with_its_index_entry() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = StateStore::open(dir.path(), true).expect("open");
        for (key, at) in [("early", 1_000), ("late", 5_000)] {
            store.put(Family::Transactions, key, &Rec { n: 1 }).await.expect("put");
            store.put_raw(Family::Transactions, &expiry_key(Epoch::from_millis(at), key), b"").await.expect("index");
        }
        let due = store.due(Family::Transactions, Epoch::from_millis(2_000)).expect("due");
        assert_eq!(due, [(expiry_key(Epoch::from_millis(1_000), "early"), "early".to_owned())]);
        store.remove_due(Family::Transactions, &due).await.expect("remove");
        assert!(store.get::<Rec>(Family::Transactions, "early").expect("get").is_none());
        assert!(store.get::<Rec>(Family::Transactions, "late").expect("get").is_some());
        assert_eq!(store.due(Family::Transactions, Epoch::from_millis(10_000)).expect("due").len(), 1);
    }
}
