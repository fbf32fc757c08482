//! Client instances of one use (requests, POP long polls, relayed requests), each given at most
//! [`CALLERS_PER_INSTANCE`] callers at once.
//!
//! The crate bounds the requests in flight on one client instance (512 pending, across all its connections)
//! and refuses the next one at once ("queue saturated"). A long poll holds its place for seconds: with 1 000
//! subscriptions (a POP each) or 1 000 relayed pulls on one instance, half of them were refused and retried
//! every second, and the churn starved the sends beside them. So each use gets as many instances as its
//! callers need, named `<name>`, `<name>-1`, `<name>-2`, …: each its own connection per broker. An instance,
//! once started, stays up with popgate (a few idle connections); callers take the first one with room.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use rocketmq_client_rust::ClientInstanceHandle;
use tokio::sync::OnceCell;

use super::{BrokerClient, BrokerError};

/// Callers one instance carries at once (each with one request in flight), below the crate's 512 so that the
/// instance's own requests (heartbeats, route queries) always find a place.
pub(crate) const CALLERS_PER_INSTANCE: usize = 400;
/// Idle handles an instance keeps for its next callers (making a handle takes the crate's pool lock).
const IDLE_HANDLES_KEPT: usize = 64;

/// The instances of one use.
pub(crate) struct InstanceSpread {
    name: &'static str,
    instances: Mutex<Vec<Arc<SpreadInstance>>>,
}

/// One client instance of a spread.
struct SpreadInstance {
    name: String,
    /// popgate's own handle, made and started by the first caller; it keeps the instance up.
    keeper: OnceCell<ClientInstanceHandle>,
    /// Callers holding a handle on it now.
    callers: AtomicUsize,
    idle: Mutex<Vec<ClientInstanceHandle>>,
}

/// A handle on an instance of a spread, counted against the instance until dropped.
pub struct SpreadHandle {
    instance: Arc<SpreadInstance>,
    handle: Option<ClientInstanceHandle>,
}

impl InstanceSpread {
    /// A spread whose first instance is named `name`. Nothing starts until the first caller.
    pub(crate) fn new(name: &'static str) -> InstanceSpread {
        InstanceSpread { name, instances: Mutex::new(Vec::new()) }
    }

    /// A handle on the first instance with room, started if it is new.
    ///
    /// # Errors
    /// [`BrokerError::Client`] when the crate cannot make or start the instance.
    pub(crate) async fn check_out(&self, client: &BrokerClient) -> Result<SpreadHandle, BrokerError> {
        let instance = self.place();
        // The count was taken with the place: dropping `reserved` on an error below gives it back.
        let mut reserved = SpreadHandle { instance, handle: None };
        let instance = &reserved.instance;
        instance
            .keeper
            .get_or_try_init(|| async {
                let keeper = client.instance_handle(&instance.name)?;
                keeper.start().await.map_err(|e| BrokerError::Client(e.to_string()))?;
                tracing::debug!(instance = %instance.name, "Started a client instance.");
                Ok::<_, BrokerError>(keeper)
            })
            .await?;
        let idle = instance.idle.lock().pop();
        reserved.handle = Some(match idle {
            Some(handle) => handle,
            None => client.instance_handle(&instance.name)?,
        });
        Ok(reserved)
    }

    /// The first instance with room (a new one when every instance is full), its count already raised.
    fn place(&self) -> Arc<SpreadInstance> {
        let mut instances = self.instances.lock();
        let with_room = instances.iter().find(|i| {
            i.callers
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < CALLERS_PER_INSTANCE).then_some(n + 1))
                .is_ok()
        });
        if let Some(instance) = with_room {
            return instance.clone();
        }
        let name = match instances.len() {
            0 => self.name.to_owned(),
            n => format!("{}-{n}", self.name),
        };
        let instance = Arc::new(SpreadInstance {
            name,
            keeper: OnceCell::new(),
            callers: AtomicUsize::new(1),
            idle: Mutex::new(Vec::new()),
        });
        instances.push(instance.clone());
        instance
    }

    /// How many instances the spread has made so far.
    #[cfg(test)]
    fn instances(&self) -> usize {
        self.instances.lock().len()
    }

    /// Gives back every idle handle and popgate's own, which stops the instances.
    pub(crate) async fn shutdown(&self) {
        let instances: Vec<_> = self.instances.lock().drain(..).collect();
        for instance in instances {
            let idle: Vec<_> = instance.idle.lock().drain(..).collect();
            for handle in idle {
                handle.shutdown_owned().await;
            }
            if let Some(keeper) = instance.keeper.get() {
                keeper.shutdown_owned().await;
            }
        }
    }
}

impl SpreadHandle {
    pub fn handle(&self) -> &ClientInstanceHandle {
        self.handle.as_ref().expect("a checked-out handle holds its handle until dropped")
    }
}

impl Drop for SpreadHandle {
    fn drop(&mut self) {
        self.instance.callers.fetch_sub(1, Ordering::AcqRel);
        let Some(handle) = self.handle.take() else { return };
        {
            let mut idle = self.instance.idle.lock();
            if idle.len() < IDLE_HANDLES_KEPT {
                idle.push(handle);
                return;
            }
        }
        // A handle merely dropped leaves the instance's lease count raised for good (and the crate warns of
        // each): give it back; the instance stays up while its keeper lives.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { handle.shutdown_owned().await });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn callers_fill_one_instance_before_the_next_is_made_and_a_freed_place_is_taken_again() {
        let spread = InstanceSpread::new("popgate-pop");
        let first: Vec<_> = (0..CALLERS_PER_INSTANCE).map(|_| spread.place()).collect();
        assert!(first.iter().all(|i| i.name == "popgate-pop"));
        let second = spread.place();
        assert_eq!(second.name, "popgate-pop-1");
        assert_eq!(spread.instances(), 2);
        // A place given back on the first instance is taken before the second's.
        first[0].callers.fetch_sub(1, Ordering::AcqRel);
        assert_eq!(spread.place().name, "popgate-pop");
        assert_eq!(spread.place().name, "popgate-pop-1");
        assert_eq!(second.callers.load(Ordering::Acquire), 2);
    }
}
