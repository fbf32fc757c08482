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
//! So a topic and group's commits and offset queries take turns: a turn is taken as its frame is read (in the
//! order the client sent them), and each waits until the one before it was answered or given up, one-way retries
//! included. A query then also sees every commit sent before it, as it would straight at the broker.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures::future::{BoxFuture, FutureExt, Shared};
use parking_lot::Mutex;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;
use tokio::sync::oneshot;

use super::codes;
use super::service::field;

/// Resolves once a turn and every turn before it in its lane are over (answered, given up, or dropped with its
/// task): a turn dropped while it still waits does not let the next one go ahead of the one it waited for.
type Over = Shared<BoxFuture<'static, ()>>;

/// Whose turns follow each other: the broker keeps offsets by topic and group.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Lane {
    topic: String,
    group: String,
}

/// The last turn taken in each lane that has a turn not yet over.
#[derive(Default)]
pub(super) struct OffsetTurns {
    lanes: Arc<Mutex<HashMap<Lane, (u64, Over)>>>,
    next_id: AtomicU64,
}

impl OffsetTurns {
    /// A turn for `request` when it is an offset commit or query (`None` for anything else): taken now, behind
    /// every turn of its lane taken before.
    pub fn take(&self, request: &RemotingCommand) -> Option<Turn> {
        if request.code() != codes::UPDATE_CONSUMER_OFFSET && request.code() != codes::QUERY_CONSUMER_OFFSET {
            return None;
        }
        let lane =
            Lane { topic: field(request, "topic")?.to_owned(), group: field(request, "consumerGroup")?.to_owned() };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (over, this_over) = oneshot::channel::<()>();
        let mut lanes = self.lanes.lock();
        let after = lanes.get(&lane).map(|(_, before)| before.clone());
        let all_over = {
            let before = after.clone();
            async move {
                if let Some(before) = before {
                    before.await;
                }
                // A dropped sender ends the turn, however its request's task ended.
                let _ = this_over.await;
            }
        };
        lanes.insert(lane.clone(), (id, all_over.boxed().shared()));
        drop(lanes);
        Some(Turn { lanes: self.lanes.clone(), lane, id, after, _over: over })
    }

    /// Lanes with a turn not yet over.
    #[cfg(test)]
    fn busy_lanes(&self) -> usize {
        self.lanes.lock().len()
    }
}

/// One request's place in its lane; the next turn starts when this one is dropped.
pub(super) struct Turn {
    lanes: Arc<Mutex<HashMap<Lane, (u64, Over)>>>,
    lane: Lane,
    id: u64,
    /// The turn before this one, until it is over.
    after: Option<Over>,
    /// Dropped with the turn, which starts the next.
    _over: oneshot::Sender<()>,
}

impl Turn {
    /// Waits until every earlier turn of the lane is over.
    pub async fn wait(&mut self) {
        if let Some(before) = self.after.take() {
            before.await;
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        // The lane's last turn leaves no one waiting: the lane goes, so lanes do not pile up.
        let mut lanes = self.lanes.lock();
        if lanes.get(&self.lane).is_some_and(|(last, _)| *last == self.id) {
            lanes.remove(&self.lane);
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
        request
    }

    fn commit(topic: &str, group: &str) -> RemotingCommand {
        offset_request(codes::UPDATE_CONSUMER_OFFSET, topic, group)
    }

    /// Whether `turn` may go ahead now (its wait is over at once).
    async fn may_go(turn: &mut Turn) -> bool {
        tokio::time::timeout(Duration::from_millis(50), turn.wait()).await.is_ok()
    }

    #[tokio::test]
    async fn a_groups_commits_and_queries_on_a_topic_go_one_at_a_time_in_the_order_they_came() {
        let turns = OffsetTurns::default();
        let mut first = turns.take(&commit("T", "G")).expect("a commit takes a turn");
        let mut second = turns.take(&offset_request(codes::QUERY_CONSUMER_OFFSET, "T", "G")).expect("a query too");
        let mut third = turns.take(&commit("T", "G")).expect("a turn");

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
    async fn other_groups_and_topics_do_not_wait() {
        let turns = OffsetTurns::default();
        let _busy = turns.take(&commit("T", "G")).expect("a turn");
        let mut other_group = turns.take(&commit("T", "H")).expect("a turn");
        let mut other_topic = turns.take(&commit("U", "G")).expect("a turn");
        assert!(may_go(&mut other_group).await);
        assert!(may_go(&mut other_topic).await);
        assert_eq!(turns.busy_lanes(), 3);
    }

    #[tokio::test]
    async fn a_turn_given_up_while_waiting_lets_the_next_go_after_the_one_before_it() {
        let turns = OffsetTurns::default();
        let first = turns.take(&commit("T", "G")).expect("a turn");
        let second = turns.take(&commit("T", "G")).expect("a turn");
        let mut third = turns.take(&commit("T", "G")).expect("a turn");
        drop(second);
        assert!(!may_go(&mut third).await, "still behind the first");
        drop(first);
        assert!(may_go(&mut third).await);
    }

    #[test]
    fn only_offset_requests_naming_topic_and_group_take_turns() {
        let turns = OffsetTurns::default();
        assert!(turns.take(&offset_request(codes::PULL_MESSAGE, "T", "G")).is_none(), "pulls may be held long");
        let mut no_group = RemotingCommand::create_remoting_command(codes::UPDATE_CONSUMER_OFFSET);
        no_group.add_ext_field("topic", "T");
        assert!(turns.take(&no_group).is_none(), "the broker refuses it anyway");
    }
}
