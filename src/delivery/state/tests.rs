//! The state machine's unit tests (the model test is `model.rs`).

use super::*;
use crate::delivery::test_support::{offline_parts, subscription};

/// Deliveries over a fresh store, with a broker client that reaches nothing (none of this needs one).
async fn offline(dir: &std::path::Path) -> Deliveries {
    let store = Arc::new(StateStore::open(dir, true).expect("open"));
    let (broker, publisher, config) = offline_parts().await;
    Deliveries::new(store, broker, publisher, config)
}

/// [`offline`] deliveries with `sub` in place (the seed's retry policy).
async fn subscribed(dir: &std::path::Path, sub: &Subscription) -> Deliveries {
    let deliveries = offline(dir).await;
    deliveries.put_subscription(sub.clone(), RetryPolicy::SEED_DEFAULT).await.expect("subscribe");
    deliveries
}

fn popped(body: &[u8]) -> Popped {
    crate::delivery::test_support::popped("msg-1", body, 0)
}

/// A popped event of FIFO message group `group`.
fn popped_in_group(body: &[u8], group: &str) -> Popped {
    let mut popped = popped(body);
    popped.event.message_group = Some(group.to_owned());
    popped
}

fn long_poll() -> HandOut {
    HandOut { transport: "poll", ack_timeout: None, holder: None, fifo_batch: false }
}

/// The tracked id of the delivery whose body is `body`.
fn id_of(deliveries: &Deliveries, body: &[u8]) -> Id {
    let table = deliveries.table.lock();
    let ids: Vec<Id> = table.deliveries.keys().cloned().collect();
    drop(table);
    let bodies = ids.iter().map(|id| deliveries.store.get_raw_many(Family::Payloads, &[id]).expect("read"));
    ids.iter()
        .zip(bodies)
        .find(|(_, b)| b.first().cloned().flatten().as_deref() == Some(body))
        .expect("found")
        .0
        .clone()
}

#[tokio::test]
async fn a_hand_out_cancelled_while_it_is_stored_puts_its_deliveries_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sub = subscription();
    let deliveries = subscribed(dir.path(), &sub).await;
    assert!(matches!(deliveries.admit(&sub.key(), vec![popped(b"e")]).await, Admission::Admitted));
    // The caller stops waiting (its client went away) while the hand-out is being stored.
    deliveries.store.slow_down_commits(Duration::from_millis(500));
    let (key, to) = (sub.key(), long_poll());
    let cancelled = tokio::time::timeout(Duration::from_millis(100), deliveries.hand_out(&key, 1, &to, None));
    assert!(cancelled.await.is_err(), "the hand-out was still being stored");
    deliveries.store.slow_down_commits(Duration::ZERO);

    let again = deliveries.hand_out(&sub.key(), 1, &long_poll(), None).await.expect("hand out");
    assert_eq!(again.iter().map(|d| d.event.body.clone()).collect::<Vec<_>>(), vec![b"e".to_vec()]);
}

