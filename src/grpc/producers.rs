//! The producers with an open Telemetry stream, by the topics their Settings publish to: where a broker's
//! transaction check-back goes, as a `RecoverOrphanedTransactionCommand` to one producer of the message's
//! topic (Apache's proxy picks one the same way). The SDK runs its `TransactionChecker` and answers with an
//! `EndTransaction` whose source is `SOURCE_SERVER_CHECK`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;
use tokio::sync::mpsc;

use super::proto as pb;

/// Where a Telemetry stream's commands go.
pub(super) type Commands = mpsc::Sender<Result<pb::TelemetryCommand, tonic::Status>>;

/// The open producer streams.
#[derive(Default)]
pub(super) struct Producers {
    streams: Mutex<HashMap<u64, Producer>>,
    next_stream: AtomicU64,
    /// Round-robin position among a topic's producers.
    turn: AtomicUsize,
}

struct Producer {
    topics: HashSet<String>,
    commands: Commands,
}

impl Producers {
    /// A new stream's number, for [`Producers::publishes`] and [`Producers::closed`].
    pub(super) fn open(&self) -> u64 {
        self.next_stream.fetch_add(1, Ordering::Relaxed)
    }

    /// Stream `stream` publishes to `topics` (its latest Settings say so).
    pub(super) fn publishes(&self, stream: u64, topics: HashSet<String>, commands: &Commands) {
        self.streams.lock().insert(stream, Producer { topics, commands: commands.clone() });
    }

    /// Stream `stream` ended.
    pub(super) fn closed(&self, stream: u64) {
        self.streams.lock().remove(&stream);
    }

    /// Sends `command` to one producer of `topic`, taking them in turn; false when none could take it.
    pub(super) fn send_to_one(&self, topic: &str, command: pb::TelemetryCommand) -> bool {
        let streams = self.streams.lock();
        let candidates: Vec<&Producer> = streams.values().filter(|p| p.topics.contains(topic)).collect();
        if candidates.is_empty() {
            return false;
        }
        let first = self.turn.fetch_add(1, Ordering::Relaxed);
        (0..candidates.len())
            .map(|n| candidates[(first + n) % candidates.len()])
            .any(|producer| producer.commands.try_send(Ok(command.clone())).is_ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command() -> pb::TelemetryCommand {
        pb::TelemetryCommand { status: None, command: None }
    }

    #[test]
    fn a_command_goes_to_one_producer_of_the_topic_in_turn_and_never_to_a_closed_stream() {
        let producers = Producers::default();
        let (a_tx, mut a_rx) = mpsc::channel(4);
        let (b_tx, mut b_rx) = mpsc::channel(4);
        let (a, b) = (producers.open(), producers.open());
        producers.publishes(a, HashSet::from(["t".to_owned()]), &a_tx);
        producers.publishes(b, HashSet::from(["t".to_owned(), "u".to_owned()]), &b_tx);
        assert!(!producers.send_to_one("other", command()), "nobody publishes there");
        assert!(producers.send_to_one("t", command()));
        assert!(producers.send_to_one("t", command()));
        assert_eq!((a_rx.try_recv().is_ok(), b_rx.try_recv().is_ok()), (true, true), "one each, in turn");
        producers.closed(b);
        assert!(!producers.send_to_one("u", command()), "the only producer of u left");
    }
}
