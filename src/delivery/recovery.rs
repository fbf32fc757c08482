//! Boot recovery: rebuild the delivery state from the store after a restart or a `kill -9`. It reads the
//! store and hands each record to the state's owner ([`Deliveries::restore`]); it changes nothing itself.
//!
//! What is trusted, and what happens to each stored record:
//! - **Subscriptions** are restored as stored; their POP loops start again.
//! - **Awaiting ACK** (handed out when popgate died): dispatched again at once with its attempt counter kept
//!   (the client sees it again: at-least-once), and until then its deliveryId still settles it: the
//!   subscriber that held it may ACK it late. Nothing is ACKed for it.
//! - **Ready** (waiting for an attempt): dispatched at its due time, attempt kept.
//! - **ACKed (the ACK intent)**: the client did ACK; only the broker ACK is owed, and it is finished now
//!   instead of redelivering the event.
//! - **Dead-letter pending**: the DLQ write (then the broker ACK) is retried.
//! - **Undecodable** (corrupt, or from an incompatible version): retired *without* any broker ACK and counted;
//!   the broker's redelivery bounds it.
//! - A record whose broker lease lapsed while popgate was down (awaiting ACK or ready) is never handed out
//!   again: the sweeper's first pass gives it up, and the broker redelivers that message as a new delivery,
//!   unless it was settled meanwhile elsewhere (in a tier, the survivors ACK at the broker what this instance
//!   had handed out). Counted as `lease_lapsed`, not as dispatched again.
//!
//! The one thing recovery never does is pretend an absent client ACKed. Recovery is idempotent: records
//! already tracked are skipped, so running it twice changes nothing.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use metrics::counter;

use super::record::{DeliveryRecord, Subscription};
use super::retry::RetryPolicy;
use super::state::{Deliveries, Restored};
use crate::config::DeliveryConfig;
use crate::metrics as m;
use crate::store::{Family, StoreError};

/// What one recovery pass found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Subscriptions restored.
    pub subscriptions: usize,
    /// Deliveries dispatched again (their attempt kept).
    pub redispatched: usize,
    /// Unsettled deliveries whose broker lease lapsed while popgate was down: given up to the broker.
    pub lease_lapsed: usize,
    /// Deliveries whose ACK intent is replayed to the broker.
    pub ack_pending: usize,
    /// Deliveries owed to the DLQ.
    pub dead_letter_pending: usize,
    /// Undecodable records retired without a broker ACK.
    pub corrupt: usize,
    /// Records already tracked, left alone.
    pub skipped: usize,
}

/// Records decoded and handed to the restoring thread at once.
const RESTORE_BATCH: usize = 1_024;
/// Decoded batches that may wait for the restoring thread: the reader runs at most this far ahead of it.
const RESTORE_BATCHES_AHEAD: usize = 8;

/// A subscription key and the stop flag of its POP loop, for the caller to start the loop.
pub(super) type PopLoop = (String, Arc<AtomicBool>);