#[tokio::test]
async fn a_lost_fifo_head_takes_the_later_events_of_its_group_with_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sub = Subscription { ordered: true, ..subscription() };
    let deliveries = subscribed(dir.path(), &sub).await;
    let events = vec![
        popped_in_group(b"g1", "g"),
        popped_in_group(b"g2", "g"),
        popped_in_group(b"g3", "g"),
        popped_in_group(b"h1", "h"),
    ];
    assert!(matches!(deliveries.admit(&sub.key(), events).await, Admission::Admitted));
    let first = deliveries.hand_out(&sub.key(), 10, &long_poll(), None).await.expect("hand out");
    let mut bodies: Vec<Vec<u8>> = first.iter().map(|d| d.event.body.clone()).collect();
    bodies.sort();
    assert_eq!(bodies, vec![b"g1".to_vec(), b"h1".to_vec()], "only each group's head");

    // g1's lease lapses (popgate could not renew it): the broker will redeliver g1.
    let head = id_of(&deliveries, b"g1");
    let (g2, g3) = (id_of(&deliveries, b"g2"), id_of(&deliveries, b"g3"));
    let now = Epoch::now();
    if let Some(tracked) = deliveries.table.lock().deliveries.get_mut(&head) {
        tracked.record.handle.lease_until_ms = now - Duration::from_millis(1);
    }
    let owed = deliveries.sweep(now).await;
    assert!(owed.iter().all(|o| !matches!(o, Owed::GiveBack(..))), "the lapsed head is given up, not given back");
    assert!(deliveries.tracked_record(&head).is_none());

    // g2 must not overtake the redelivery of g1.
    assert!(deliveries.hand_out(&sub.key(), 10, &long_poll(), None).await.expect("hand out").is_empty());
    assert!(matches!(deliveries.ack(&g2).await, Err(DeliveryError::Stale)));
    let owed = deliveries.sweep(Epoch::now()).await;
    let mut given_back: Vec<Id> = owed
        .iter()
        .filter_map(|o| match o {
            Owed::GiveBack(id, "fifo_head_lost") => Some(id.clone()),
            _ => None,
        })
        .collect();
    given_back.sort();
    let mut expected = vec![g2.clone(), g3.clone()];
    expected.sort();
    assert_eq!(given_back, expected, "the rest of g goes back to the broker, and nothing of h");
}

/// What a sweep `at` gives back to the broker as unclaimed.
async fn given_back_unclaimed(deliveries: &Deliveries, at: Epoch) -> usize {
    let owed = deliveries.sweep(at).await;
    owed.iter().filter(|o| matches!(o, Owed::GiveBack(_, "unclaimed"))).count()
}

#[tokio::test]
async fn in_a_tier_what_is_due_where_no_consumer_waits_goes_back_to_the_broker() {
    let after = Duration::from_secs(20);
    let sub = subscription();
    let dir = tempfile::tempdir().expect("tempdir");
    let alone = subscribed(dir.path(), &sub).await;
    assert!(matches!(alone.admit(&sub.key(), vec![popped(b"a")]).await, Admission::Admitted));
    assert_eq!(
        given_back_unclaimed(&alone, Epoch::now() + Duration::from_millis(60_000)).await,
        0,
        "alone, it keeps it for its consumers"
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let tier = subscribed(dir.path(), &sub).await.giving_back_unclaimed(Some(after));
    assert!(matches!(tier.admit(&sub.key(), vec![popped(b"b")]).await, Admission::Admitted));
    // A consumer waits here: kept, however long it has been.
    tier.add_demand(&sub.key(), 1);
    assert_eq!(
        given_back_unclaimed(&tier, Epoch::now() + Duration::from_millis(60_000)).await,
        0,
        "a consumer waits for it here"
    );
    // It stops waiting: kept for `after`, then given back.
    tier.withdraw_demand(&sub.key(), 1);
    assert_eq!(
        given_back_unclaimed(&tier, Epoch::now() + Duration::from_millis(1_000)).await,
        0,
        "its consumer may be back soon"
    );
    let stopped = Epoch::now();
    let id = id_of(&tier, b"b");
    tier.table.lock().timers.push(std::cmp::Reverse((Epoch::from_millis(0), id)));
    assert_eq!(
        given_back_unclaimed(&tier, stopped + Duration::from_millis(21_000)).await,
        1,
        "nobody waited for it here for 20 s"
    );
    assert!(tier.hand_out(&sub.key(), 1, &long_poll(), None).await.expect("hand out").is_empty(), "claimed");
}

/// How long from now each tracked delivery's owed work waits, in ms.
fn owed_waits(deliveries: &Deliveries) -> Vec<u128> {
    let now = Epoch::now();
    deliveries.table.lock().deliveries.values().map(|t| now.until(t.owed_retry_at).as_millis()).collect()
}

#[tokio::test]
async fn owed_broker_acks_travel_together_and_back_off_exponentially_while_the_broker_is_down() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sub = subscription();
    let deliveries = subscribed(dir.path(), &sub).await;
    assert!(matches!(
        deliveries.admit(&sub.key(), vec![popped(b"a"), popped(b"b"), popped(b"c")]).await,
        Admission::Admitted
    ));
    let handed = deliveries.hand_out(&sub.key(), 10, &long_poll(), None).await.expect("hand out");
    let ids: Vec<Target<'_>> = handed.iter().map(|d| Target::from(&d.id)).collect();
    // The intents are stored (the subscribers' answers), the broker cannot be reached.
    assert!(deliveries.ack_many(&ids).await.iter().all(Result::is_ok));
    for wait in owed_waits(&deliveries) {
        assert!((700..=1_200).contains(&wait), "first retry after 1 s ± 20 %: {wait} ms");
    }

    // One sweep finds all three due: one piece of work, one batch request per broker.
    let owed = deliveries.sweep(Epoch::now() + Duration::from_millis(1_300)).await;
    assert_eq!(owed.len(), 1, "{owed:?}");
    assert!(matches!(&owed[0], Owed::BrokerAcks(batch) if batch.len() == 3));
    for work in owed {
        deliveries.perform(work).await;
    }
    for wait in owed_waits(&deliveries) {
        assert!((1_500..=2_400).contains(&wait), "second retry after 2 s ± 20 %: {wait} ms");
    }
}

