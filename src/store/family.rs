//! The column families: one per kind of record ([`Family`]), their sizes, and how the database is opened
//! with all of them. Its own room because it is the one place that knows RocksDB's layout.

use std::path::Path;

use rocksdb::{ColumnFamilyDescriptor, Options, DB};

use super::StoreError;

/// Which kind of record; each has its own column family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// In-flight deliveries, keyed by deliveryId.
    Deliveries,
    /// Subscriptions, keyed by group and topic.
    Subscriptions,
    /// DLQ replay progress, keyed by DLQ topic and message id.
    DlqReplays,
    /// The body of each in-flight delivery, keyed by deliveryId: written once at admission, read at hand-out
    /// and for the DLQ, deleted with the delivery. Kept apart so memory and every phase change carry only
    /// the small record.
    Payloads,
    /// The publish de-duplication window: the receipt of each recent send by its key, and an expiry index.
    Published,
    /// Transactional messages: what ending each transaction needs, and how it ended, by transaction id.
    Transactions,
    /// In a tier, ACKs made at the broker for another instance's deliveries while it could not be reached,
    /// keyed by that instance and the delivery id, until it is told.
    UntoldAcks,
    /// In a tier, subscriptions removed (by group and topic) and the version of the removal, so an instance
    /// that still has one does not bring it back (`delivery::shared`).
    RemovedSubscriptions,
}

impl Family {
    const ALL: [Family; 8] = [
        Family::Deliveries,
        Family::Subscriptions,
        Family::DlqReplays,
        Family::Payloads,
        Family::Published,
        Family::Transactions,
        Family::UntoldAcks,
        Family::RemovedSubscriptions,
    ];

    /// The family's memtable size. Memtables count in popgate's RSS (two per family at most), so they are
    /// far below RocksDB's 64 MiB: a delivery's records (admitted, handed out, deleted) and its body (written,
    /// read, deleted) still mostly meet and cancel within one memtable, since a delivery lives for
    /// milliseconds to seconds under load. Bodies are the bulk of the bytes and are written once, so their
    /// memtable is the smallest.
    fn write_buffer_bytes(self) -> usize {
        match self {
            Family::Payloads => 4 * 1024 * 1024,
            Family::Deliveries => 8 * 1024 * 1024,
            Family::Subscriptions | Family::DlqReplays | Family::Published | Family::Transactions => 4 * 1024 * 1024,
            // Written only while a peer cannot be reached.
            Family::UntoldAcks | Family::RemovedSubscriptions => 1024 * 1024,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Family::Deliveries => "deliveries",
            Family::Subscriptions => "subscriptions",
            Family::DlqReplays => "dlq_replays",
            Family::Payloads => "payloads",
            Family::Published => "published",
            Family::Transactions => "transactions",
            Family::UntoldAcks => "untold_acks",
            Family::RemovedSubscriptions => "removed_subscriptions",
        }
    }
}

pub(super) fn open_db(dir: &Path) -> Result<DB, StoreError> {
    let mut options = Options::default();
    options.create_if_missing(true);
    options.create_missing_column_families(true);
    // Deliveries are small and short-lived: keep the memory and file footprint modest.
    options.set_max_total_wal_size(64 * 1024 * 1024);
    options.set_keep_log_file_num(3);
    let families = Family::ALL.iter().map(|f| {
        let mut family = Options::default();
        family.set_write_buffer_size(f.write_buffer_bytes());
        ColumnFamilyDescriptor::new(f.name(), family)
    });
    DB::open_cf_descriptors(&options, dir, families)
        .map_err(|source| StoreError::Open { path: dir.display().to_string(), source })
}

pub(super) fn family_handle(db: &DB, family: Family) -> &rocksdb::ColumnFamily {
    // Every family is created at open (`create_missing_column_families`), so the handle always exists.
    #[allow(clippy::expect_used)]
    db.cf_handle(family.name()).expect("column family created at open")
}