/// Loads subscriptions and deliveries into `deliveries`; returns the report and, for each subscription that
/// was not served yet, its POP loop to start.
///
/// # Errors
/// [`StoreError`] when the store cannot be read.
pub(super) async fn recover(deliveries: &Deliveries) -> Result<(RecoveryReport, Vec<PopLoop>), StoreError> {
    let mut report = RecoveryReport::default();
    let mut poppers = Vec::new();
    for (_, sub) in deliveries.store().list::<Subscription>(Family::Subscriptions)?.records {
        let key = sub.key();
        let policy = policy_of(&sub, deliveries.config());
        if let Some(stop) = deliveries.restore_subscription(sub, policy) {
            poppers.push((key, stop));
            report.subscriptions += 1;
        }
    }

    // Restored as the store is read, in two stages on two threads: this one reads and decodes, another
    // restores what it decoded, a batch at a time. Either stage allocates about half of what the table ends up
    // holding (a kilobyte per record), and the kernel zeroing those fresh pages was half the boot's CPU, on one
    // core. The records are never all decoded at once, and each is decoded from the store's own buffer. The
    // store's read guard is held meanwhile, so an undecodable record is only noted here and discarded
    // afterwards. The metrics are counted once at the end: a million counter look-ups would be a noticeable
    // part of the boot.
    let mut undecodable = Vec::new();
    let mut legacy = 0usize;
    let restored_into = &mut report;
    let (scanned, redelivered) = std::thread::scope(|scope| {
        let (decoded, to_restore) = std::sync::mpsc::sync_channel::<Vec<DeliveryRecord>>(RESTORE_BATCHES_AHEAD);
        let restorer = scope.spawn(move || {
            let mut redelivered = 0u64;
            for record in to_restore.into_iter().flatten() {
                redelivered += u64::from(restore_one(deliveries, record, restored_into));
            }
            redelivered
        });
        let mut batch = Vec::with_capacity(RESTORE_BATCH);
        let scanned = deliveries.store().scan(Family::Deliveries, |key, value| match DeliveryRecord::decode(value) {
            Ok(record) => {
                legacy += usize::from(DeliveryRecord::is_legacy_json(value));
                batch.push(record);
                if batch.len() == RESTORE_BATCH {
                    // A restorer that is gone panicked: its join below says so.
                    let _ = decoded.send(std::mem::replace(&mut batch, Vec::with_capacity(RESTORE_BATCH)));
                }
            }
            Err(error) => undecodable.push((String::from_utf8_lossy(key).into_owned(), error)),
        });
        let _ = decoded.send(batch);
        drop(decoded);
        let redelivered = restorer.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (scanned, redelivered)
    });
    scanned?;
    deliveries.publish_pending_gauge();
    counter!(m::REDELIVERIES, "reason" => "recovery").increment(redelivered);
    for (outcome, count) in [
        ("redispatched", report.redispatched),
        ("lease_lapsed", report.lease_lapsed),
        ("ack_pending", report.ack_pending),
        ("dead_letter_pending", report.dead_letter_pending),
    ] {
        counter!(m::RECOVERED_DELIVERIES, "outcome" => outcome).increment(count as u64);
    }
    if legacy > 0 {
        tracing::info!(
            legacy,
            "Delivery records in the JSON form of earlier versions read; each is rewritten at its next change."
        );
    }
    for (key, error) in &undecodable {
        tracing::warn!(record = %key, %error, "Undecodable delivery record retired without a broker ACK.");
        deliveries.discard_undecodable(key).await;
        counter!(m::RECOVERED_DELIVERIES, "outcome" => "corrupt").increment(1);
        report.corrupt += 1;
    }
    Ok((report, poppers))
}

/// Tracks one stored record again and counts what became of it; true when it had been handed out and is
/// dispatched again (a redelivery).
fn restore_one(deliveries: &Deliveries, record: DeliveryRecord, report: &mut RecoveryReport) -> bool {
    match deliveries.restore(record) {
        Restored::Skipped => report.skipped += 1,
        Restored::Redispatched { was_handed_out } => {
            report.redispatched += 1;
            return was_handed_out;
        }
        Restored::LeaseLapsed => report.lease_lapsed += 1,
        Restored::AckPending => report.ack_pending += 1,
        Restored::DeadLetterPending => report.dead_letter_pending += 1,
    }
    false
}