/// Runs one sweep at popgate's `now` and all the owed work it finds.
async fn sweep_and_perform(deliveries: &Deliveries) {
    for owed in deliveries.sweep(Epoch::now()).await {
        deliveries.perform(owed).await;
    }
}

#[tokio::test(start_paused = true)]
async fn an_unacked_delivery_returns_on_the_seed_backoff_and_its_sixth_miss_goes_to_the_dlq() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(StateStore::open(dir.path(), true).expect("open"));
    let cluster = Arc::new(super::fake_cluster::FakeCluster::new(store.clone()));
    let (broker, _publisher, config) = offline_parts().await;
    let deliveries = Deliveries::with_cluster(store, broker, cluster.clone(), config);
    let sub = Subscription { ack_timeout_ms: 1_000, ..subscription() };
    deliveries.put_subscription(sub.clone(), RetryPolicy::SEED_DEFAULT).await.expect("subscribe");
    assert!(matches!(deliveries.admit(&sub.key(), vec![popped(b"x")]).await, Admission::Admitted));

    let mut waits = Vec::new();
    for attempt in 1..=6 {
        sweep_and_perform(&deliveries).await;
        let handed = deliveries.hand_out(&sub.key(), 10, &long_poll(), None).await.expect("hand out");
        assert_eq!(handed.iter().map(|d| d.attempt).collect::<Vec<_>>(), vec![attempt]);
        assert!(deliveries.hand_out(&sub.key(), 10, &long_poll(), None).await.expect("again").is_empty());
        // Its ACK deadline passes on paused time: the attempt is spent.
        tokio::time::advance(Duration::from_millis(1_001)).await;
        sweep_and_perform(&deliveries).await;
        let Some(record) = deliveries.tracked_record(&handed[0].id) else { panic!("still tracked") };
        match record.phase {
            Phase::Ready { due_ms } if attempt < 6 => {
                let wait = Epoch::now().until(due_ms);
                waits.push(wait.as_millis());
                tokio::time::advance(wait + Duration::from_millis(1)).await;
            }
            Phase::DeadLetter { .. } if attempt == 6 => {}
            other => panic!("after attempt {attempt}: {other:?}"),
        }
    }
    for (wait, base) in waits.iter().zip([1_000, 2_000, 4_000, 8_000, 16_000]) {
        assert!((base * 8 / 10..=base * 12 / 10).contains(wait), "{wait} ms is not {base} ms ± 20 %: {waits:?}");
    }
    // The sixth miss: written to the DLQ, then ACKed at the broker, then forgotten.
    sweep_and_perform(&deliveries).await;
    assert!(cluster.dead_lettered.lock().contains("msg-1"), "in the DLQ");
    assert_eq!(cluster.acked.lock().values().cloned().collect::<Vec<_>>(), vec!["msg-1".to_owned()]);
    assert!(cluster.violations.lock().is_empty(), "{:?}", cluster.violations.lock());
    assert!(deliveries.table.lock().deliveries.is_empty(), "retired");
}

