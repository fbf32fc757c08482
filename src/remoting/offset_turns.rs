//! A consumer group's offset requests on a topic, relayed one at a time in the order they reached popgate.
//!
//! Straight at a broker, a client's requests arrive one after another on its connection. popgate serves each
//! request on a task of its own, so the offset commits a consumer sends back to back at its shutdown (one
//! one-way `UPDATE_CONSUMER_OFFSET` per queue) would reach the broker at the same instant. Apache's broker loses
//! one of two commits that reach it at once when they are a group's first on a topic: its
//! `ConsumerOffsetManager.commitOffset` (5.4.0) makes the group's offset table with a get-then-put, not
//! `computeIfAbsent`, and the later table replaces the earlier. A lite pull consumer restarted after such a loss
//! read a committed message again.
//!
//! So a broker's commits and offset queries of a topic and group take turns: a turn is taken as its frame is read
//! (in the order the client sent them), and each waits until the one before it was answered or given up, one-way
//! retries included. A query then also sees every commit sent before it, as it would straight at the broker. Each
//! broker keeps its own tables, so a broker that does not answer holds up only its own lanes.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;
use tokio::sync::oneshot;

use super::codes;
use super::service::field;

/// Whose turns follow each other: a broker keeps offsets by topic and group.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Lane {
    /// The broker the request names, or whose port it came in on; empty when neither says (a client before
    /// 4.9.5 on the front's own port, whose broker is found later from the route): one lane for all brokers.
    broker: String,
    topic: String,
    group: String,
}

/// A lane with a turn not yet over: the turn that holds it, and the turns waiting behind it by the order they
/// were taken in. A plain queue rather than a chain of futures, so a turn waits at the same cost however many
/// are ahead of it (a client may send thousands of commits in one write).
struct Queue {
    holder: u64,
    waiting: BTreeMap<u64, oneshot::Sender<()>>,
}

type Lanes = Arc<Mutex<HashMap<Lane, Queue>>>;

/// The lanes that have a turn not yet over.
#[derive(Default)]
pub(super) struct OffsetTurns {
    lanes: Lanes,
    next_id: AtomicU64,
}

impl OffsetTurns {
    /// Whether `request` takes a turn in a lane: an offset commit or query.
    pub fn takes_turns(request: &RemotingCommand) -> bool {
        matches!(request.code(), codes::UPDATE_CONSUMER_OFFSET | codes::QUERY_CONSUMER_OFFSET)
    }