/// The subscription's policy, falling back to the configured defaults if the stored values are unusable.
fn policy_of(sub: &Subscription, config: &DeliveryConfig) -> RetryPolicy {
    RetryPolicy::try_new(
        std::time::Duration::from_millis(sub.initial_backoff_ms),
        std::time::Duration::from_millis(sub.max_backoff_ms),
        config.jitter_ratio,
        sub.max_attempts,
    )
    .or_else(|_| RetryPolicy::from_config(config))
    .unwrap_or(RetryPolicy::SEED_DEFAULT)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use std::time::Duration;

    use super::*;
    use crate::broker::consumer::{PoppedEvent, ReceiptHandle};
    use crate::clock::Epoch;
    use crate::delivery::record::{Holder, Phase};
    use crate::delivery::test_support::{offline_parts, subscription};
    use crate::delivery::Dispatcher;
    use crate::store::StateStore;

    fn record(id: &str, phase: Phase, attempt: u32) -> DeliveryRecord {
        DeliveryRecord {
            id: id.into(),
            group: "g".into(),
            topic: "t".into(),
            event: PoppedEvent {
                id: format!("msg-{id}"),
                topic: "t".into(),
                tags: None,
                keys: Vec::new(),
                properties: Default::default(),
                body: b"body".to_vec(),
                born_timestamp: 0,
                reconsume_times: 0,
                retry_topic: None,
                message_group: None,
                stored: Default::default(),
            },
            handle: ReceiptHandle {
                broker_name: "broker-a".into(),
                broker_addr: "127.0.0.1:1".into(),
                extra_info: "0 0 0 0 0 broker-a 0 0".to_owned(),
                ack_topic: "t".into(),
                queue_id: 0,
                queue_offset: 0,
                // A lease far in the future: the sweeper neither renews nor gives it up during the test.
                pop_time_ms: Epoch::now().as_millis(),
                invisible_ms: 3_600_000,
                lease_until_ms: Epoch::now() + Duration::from_millis(3_600_000),
            },
            attempt,
            phase,
            last_failure: None,
            seq: 0,
            body_apart: false,
            handouts: 0,
        }
    }

    /// `record` with a broker lease that lapsed a minute ago.
    fn lapsed_while_down(mut record: DeliveryRecord) -> DeliveryRecord {
        record.handle.pop_time_ms = (Epoch::now() - Duration::from_secs(120)).as_millis();
        record.handle.invisible_ms = 60_000;
        record.handle.lease_until_ms = Epoch::now() - Duration::from_secs(60);
        record
    }

    /// A dispatcher over `store` with no reachable broker: recovery itself must not need one.
    async fn start_offline(store: impl Into<Arc<StateStore>>) -> (Arc<Dispatcher>, RecoveryReport) {
        let (broker, publisher, config) = offline_parts().await;
        Dispatcher::start(
            store.into(),
            broker,
            publisher,
            config,
            None,
            crate::delivery::Issuer { instance: "", lease_seal: None, give_back_unclaimed: None },
        )
        .await
        .expect("start")
    }

    #[tokio::test]
    async fn a_grpc_clients_hand_out_stays_with_it_across_a_restart_and_its_keep_alive_extends_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = StateStore::open(dir.path(), true).expect("open");
        let sub = subscription();
        store.put(Family::Subscriptions, &sub.key(), &sub).await.expect("put sub");
        let soon = Epoch::now() + Duration::from_millis(5_000);
        let holder = Holder { client_id: "app@1".into(), auto_renew: true, written: true };
        let held = record(
            "held",
            Phase::AwaitingAck { deadline_ms: soon, dispatched_ms: Epoch::now(), holder: Some(holder) },
            2,
        );
        store.put(Family::Deliveries, &held.id, &held).await.expect("put");

        let (dispatcher, report) = start_offline(store).await;
        assert_eq!(report.redispatched, 1, "counted as in flight");
        let polled = dispatcher.poll("g", "t", 10, Duration::from_millis(300)).await.expect("poll");
        assert!(polled.is_empty(), "not handed to anyone else: its client still holds it");

        let clients = |id: &str| std::collections::HashSet::from([id.to_owned()]);
        let hold = Duration::from_secs(30);
        assert_eq!(dispatcher.keep_held(&clients("other@2"), hold, Duration::from_secs(3600)).await.ok(), Some(0));
        assert_eq!(dispatcher.keep_held(&clients("app@1"), hold, Duration::from_secs(3600)).await.ok(), Some(1));
        assert_eq!(
            dispatcher.keep_held(&clients("app@1"), hold, Duration::from_secs(3600)).await.ok(),
            Some(0),
            "not due yet"
        );
        let due = Epoch::from_millis(dispatcher.in_flight(Some("g"), 1)[0].due_ms.unwrap_or(0));
        assert!(due >= Epoch::now() + Duration::from_millis(25_000), "the deadline moved 30 s ahead: {due}");
        assert_eq!(dispatcher.hold_of("held").and_then(|(_, _, h)| h).map(|h| h.client_id), Some("app@1".into()));
        dispatcher.shutdown().await;
    }

    #[tokio::test]
    async fn a_hand_out_popgate_died_before_writing_to_its_grpc_client_is_dispatched_again_at_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = StateStore::open(dir.path(), true).expect("open");
        let sub = subscription();
        store.put(Family::Subscriptions, &sub.key(), &sub).await.expect("put sub");
        let later = Epoch::now() + Duration::from_millis(30_000);
        let holder = Holder { client_id: "app@1".into(), auto_renew: true, written: false };
        let mut unwritten = record(
            "unwritten",
            Phase::AwaitingAck { deadline_ms: later, dispatched_ms: Epoch::now(), holder: Some(holder) },
            2,
        );
        unwritten.handouts = 2;
        store.put(Family::Deliveries, &unwritten.id, &unwritten).await.expect("put");

        let (dispatcher, _) = start_offline(store).await;
        let clients = std::collections::HashSet::from(["app@1".to_owned()]);
        let hold = Duration::from_secs(30);
        assert_eq!(
            dispatcher.keep_held(&clients, hold, Duration::from_secs(3600)).await.ok(),
            Some(0),
            "never renewed for the client: it may never have seen the message"
        );
        let polled = dispatcher.poll("g", "t", 10, Duration::from_millis(500)).await.expect("poll");
        let seen: Vec<(&str, u32, u32)> = polled.iter().map(|d| (d.id.as_str(), d.attempt, d.handout)).collect();
        assert_eq!(seen, vec![("unwritten", 2, 3)], "handed out again at once, its attempt kept, a new hand-out");
        dispatcher.shutdown().await;
    }

    #[tokio::test]
    async fn recovery_replays_each_phase_retires_corrupt_records_and_is_idempotent() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = StateStore::open(dir.path(), true).expect("open");
        let sub = subscription();
        store.put(Family::Subscriptions, &sub.key(), &sub).await.expect("put sub");
        let planted = [
            record(
                "awaiting",
                Phase::AwaitingAck {
                    deadline_ms: Epoch::from_millis(0),
                    dispatched_ms: Epoch::from_millis(0),
                    holder: None,
                },
                3,
            ),
            record("ready", Phase::Ready { due_ms: Epoch::from_millis(0) }, 2),
            record("acked", Phase::Acked, 1),
            record("dead", Phase::DeadLetter { reason: "r".into() }, 6),
            lapsed_while_down(record(
                "lapsed",
                Phase::AwaitingAck { deadline_ms: Epoch::ZERO, dispatched_ms: Epoch::ZERO, holder: None },
                1,
            )),
        ];
        for r in &planted {
            store.put(Family::Deliveries, &r.id, r).await.expect("put");
        }
        store.put_raw(Family::Deliveries, "garbage", b"\xff not json").await.expect("put raw");

        let (dispatcher, report) = start_offline(store).await;
        assert_eq!(
            report,
            RecoveryReport {
                subscriptions: 1,
                redispatched: 2,
                lease_lapsed: 1,
                ack_pending: 1,
                dead_letter_pending: 1,
                corrupt: 1,
                skipped: 0
            }
        );
        assert_eq!(dispatcher.subscriptions(), vec![sub]);

        let again = dispatcher.recover_again().await.expect("second pass");
        assert_eq!(again, RecoveryReport { skipped: 5, ..RecoveryReport::default() }, "a second pass changes nothing");

        // The redispatched deliveries keep their ids and attempt counters.
        let polled = dispatcher.poll("g", "t", 10, std::time::Duration::from_millis(500)).await.expect("poll");
        let mut seen: Vec<(String, u32)> = polled.iter().map(|d| (d.id.clone(), d.attempt)).collect();
        seen.sort();
        assert_eq!(seen, vec![("awaiting".to_owned(), 3), ("ready".to_owned(), 2)], "never the lapsed one");
        dispatcher.shutdown().await;
    }

    #[tokio::test]
    async fn a_json_record_of_an_earlier_version_is_rewritten_compact_at_its_first_change_and_not_before() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(StateStore::open(dir.path(), true).expect("open"));
        let sub = subscription();
        store.put(Family::Subscriptions, &sub.key(), &sub).await.expect("put sub");
        let due = record("due", Phase::Ready { due_ms: Epoch::ZERO }, 2);
        let later = record("later", Phase::Ready { due_ms: Epoch::now() + Duration::from_secs(3_600) }, 2);
        for r in [&due, &later] {
            // `put` writes JSON: the form every earlier popgate stored.
            store.put(Family::Deliveries, &r.id, r).await.expect("put");
        }
        let stored = |id: &str| store.get_raw_many(Family::Deliveries, &[id]).expect("read").remove(0).expect("kept");

        let (dispatcher, report) = start_offline(store.clone()).await;
        assert_eq!(report.redispatched, 2);
        assert!(DeliveryRecord::is_legacy_json(&stored("due")), "recovery itself rewrites nothing");
        let polled = dispatcher.poll("g", "t", 10, Duration::from_millis(300)).await.expect("poll");
        assert_eq!(polled.iter().map(|d| (d.id.as_str(), d.attempt)).collect::<Vec<_>>(), vec![("due", 2)]);

        let handed = stored("due");
        assert_eq!(handed[0], 0x01, "handing it out rewrote it in the compact form");
        let decoded = DeliveryRecord::decode(&handed).expect("decodes");
        assert!(matches!(decoded.phase, Phase::AwaitingAck { .. }) && decoded.attempt == 2, "{decoded:?}");
        assert_eq!(DeliveryRecord::decode(&stored("later")).expect("decodes"), later, "untouched: still JSON");
        assert!(DeliveryRecord::is_legacy_json(&stored("later")));
        dispatcher.shutdown().await;
    }

    #[tokio::test]
    async fn stopped_pop_loops_are_not_kept_for_ever() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (dispatcher, _) = start_offline(StateStore::open(dir.path(), true).expect("open")).await;
        let request =
            |group: String| crate::delivery::SubscriptionRequest { group, topic: "t".into(), ..Default::default() };
        for n in 0..20 {
            dispatcher.subscribe(request(format!("g{n}"))).await.expect("subscribe");
            dispatcher.unsubscribe(&format!("g{n}"), "t").await.expect("unsubscribe");
        }
        // Each stopped loop ends within its pause (1 s); the next start drops the finished ones.
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        dispatcher.subscribe(request("last".into())).await.expect("subscribe");
        let kept = dispatcher.background_tasks();
        assert!(kept <= 3, "{kept} tasks kept: the sweeper, the last POP loop, and no stopped one");
        dispatcher.shutdown().await;
    }
}