#[tokio::test(start_paused = true)]
async fn a_hand_out_whose_time_ran_out_cannot_settle_the_next_one_and_a_repeated_ack_is_answered_ok() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sub = Subscription { ack_timeout_ms: 1_000, ..subscription() };
    let deliveries = subscribed(dir.path(), &sub).await;
    assert!(matches!(deliveries.admit(&sub.key(), vec![popped(b"x")]).await, Admission::Admitted));
    let first = deliveries.hand_out(&sub.key(), 1, &long_poll(), None).await.expect("hand out").remove(0);
    fn of(d: &Dispatched) -> Target<'_> {
        Target { id: &d.id, handout: Some(d.handout) }
    }
    // Its time runs out: before the sweeper has seen it, its holder may not settle it any more.
    tokio::time::advance(Duration::from_millis(2_000)).await;
    let late = deliveries.ack(of(&first)).await;
    assert!(matches!(late, Err(DeliveryError::Superseded)), "{late:?}");
    sweep_and_perform(&deliveries).await;
    tokio::time::advance(Duration::from_millis(2_000)).await;
    sweep_and_perform(&deliveries).await;
    let second = deliveries.hand_out(&sub.key(), 1, &long_poll(), None).await.expect("again").remove(0);
    assert_eq!((second.id.as_str(), second.handout), (first.id.as_str(), first.handout + 1));
    // The first holder is fenced; the second settles it, and may ACK again (it lost the answer).
    assert!(matches!(deliveries.ack(of(&first)).await, Err(DeliveryError::Superseded)));
    assert!(matches!(deliveries.nack(of(&first), None).await, Err(DeliveryError::Superseded)));
    assert!(deliveries.ack(of(&second)).await.is_ok());
    assert!(deliveries.ack(of(&second)).await.is_ok(), "a repeated ACK of the same hand-out");
    let late = deliveries.ack(of(&first)).await;
    assert!(matches!(late, Err(DeliveryError::Unknown | DeliveryError::Superseded)), "never the earlier one: {late:?}");
    // A delivery id alone (HTTP) ACKed twice is still "already acknowledged".
    assert!(matches!(deliveries.ack(&second.id).await, Err(DeliveryError::Unknown)));
}

#[tokio::test]
async fn an_auto_renewed_hand_out_is_renewed_only_once_its_client_took_it_in() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sub = subscription();
    let deliveries = subscribed(dir.path(), &sub).await;
    assert!(matches!(deliveries.admit(&sub.key(), vec![popped(b"x")]).await, Admission::Admitted));
    let holder = Holder { client_id: "app@1".into(), auto_renew: true, written: false };
    let to = HandOut {
        transport: "grpc",
        ack_timeout: Some(Duration::from_secs(10)),
        holder: Some(holder),
        fifo_batch: true,
    };
    let handed = deliveries.hand_out(&sub.key(), 1, &to, None).await.expect("hand out").remove(0);
    let clients = std::collections::HashSet::from(["app@1".to_owned()]);
    let (hold, max) = (Duration::from_secs(30), Duration::from_secs(3600));
    assert_eq!(deliveries.keep_held(&clients, hold, max).await.ok(), Some(0), "not renewed before it is written");

    let stale = (handed.id.clone(), handed.handout + 1);
    assert_eq!(deliveries.mark_written(&[stale]).await.ok(), Some(0), "another hand-out's mark changes nothing");
    let this = (handed.id.clone(), handed.handout);
    assert_eq!(deliveries.mark_written(std::slice::from_ref(&this)).await.ok(), Some(1));
    assert_eq!(deliveries.mark_written(&[this]).await.ok(), Some(0), "marked once");
    assert_eq!(deliveries.keep_held(&clients, hold, max).await.ok(), Some(1), "renewed once written");
    let stored: DeliveryRecord = deliveries
        .store()
        .get_with(Family::Deliveries, &handed.id, DeliveryRecord::decode)
        .expect("read")
        .expect("kept");
    assert!(
        matches!(stored.phase, Phase::AwaitingAck { holder: Some(Holder { written: true, .. }), .. }),
        "the mark is stored: {:?}",
        stored.phase
    );
}

