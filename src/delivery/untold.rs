//! ACKs this instance made at the broker for deliveries another instance of its tier handed out, while that
//! instance could not be reached: kept until the owner asks for them (its next look-up of its peers), so that
//! it does not hand those messages out again. Kept in the state store, so a `kill -9` of this instance between
//! the ACK and the owner's question loses none.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use metrics::counter;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::Target;
use crate::metrics as m;
use crate::store::{Change, Family, StateStore, StoreError};

/// Most notes kept, all owners together (each an id and a number: a few MB at most). Past it the oldest of the
/// owner with the most are dropped, and counted: their owner may hand them out again (at least once).
pub(super) const MAX_UNTOLD: usize = 100_000;

/// A delivery id and the hand-out ACKed.
pub type UntoldAck = (String, Option<u32>);

/// A note as stored, under `<owner>/<delivery id>`.
#[derive(Debug, Serialize, Deserialize)]
struct StoredNote {
    hand_out: Option<u32>,
    /// The order notes were made in, so the oldest is dropped first after a restart too.
    seq: u64,
}

#[derive(Default)]
struct Notes {
    by_owner: HashMap<String, VecDeque<(UntoldAck, u64)>>,
    total: usize,
    next_seq: u64,
}

/// The notes, by owner, and where they are kept.
pub(super) struct Untold {
    notes: Mutex<Notes>,
    store: Arc<StateStore>,
    max: usize,
}

fn note_key(owner: &str, delivery_id: &str) -> String {
    format!("{owner}/{delivery_id}")
}

impl Untold {
    /// The notes `store` keeps, at most `max` of them from now on.
    ///
    /// # Errors
    /// [`StoreError::Read`] when the store cannot be read.
    pub(super) fn load(store: Arc<StateStore>, max: usize) -> Result<Untold, StoreError> {
        let mut notes = Notes::default();
        store.for_each::<StoredNote>(Family::UntoldAcks, |key, note| {
            let (Some((owner, id)), Some(note)) = (key.split_once('/'), note) else { return };
            notes.by_owner.entry(owner.to_owned()).or_default().push_back(((id.to_owned(), note.hand_out), note.seq));
            notes.total += 1;
            notes.next_seq = notes.next_seq.max(note.seq + 1);
        })?;
        for queue in notes.by_owner.values_mut() {
            queue.make_contiguous().sort_by_key(|(_, seq)| *seq);
        }
        Ok(Untold { notes: Mutex::new(notes), store, max })
    }

    /// Notes that `target`, handed out by `owner`, was ACKed at the broker. Stored before it returns; a store
    /// that refuses the write leaves the note in memory only (logged), as good until this instance stops.
    pub(super) async fn remember(&self, owner: &str, target: Target<'_>) {
        let (seq, dropped) = {
            let mut notes = self.notes.lock();
            let mut dropped = None;
            if notes.total >= self.max {
                let longest = notes.by_owner.iter_mut().max_by_key(|(_, queue)| queue.len());
                if let Some((longest_owner, queue)) = longest {
                    if let Some(((id, _), _)) = queue.pop_front() {
                        dropped = Some(note_key(longest_owner, &id));
                        notes.total -= 1;
                        counter!(m::TIER_ACKS_UNTOLD).increment(1);
                    }
                }
            }
            let seq = notes.next_seq;
            notes.next_seq += 1;
            notes
                .by_owner
                .entry(owner.to_owned())
                .or_default()
                .push_back(((target.id.to_owned(), target.handout), seq));
            notes.total += 1;
            (seq, dropped)
        };
        let key = note_key(owner, target.id);
        let value = match serde_json::to_vec(&StoredNote { hand_out: target.handout, seq }) {
            Ok(value) => value,
            Err(error) => {
                tracing::warn!(%error, "An untold ACK could not be encoded; kept in memory only.");
                return;
            }
        };
        let mut changes = vec![Change::Put(Family::UntoldAcks, &key, value)];
        if let Some(dropped) = &dropped {
            changes.push(Change::Delete(Family::UntoldAcks, dropped));
        }
        if let Err(error) = self.store.apply(&changes).await {
            tracing::warn!(%error, owner, delivery = target.id, "An untold ACK could not be stored; kept in memory only.");
        }
    }

    /// What `owner` was not told yet; from now on it is told (and the notes are deleted).
    pub(super) async fn take(&self, owner: &str) -> Vec<UntoldAck> {
        let taken: Vec<UntoldAck> = {
            let mut notes = self.notes.lock();
            let queue = notes.by_owner.remove(owner).unwrap_or_default();
            notes.total -= queue.len();
            queue.into_iter().map(|(ack, _)| ack).collect()
        };
        if taken.is_empty() {
            return taken;
        }
        let keys: Vec<String> = taken.iter().map(|(id, _)| note_key(owner, id)).collect();
        let changes: Vec<Change<'_>> = keys.iter().map(|key| Change::Delete(Family::UntoldAcks, key)).collect();
        if let Err(error) = self.store.apply(&changes).await {
            // Told all the same; a restart before the next successful write tells them again (an ACK of what
            // is settled already is answered as such).
            tracing::warn!(%error, owner, "Told ACKs could not be deleted from the store.");
        }
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(id: &str) -> Target<'_> {
        Target { id, handout: Some(1) }
    }

    #[tokio::test]
    async fn notes_survive_a_restart_are_bounded_the_oldest_of_the_longest_dropped_and_told_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(StateStore::open(dir.path(), true).expect("open"));
        let untold = Untold::load(store.clone(), 3).expect("load");
        untold.remember("popgate-1", target("popgate-1~a")).await;
        untold.remember("popgate-1", target("popgate-1~b")).await;
        untold.remember("popgate-2", Target { id: "popgate-2~c", handout: None }).await;
        untold.remember("popgate-1", target("popgate-1~d")).await;
        drop(untold);

        // Reopened (this instance restarted): the same notes, but the one dropped to keep the bound.
        let untold = Untold::load(store, 3).expect("load");
        let first = untold.take("popgate-1").await;
        assert_eq!(first, vec![("popgate-1~b".to_owned(), Some(1)), ("popgate-1~d".to_owned(), Some(1))]);
        assert_eq!(untold.take("popgate-2").await, vec![("popgate-2~c".to_owned(), None)]);
        assert!(untold.take("popgate-2").await.is_empty(), "told once");
        assert!(untold.take("popgate-1").await.is_empty(), "told once");
    }
}