    /// A turn for `request` when it is an offset commit or query (`None` for anything else): taken now, behind
    /// every turn of its lane taken before. `port_broker`: the broker whose port the request came in on, if any.
    pub fn take(&self, request: &RemotingCommand, port_broker: Option<&str>) -> Option<Turn> {
        if !Self::takes_turns(request) {
            return None;
        }
        let lane = Lane {
            broker: field(request, "bname").or(port_broker).unwrap_or_default().to_owned(),
            topic: field(request, "topic")?.to_owned(),
            group: field(request, "consumerGroup")?.to_owned(),
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut lanes = self.lanes.lock();
        let go_ahead = match lanes.get_mut(&lane) {
            Some(queue) => {
                let (go_ahead, gone_ahead) = oneshot::channel();
                queue.waiting.insert(id, go_ahead);
                Some(gone_ahead)
            }
            None => {
                lanes.insert(lane.clone(), Queue { holder: id, waiting: BTreeMap::new() });
                None
            }
        };
        drop(lanes);
        Some(Turn { lanes: self.lanes.clone(), lane, id, go_ahead })
    }

    /// Lanes with a turn not yet over.
    #[cfg(test)]
    fn busy_lanes(&self) -> usize {
        self.lanes.lock().len()
    }
}

/// One request's place in its lane; the next turn starts when this one is dropped, however its task ended.
pub(super) struct Turn {
    lanes: Lanes,
    lane: Lane,
    id: u64,
    /// Signalled when the lane passes to this turn; `None` once it holds the lane.
    go_ahead: Option<oneshot::Receiver<()>>,
}

impl Turn {
    /// Waits until every earlier turn of the lane is over.
    pub async fn wait(&mut self) {
        if let Some(gone_ahead) = self.go_ahead.as_mut() {
            // The sender is used only to hand the lane on: once it has answered, this turn holds the lane.
            let _ = gone_ahead.await;
            self.go_ahead = None;
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let mut lanes = self.lanes.lock();
        let Some(queue) = lanes.get_mut(&self.lane) else { return };
        if queue.holder != self.id {
            // Given up while still waiting (its task ended): it leaves the queue and the holder stays.
            queue.waiting.remove(&self.id);
            return;
        }
        // A waiting turn leaves the queue under this lock before its receiver goes, so the lane is handed only
        // to a turn that is still there to take it.
        match queue.waiting.pop_first() {
            Some((next, go_ahead)) => {
                queue.holder = next;
                let _ = go_ahead.send(());
            }
            // The lane's last turn leaves no one waiting: the lane goes, so lanes do not pile up.
            None => {
                lanes.remove(&self.lane);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn offset_request(code: i32, topic: &str, group: &str) -> RemotingCommand {
        let mut request = RemotingCommand::create_remoting_command(code);
        request.add_ext_field("topic", topic);
        request.add_ext_field("consumerGroup", group);
        request.add_ext_field("queueId", "0");
        request.add_ext_field("bname", "broker-a");
        request
    }

    fn commit(topic: &str, group: &str) -> RemotingCommand {
        offset_request(codes::UPDATE_CONSUMER_OFFSET, topic, group)
    }

    /// A commit from a client before 4.9.5, which does not name its broker.
    fn unnamed_commit() -> RemotingCommand {
        let mut request = RemotingCommand::create_remoting_command(codes::UPDATE_CONSUMER_OFFSET);
        request.add_ext_field("topic", "T");
        request.add_ext_field("consumerGroup", "G");
        request
    }

    /// Whether `turn` may go ahead now (its wait is over at once).
    async fn may_go(turn: &mut Turn) -> bool {
        tokio::time::timeout(Duration::from_millis(50), turn.wait()).await.is_ok()
    }

    #[tokio::test]
    async fn a_groups_commits_and_queries_on_a_topic_go_one_at_a_time_in_the_order_they_came() {
        let turns = OffsetTurns::default();
        let mut first = turns.take(&commit("T", "G"), None).expect("a commit takes a turn");
        let mut second =
            turns.take(&offset_request(codes::QUERY_CONSUMER_OFFSET, "T", "G"), None).expect("a query too");
        let mut third = turns.take(&commit("T", "G"), None).expect("a turn");

        assert!(may_go(&mut first).await, "the first goes at once");
        assert!(!may_go(&mut second).await, "the second waits while the first is not over");
        drop(first);
        assert!(may_go(&mut second).await, "the second goes once the first is over");
        assert!(!may_go(&mut third).await, "the third waits for the second");
        drop(second);
        assert!(may_go(&mut third).await);
        drop(third);
        assert_eq!(turns.busy_lanes(), 0, "a lane with no turn left is forgotten");
    }

    #[tokio::test]
    async fn other_groups_topics_and_brokers_do_not_wait() {
        let turns = OffsetTurns::default();
        let _busy = turns.take(&commit("T", "G"), None).expect("a turn");
        let mut other_group = turns.take(&commit("T", "H"), None).expect("a turn");
        let mut other_topic = turns.take(&commit("U", "G"), None).expect("a turn");
        let mut other_broker = turns.take(&unnamed_commit(), Some("broker-b")).expect("a turn");
        assert!(may_go(&mut other_group).await);
        assert!(may_go(&mut other_topic).await);
        assert!(may_go(&mut other_broker).await, "a broker that does not answer holds up only its own lanes");
        assert_eq!(turns.busy_lanes(), 4);
    }

    #[tokio::test]
    async fn a_request_without_a_broker_name_is_in_the_lane_of_the_brokers_port_it_came_in_on() {
        let turns = OffsetTurns::default();
        let _named = turns.take(&commit("T", "G"), None).expect("a turn");
        let mut on_its_port = turns.take(&unnamed_commit(), Some("broker-a")).expect("a turn");
        assert!(!may_go(&mut on_its_port).await, "broker-a's lane");
        let mut nowhere = turns.take(&unnamed_commit(), None).expect("a turn");
        assert!(may_go(&mut nowhere).await, "a lane of its own until its broker is known");
    }

    #[tokio::test]
    async fn a_turn_given_up_while_waiting_lets_the_next_go_after_the_one_before_it() {
        let turns = OffsetTurns::default();
        let first = turns.take(&commit("T", "G"), None).expect("a turn");
        let second = turns.take(&commit("T", "G"), None).expect("a turn");
        let mut third = turns.take(&commit("T", "G"), None).expect("a turn");
        drop(second);
        assert!(!may_go(&mut third).await, "still behind the first");
        drop(first);
        assert!(may_go(&mut third).await);
    }

    #[tokio::test]
    async fn a_flood_of_commits_in_one_lane_waits_without_deep_recursion() {
        // A client may send a hundred thousand commits of one queue in one write: each waits in the lane, and
        // waiting must not cost stack in proportion to the turns ahead of it.
        let turns = OffsetTurns::default();
        let mut queued: std::collections::VecDeque<Turn> =
            (0..100_000).map(|_| turns.take(&commit("T", "G"), None).expect("a turn")).collect();
        let mut last = queued.pop_back().expect("turns");
        assert!(!may_go(&mut last).await, "behind all the others");
        let mut first = queued.pop_front().expect("turns");
        assert!(may_go(&mut first).await);
        drop(first);
        drop(queued);
        assert!(may_go(&mut last).await, "every turn ahead of it is over");
    }

    #[test]
    fn only_offset_requests_naming_topic_and_group_take_turns() {
        let turns = OffsetTurns::default();
        assert!(turns.take(&offset_request(codes::PULL_MESSAGE, "T", "G"), None).is_none(), "pulls may be held long");
        let mut no_group = RemotingCommand::create_remoting_command(codes::UPDATE_CONSUMER_OFFSET);
        no_group.add_ext_field("topic", "T");
        assert!(turns.take(&no_group, Some("broker-a")).is_none(), "the broker refuses it anyway");
    }
}