#[tokio::test]
async fn a_broker_clock_a_minute_behind_does_not_make_fresh_leases_look_lapsed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sub = subscription();
    let deliveries = subscribed(dir.path(), &sub).await;
    let mut event = popped(b"x");
    // As the POP path records it: the broker's popTime a minute behind, the lease from the send time.
    event.handle.pop_time_ms = (Epoch::now() - Duration::from_millis(60_000)).as_millis();
    event.handle.invisible_ms = 60_000;
    event.handle.lease_until_ms = Epoch::now() + Duration::from_millis(60_000);
    assert!(matches!(deliveries.admit(&sub.key(), vec![event]).await, Admission::Admitted));
    let handed = deliveries.hand_out(&sub.key(), 10, &long_poll(), None).await.expect("hand out");
    assert_eq!(handed.len(), 1, "not judged lapsed");
    assert!(deliveries.sweep(Epoch::now()).await.iter().all(|o| !matches!(o, Owed::Renew(_))), "nor due for renewal");
}

#[tokio::test]
async fn a_body_is_stored_apart_kept_out_of_memory_and_read_back_at_hand_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sub = subscription();
    let deliveries = subscribed(dir.path(), &sub).await;
    assert!(matches!(deliveries.admit(&sub.key(), vec![popped(b"the body")]).await, Admission::Admitted));

    let id = deliveries.table.lock().deliveries.keys().next().cloned().expect("tracked");
    let in_memory = deliveries.tracked_record(&id).expect("record");
    assert!(in_memory.body_apart && in_memory.event.body.is_empty(), "memory holds no body");
    let stored: DeliveryRecord =
        deliveries.store.get_with(Family::Deliveries, &id, DeliveryRecord::decode).expect("read").expect("stored");
    assert!(stored.event.body.is_empty(), "nor does the stored record");

    let to = HandOut { transport: "poll", ack_timeout: None, holder: None, fifo_batch: false };
    let handed = deliveries.hand_out(&sub.key(), 10, &to, None).await.expect("hand out");
    assert_eq!(handed.len(), 1);
    assert_eq!(handed[0].event.body, b"the body");

    deliveries.retire(&id).await;
    let left = deliveries.store.get_raw_many(Family::Payloads, &[&id]).expect("read");
    assert_eq!(left, vec![None], "the body goes with its delivery");
}

#[tokio::test]
async fn deliveries_share_one_copy_of_their_group_topic_and_broker_names() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sub = subscription();
    let deliveries = subscribed(dir.path(), &sub).await;
    assert!(matches!(deliveries.admit(&sub.key(), vec![popped(b"a"), popped(b"b")]).await, Admission::Admitted));
    let table = deliveries.table.lock();
    let records: Vec<&DeliveryRecord> = table.deliveries.values().map(|t| &t.record).collect();
    assert_eq!(records.len(), 2);
    assert!(Arc::ptr_eq(&records[0].group, &records[1].group));
    assert!(Arc::ptr_eq(&records[0].topic, &records[1].topic));
    assert!(Arc::ptr_eq(&records[0].handle.broker_name, &records[1].handle.broker_name));
    assert!(Arc::ptr_eq(&records[0].handle.broker_addr, &records[1].handle.broker_addr));
}

#[tokio::test]
async fn a_delivery_whose_stored_body_is_gone_is_not_handed_out_empty() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sub = subscription();
    let deliveries = subscribed(dir.path(), &sub).await;
    assert!(matches!(deliveries.admit(&sub.key(), vec![popped(b"x")]).await, Admission::Admitted));
    let id = deliveries.table.lock().deliveries.keys().next().cloned().expect("tracked");
    deliveries.store.delete(Family::Payloads, &id).await.expect("delete");

    let to = HandOut { transport: "poll", ack_timeout: None, holder: None, fifo_batch: false };
    assert!(deliveries.hand_out(&sub.key(), 10, &to, None).await.expect("hand out").is_empty());
    assert!(deliveries.tracked_record(&id).is_none(), "retired; the broker redelivers it");
}
