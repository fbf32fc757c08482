//! Client identity, the same rule on every front: a client id (a gRPC SDK's `x-mq-client-id`, a remoting
//! client's `clientID`) belongs to the token that first used it, on whichever front, for as long as a front
//! keeps it ([`ClientOwners`], one registry every front shares), and a front keeps a bounded number of them.
//!
//! A client id names whose deliveries are kept alive, given back at termination, and which producer is asked
//! about a transaction: another token using it (by mistake or on purpose) would take those over. So another
//! token's call under it is refused and changes nothing, and a new id past the front's bound is refused
//! rather than growing a map a stranger can fill. Each front keeps what its protocol needs beside the id (a
//! remoting client's connection and groups, a gRPC client's kind and request timeout) in the `T` of its
//! [`ClientIds`].

use std::collections::HashMap;
use std::sync::Arc;

use metrics::counter;
use parking_lot::Mutex;

use super::GatewayError;
use crate::auth::Caller;
use crate::metrics as m;

/// Whose each client id is, for every front at once: the token that first used it on any front, for as long
/// as any front keeps it. One registry, so an id alice's gRPC client uses is refused to mallory's remoting
/// client too (and the other way round), and a client id names one app whatever protocol it speaks. Each
/// front's [`ClientIds`] holds a handle of it; the fronts' own bounds keep it bounded.
#[derive(Clone, Default)]
pub struct ClientOwners {
    claims: Arc<Mutex<HashMap<String, Claim>>>,
}

/// One id's owner, and how many fronts keep the id now.
struct Claim {
    owner: String,
    fronts: usize,
}

impl ClientOwners {
    /// A front starts keeping `id` for `owner` (a token's name): refused when another token's.
    fn take(&self, id: &str, owner: &str) -> Result<(), GatewayError> {
        let mut claims = self.claims.lock();
        match claims.get_mut(id) {
            Some(claim) if claim.owner != owner => Err(taken(id)),
            Some(claim) => {
                claim.fronts += 1;
                Ok(())
            }
            None => {
                claims.insert(id.to_owned(), Claim { owner: owner.to_owned(), fronts: 1 });
                Ok(())
            }
        }
    }

    /// A front no longer keeps `id`: when no front does, it is anyone's again.
    fn release(&self, id: &str) {
        let mut claims = self.claims.lock();
        if let Some(claim) = claims.get_mut(id) {
            claim.fronts = claim.fronts.saturating_sub(1);
            if claim.fronts == 0 {
                claims.remove(id);
            }
        }
    }

    /// How many ids some front keeps.
    pub fn len(&self) -> usize {
        self.claims.lock().len()
    }

    /// Whether no front keeps any id.
    pub fn is_empty(&self) -> bool {
        self.claims.lock().is_empty()
    }
}

/// A front's clients by id, each with its owner's [`Caller`] and the front's own `T`, at most `max` of them;
/// whose each id is, [`ClientOwners`] says for every front.
pub struct ClientIds<T> {
    entries: HashMap<String, Owned<T>>,
    owners: ClientOwners,
    max: usize,
    /// The setting that bounds them, named in a refusal.
    setting: &'static str,
}

struct Owned<T> {
    /// The token that first used the id, as it last called: only the same token may use the id.
    owner: Caller,
    client: T,
}

impl<T> ClientIds<T> {
    /// No clients yet; at most `max` ids, bounded by the setting named `setting`; ids owned as `owners` says.
    pub fn new(max: usize, setting: &'static str, owners: ClientOwners) -> ClientIds<T> {
        ClientIds { entries: HashMap::new(), owners, max, setting }
    }

    /// `id` used by `caller`: its entry, made by `new` when the id is new. The entry's owner is the caller as it
    /// called now (its grants may have changed since).
    ///
    /// # Errors
    /// [`GatewayError::ClientIdTaken`] when another token uses the id (on this front or another),
    /// [`GatewayError::TooManyClients`] when a new id finds `max` ids kept; both counted, and neither changes
    /// anything.
    pub fn claim(&mut self, id: &str, caller: &Caller, new: impl FnOnce() -> T) -> Result<&mut T, GatewayError> {
        let known = self.entries.len();
        match self.entries.get_mut(id) {
            Some(entry) if entry.owner.name != caller.name => return Err(taken(id)),
            Some(_) => {}
            None if known >= self.max => {
                counter!(m::REQUESTS_REJECTED, "reason" => "too_many_clients").increment(1);
                return Err(GatewayError::TooManyClients { max: self.max, setting: self.setting });
            }
            None => {
                self.owners.take(id, &caller.name)?;
                let entry = Owned { owner: caller.clone(), client: new() };
                self.entries.insert(id.to_owned(), entry);
            }
        }
        let entry = self.entries.get_mut(id).ok_or_else(|| taken(id))?;
        entry.owner = caller.clone();
        Ok(&mut entry.client)
    }

