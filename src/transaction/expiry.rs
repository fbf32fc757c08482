//! Records past their retention (`transactions.record_retention_secs`) removed, read from the store's expiry
//! index; and, at start, the index entries of records stored before the index existed.

use std::collections::HashSet;
use std::time::Duration;

use metrics::gauge;

use super::{TransactionRecord, Transactions};
use crate::clock::Epoch;
use crate::metrics as m;
use crate::store::{expiry_key, Change, Family, StateStore, StoreError};

/// How often the records past their retention are removed.
const EXPIRE_EVERY: Duration = Duration::from_secs(60);

impl Transactions {
    /// Removes the records past their retention, read from the expiry index.
    async fn expire(&self) {
        let due = match self.store.due(Family::Transactions, Epoch::now()) {
            Ok(due) => due,
            Err(error) => {
                tracing::warn!(%error, "Could not read the transactions' expiry index.");
                return;
            }
        };
        if let Err(error) = self.store.remove_due(Family::Transactions, &due).await {
            tracing::warn!(%error, "Could not remove expired transaction records; trying again later.");
            return;
        }
        let mut owed = self.owed.lock();
        for (_, id) in &due {
            owed.remove(id);
        }
        gauge!(m::TRANSACTIONS_OWED).set(owed.len() as f64);
    }
}

/// Writes the expiry-index entry of each record that has none (`indexed` are the entries there are): records
/// stored before the index existed get theirs, so they expire too.
pub(super) async fn index_unindexed(
    store: &StateStore,
    records: &[(String, TransactionRecord)],
    indexed: &HashSet<&str>,
) -> Result<(), StoreError> {
    let missing: Vec<String> = records
        .iter()
        .map(|(id, r)| expiry_key(r.expires_ms, id))
        .filter(|key| !indexed.contains(key.as_str()))
        .collect();
    for chunk in missing.chunks(512) {
        let changes: Vec<Change<'_>> = chunk.iter().map(|key| Change::Put(Family::Transactions, key, vec![])).collect();
        store.apply(&changes).await?;
    }
    Ok(())
}

pub(super) async fn expiry_loop(transactions: std::sync::Weak<Transactions>) {
    let mut tick = tokio::time::interval(EXPIRE_EVERY);
    loop {
        tick.tick().await;
        let Some(transactions) = transactions.upgrade() else { return };
        transactions.expire().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::EXPIRY_PREFIX;
    use crate::transaction::{HalfMessage, State};

    fn record(id: &str, expires_ms: i64) -> TransactionRecord {
        let (sent_ms, expires_ms) = (Epoch::ZERO, Epoch::from_millis(expires_ms));
        let half = HalfMessage {
            topic: "t".into(),
            producer_group: "g".into(),
            message_id: id.into(),
            broker_name: "broker-a".into(),
            broker_addr: "127.0.0.1:10911".into(),
            tran_state_table_offset: 0,
            commit_log_offset: 0,
        };
        TransactionRecord { transaction_id: id.into(), half, sent_ms, expires_ms, state: State::Open }
    }

    #[tokio::test]
    async fn a_record_stored_before_the_expiry_index_gets_its_entry_and_an_indexed_one_is_left_as_it_is() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = StateStore::open(dir.path(), true).expect("open");
        let (old, new) = (record("OLD", 1_000), record("NEW", 2_000));
        store.put(Family::Transactions, "OLD", &old).await.expect("put");
        store.put(Family::Transactions, "NEW", &new).await.expect("put");
        store.put_raw(Family::Transactions, &expiry_key(Epoch::from_millis(2_000), "NEW"), b"").await.expect("index");
        let listing = store.list::<TransactionRecord>(Family::Transactions).expect("list");
        let indexed: HashSet<&str> =
            listing.undecodable.iter().map(String::as_str).filter(|k| k.starts_with(EXPIRY_PREFIX)).collect();
        assert_eq!(indexed.len(), 1);
        index_unindexed(&store, &listing.records, &indexed).await.expect("index");
        let due = store.due(Family::Transactions, Epoch::from_millis(5_000)).expect("due");
        let ids: Vec<&str> = due.iter().map(|(_, id)| id.as_str()).collect();
        assert_eq!(ids, ["OLD", "NEW"], "both expire, in their order");
    }
}
