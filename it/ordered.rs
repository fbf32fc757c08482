//! FIFO message groups against a real broker: per-group order holds through random NACKs, a poison event is
//! dead-lettered and its group continues, and different groups proceed in parallel.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::harness::direct::Direct;
use crate::harness::popgate::Popgate;
use crate::harness::{eventually, unique_topic};
use crate::publish::shared_cluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_groups_keep_their_order_through_nacks_and_a_poison_event_does_not_block_its_group() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "[delivery]\nlease_ms = 20000\npop_poll_ms = 500\n").await;
    let (topic, group) = (unique_topic("fifo"), unique_topic("g_fifo"));
    // FIFO needs a topic whose queues do not change while it is used (as in RocketMQ, a group maps to
    // hash % queue count): create it on both brokers up front instead of relying on auto-creation.
    let addrs: Vec<String> = cluster.brokers.iter().map(|b| format!("127.0.0.1:{}", b.port)).collect();
    Direct::connect(&cluster.namesrv_addr).await.create_topic(&topic, &addrs).await;
    let (status, answer) = popgate
        .post_json(
            "/events/subscribe",
            &json!({"group": group, "topic": topic, "ordered": true, "maxAttempts": 3,
                "initialBackoffMs": 100, "maxBackoffMs": 200, "ackTimeoutMs": 10000}),
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    let groups = ["A", "B", "C"];
    let per_group = 50;
    for i in 0..per_group {
        for g in groups {
            let (status, answer) =
                popgate.publish(&json!({"topic": topic, "data": format!("{g}-{i}"), "messageGroup": g})).await;
            assert_eq!(status, 200, "{answer}");
        }
    }
    let poison = "B-10";

    let mut rng = StdRng::seed_from_u64(7);
    let mut expected: HashMap<String, usize> = groups.iter().map(|g| ((*g).to_owned(), 0)).collect();
    let mut acked = 0;
    let mut nacks = 0;
    let mut in_parallel = 0;
    let mut history: Vec<String> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while acked < groups.len() * per_group - 1 && Instant::now() < deadline {
        let batch = popgate.poll(&group, &topic, 10, 500).await;
        let distinct: std::collections::HashSet<String> =
            batch.iter().filter_map(|d| d["event"]["data"].as_str()).map(|d| d[..1].to_owned()).collect();
        if distinct.len() > 1 {
            in_parallel += 1;
        }
        for delivery in batch {
            let data = delivery["event"]["data"].as_str().expect("data").to_owned();
            let (g, i) = data.split_once('-').expect("group-index");
            let i: usize = i.parse().expect("index");
            let id = delivery["deliveryId"].as_str().expect("id").to_owned();
            history.push(format!("{data} attempt {} id {}", delivery["attempt"], &id[..8]));
            assert_eq!(
                i,
                expected[g],
                "group {g} delivered {data} while {g}-{} is unsettled; history: {:?}",
                expected[g],
                &history[history.len().saturating_sub(12)..]
            );
            if data == poison {
                let (status, answer) =
                    popgate.post_json("/events/nack", &json!({"deliveryId": id, "delayMs": 0})).await;
                assert_eq!(status, 200, "{answer}");
                if answer["status"] == "dead_letter" {
                    expected.insert(g.to_owned(), i + 1);
                }
            } else if delivery["attempt"] == 1 && rng.random_bool(0.2) {
                // At most one random NACK per event, so only the poison one can exhaust its 3 attempts.
                let (status, _) = popgate.post_json("/events/nack", &json!({"deliveryId": id, "delayMs": 50})).await;
                assert_eq!(status, 200);
                history.push(format!("nacked {data}"));
                nacks += 1;
            } else {
                assert_eq!(popgate.ack(&id).await.0, 200);
                history.push(format!("acked {data}"));
                expected.insert(g.to_owned(), i + 1);
                acked += 1;
            }
        }
    }
    assert_eq!(acked, groups.len() * per_group - 1, "every event but the poison one is consumed, in order");
    assert!(nacks > 10, "the random NACKs happened ({nacks})");
    assert!(in_parallel > 0, "different groups were in flight at the same time");
    eventually(Duration::from_secs(20), "the poison event is in the DLQ", || async {
        popgate.metric(&format!("popgate_dlq_messages_total{{group=\"{group}\"}}")).await == 1.0
    })
    .await;
}