    /// `id`'s entry when `caller` owns it, `None` when nobody uses the id.
    ///
    /// # Errors
    /// [`GatewayError::ClientIdTaken`] (counted) when another token uses the id.
    pub fn of_caller(&mut self, id: &str, caller: &Caller) -> Result<Option<&mut T>, GatewayError> {
        match self.entries.get_mut(id) {
            Some(entry) if entry.owner.name != caller.name => Err(taken(id)),
            Some(entry) => Ok(Some(&mut entry.client)),
            None => Ok(None),
        }
    }

    /// `id`'s entry, whoever owns it (for popgate's own bookkeeping, never for a caller's request).
    pub fn get_mut(&mut self, id: &str) -> Option<&mut T> {
        self.entries.get_mut(id).map(|entry| &mut entry.client)
    }

    /// `id`'s entry, whoever owns it.
    pub fn get(&self, id: &str) -> Option<&T> {
        self.entries.get(id).map(|entry| &entry.client)
    }

    /// Forgets `id`.
    pub fn remove(&mut self, id: &str) -> Option<T> {
        let removed = self.entries.remove(id)?;
        self.owners.release(id);
        Some(removed.client)
    }

    /// Keeps the clients `keep` says to.
    pub fn retain(&mut self, mut keep: impl FnMut(&str, &mut T) -> bool) {
        let owners = &self.owners;
        self.entries.retain(|id, entry| {
            let kept = keep(id, &mut entry.client);
            if !kept {
                owners.release(id);
            }
            kept
        });
    }

    /// Every client: its id, its owner, and the front's entry.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Caller, &T)> {
        self.entries.iter().map(|(id, entry)| (id.as_str(), &entry.owner, &entry.client))
    }

    /// How many ids are kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
}

fn taken(id: &str) -> GatewayError {
    counter!(m::REQUESTS_REJECTED, "reason" => "forbidden").increment(1);
    GatewayError::ClientIdTaken(id.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(name: &str) -> Caller {
        Caller::of_test_token(name, "*", "*")
    }

    #[test]
    fn an_id_is_its_first_users_and_a_new_id_past_the_bound_is_refused() {
        let (alice, bob) = (token("alice"), token("bob"));
        let mut ids: ClientIds<u32> = ClientIds::new(2, "front.max_clients", ClientOwners::default());
        *ids.claim("a@1", &alice, || 0).expect("new") += 1;
        *ids.claim("a@1", &alice, || 0).expect("alice's") += 1;
        assert_eq!(ids.get("a@1"), Some(&2));

        assert!(matches!(ids.claim("a@1", &bob, || 0), Err(GatewayError::ClientIdTaken(_))));
        assert!(matches!(ids.of_caller("a@1", &bob), Err(GatewayError::ClientIdTaken(_))));
        assert_eq!(ids.get("a@1"), Some(&2), "bob's calls change nothing");
        assert!(matches!(ids.of_caller("nobody", &bob), Ok(None)));

        ids.claim("b@1", &bob, || 7).expect("a second id");
        let full = ids.claim("c@1", &bob, || 0).expect_err("a third id");
        assert!(full.to_string().contains("front.max_clients"), "{full}");
        assert_eq!(ids.len(), 2);

        ids.remove("a@1");
        ids.claim("a@1", &bob, || 3).expect("a forgotten id is anyone's");
        assert_eq!(ids.iter().filter(|(_, owner, _)| owner.name == "bob").count(), 2);
    }

    #[test]
    fn an_id_is_its_first_users_on_every_front_and_anyones_once_no_front_keeps_it() {
        let (alice, mallory) = (token("alice"), token("mallory"));
        let owners = ClientOwners::default();
        let mut grpc: ClientIds<()> = ClientIds::new(10, "grpc.max_clients", owners.clone());
        let mut remoting: ClientIds<()> = ClientIds::new(10, "remoting.max_clients", owners.clone());

        grpc.claim("app@1", &alice, || ()).expect("alice's gRPC client");
        let refused = remoting.claim("app@1", &mallory, || ()).expect_err("another token, another front");
        assert!(matches!(refused, GatewayError::ClientIdTaken(_)), "{refused}");
        assert_eq!(remoting.len(), 0, "the refusal kept nothing");
        remoting.claim("app@1", &alice, || ()).expect("alice on the other front");
        assert_eq!(owners.len(), 1);

        grpc.remove("app@1");
        assert!(remoting.claim("app@1", &mallory, || ()).is_err(), "still kept by the remoting front");
        remoting.retain(|_, ()| false);
        assert!(owners.is_empty(), "no front keeps it");
        grpc.claim("app@1", &mallory, || ()).expect("anyone's again");
    }
}
